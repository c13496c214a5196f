"""``python -m zeroflow.memory --config X ...``: the memory table of a trainer config (the
program lives with the trainer, ``zeroflow.cli.memory``; the library here knows no
configs)."""

import sys

from zeroflow.cli.memory import main

if __name__ == "__main__":
    sys.exit(main())
