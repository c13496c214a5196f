"""Shared command-line plumbing: one readable error line instead of a traceback.

Exit codes, the same for every command: 2 for a problem with what was given (a config, a path,
a file that cannot be read: ``prog: error: <one line>``), 1 for a run that failed on its own
(e.g. a diverging loss), 128 + N for a run stopped by signal N after saving. Set
ZEROFLOW_TRACEBACK=1 to see the full traceback instead.
"""

from __future__ import annotations

import argparse
import errno
import logging
import math
import os
import shutil
import sys
from collections.abc import Callable, Sequence

BAD_INPUT = (ValueError, FileNotFoundError, NotADirectoryError, IsADirectoryError, PermissionError)
"Errors about what the user gave: exit 2."
EXPECTED_ERRORS = (*BAD_INPUT, OSError, RuntimeError)


class ArgumentParser(argparse.ArgumentParser):
    """argparse, but a bad flag is one line (``prog: error: ...``, exit 2) that points to
    ``--help`` instead of printing the whole usage block above it."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (--help lists the flags)\n")


def at_least(low: int):
    """An argparse type: an int no smaller than ``low``."""

    def parse(text: str) -> int:
        value = int(text)  # argparse turns a ValueError here into "invalid parse value"
        if value < low:
            raise argparse.ArgumentTypeError(f"must be at least {low}, got {value}")
        return value

    parse.__name__ = "int"
    return parse


def non_negative_float(text: str) -> float:
    """An argparse type: a finite float >= 0."""
    value = float(text)
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text}")
    return value


non_negative_float.__name__ = "float"


def set_cpu_devices(count: int | None) -> None:
    """Emulate ``count`` CPU devices; must run before jax creates its backend."""
    if count:
        import jax

        jax.config.update("jax_num_cpu_devices", int(count))


def run_cli(
    prog: str,
    main: Callable[[argparse.Namespace], int],
    parser: argparse.ArgumentParser,
    argv: Sequence[str] | None = None,
) -> int:
    """Parse, run, and turn the errors a user can cause into ``prog: error: <one line>``."""
    args = parser.parse_intermixed_args(list(sys.argv[1:] if argv is None else argv))
    logging.basicConfig(level=logging.WARNING, format=f"{prog}: %(levelname)s: %(message)s")
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    try:
        return main(args)
    except EXPECTED_ERRORS as e:
        if os.environ.get("ZEROFLOW_TRACEBACK"):
            raise
        message = " ".join(str(e).split("\n")[0:1]) or type(e).__name__
        if isinstance(e, OSError) and e.errno == errno.ENOSPC and e.filename:
            message = f"{message} ({_free_bytes(e.filename)} bytes free there)"
        print(f"{prog}: error: {message}", file=sys.stderr)
        return 2 if isinstance(e, BAD_INPUT) else 1


def _free_bytes(path) -> str:
    folder = os.path.dirname(os.path.abspath(path))
    try:
        return f"{shutil.disk_usage(folder).free:,}"
    except OSError:
        return "unknown"
