"""Shared command-line plumbing: one readable error line instead of a traceback."""
from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Callable, Sequence

EXPECTED_ERRORS = (ValueError, FileNotFoundError, RuntimeError)


def set_cpu_devices(count: int | None) -> None:
    """Emulate ``count`` CPU devices; must run before jax creates its backend."""
    if count:
        import jax
        jax.config.update("jax_num_cpu_devices", int(count))


def run_cli(prog: str, main: Callable[[argparse.Namespace], int], parser: argparse.ArgumentParser,
            argv: Sequence[str] | None = None) -> int:
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
        print(f"{prog}: error: {message}", file=sys.stderr)
        return 2 if isinstance(e, ValueError) else 1
