"""``python -m zeroflow.launch --processes P [--cpu-devices D] -- COMMAND ...``

The program is ``zeroflow.cli.launch``; this module only lets ``python -m zeroflow.launch`` start it."""

import sys

from zeroflow.cli.launch import main

if __name__ == "__main__":
    sys.exit(main())
