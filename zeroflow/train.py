"""``python -m zeroflow.train --config configs/tiny.yaml [section.key=value ...]``

The program is ``zeroflow.cli.train``; this module only lets ``python -m zeroflow.train`` start it."""

import sys

from zeroflow.cli.train import main

if __name__ == "__main__":
    sys.exit(main())
