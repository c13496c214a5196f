"""``python -m zeroflow.export --run RUN_DIR --out weights.safetensors`` (or ``.npz``): the

The program is ``zeroflow.cli.export``; this module only lets ``python -m zeroflow.export`` start it."""

import sys

from zeroflow.cli.export import main

if __name__ == "__main__":
    sys.exit(main())
