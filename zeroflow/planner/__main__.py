"""``python -m zeroflow.planner --config X [--gpus h100,a100,l4] [--devices 1,8]``: the plan
per GPU x device count (the program lives with the other commands, ``zeroflow.cli.planner``)."""

import sys

from zeroflow.cli.planner import main

if __name__ == "__main__":
    sys.exit(main())
