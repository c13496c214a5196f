"""``python -m zeroflow.sample --run RUN_DIR --prompt "def "``: continue a prompt with the latest

The program is ``zeroflow.cli.sample``; this module only lets ``python -m zeroflow.sample`` start it."""

import sys

from zeroflow.cli.sample import main

if __name__ == "__main__":
    sys.exit(main())
