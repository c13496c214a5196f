"""Shared command-line plumbing: one readable error line instead of a traceback.

Every command writes its errors as ``zeroflow.<command>: error: <one line>`` and its warnings as
``zeroflow.<command>: warning: <one line>`` (``error_line``, ``warning_line``, and the logging
set up by ``start_command``). Exit codes, the same for every command: 2 for a problem with what
was given (a config, a flag, a path, a file that cannot be read), 1 for a run that failed on its
own (e.g. a diverging loss), 128 + N for a run stopped by signal N after saving. Set
ZEROFLOW_TRACEBACK=1 to see the full traceback instead.

``start_command`` prepares a ``python -m zeroflow.<command>`` process before anything imports
jax (``zeroflow/cli/__init__.py`` calls it), ``start_script`` one of the project's programs in
scripts/ and experiments/ (each calls it first); ``import zeroflow`` alone does none of it.
"""

from __future__ import annotations

import argparse
import errno
import logging
import math
import os
import shutil
import sys
import warnings
from collections.abc import Callable, Sequence

from zeroflow.util import interrupts, quiet_jax

BAD_INPUT = (ValueError, FileNotFoundError, NotADirectoryError, IsADirectoryError, PermissionError)
"Errors about what the user gave: exit 2."
EXPECTED_ERRORS = (*BAD_INPUT, OSError, RuntimeError)


def command_name(prog: str) -> str:
    """``zeroflow.train`` of ``python -m zeroflow.train`` (argparse's usage line) or itself."""
    return prog.removeprefix("python -m ").strip()


def error_line(prog: str, message: str) -> str:
    """The one line a command writes for an error."""
    return f"{command_name(prog)}: error: {message}"


def warning_line(prog: str, message: str) -> str:
    """The one line a command writes for a warning."""
    return f"{command_name(prog)}: warning: {message}"


class _CommandFormatter(logging.Formatter):
    """Log records as the command's lines: ``zeroflow.train: warning: <message>``."""

    def __init__(self, prog: str):
        super().__init__()
        self.prog = command_name(prog)

    def format(self, record: logging.LogRecord) -> str:
        text = f"{self.prog}: {record.levelname.lower()}: {record.getMessage()}"
        if record.exc_info:
            text += "\n" + self.formatException(record.exc_info)
        return text


def _log_as(prog: str) -> None:
    """Warnings and errors logged in this process (zeroflow's, and the libraries' that log
    through Python's logging) print as the command's lines. Set before anything else
    configures logging (a library's first log line would set Python's default format)."""
    handler = logging.StreamHandler()
    handler.setFormatter(_CommandFormatter(prog))
    logging.basicConfig(level=logging.WARNING, handlers=[handler])
    default_show = warnings.showwarning

    def show(message, category, filename, lineno, file=None, line=None):
        if f"{os.sep}zeroflow{os.sep}" not in filename:  # another library's: as Python shows it
            return default_show(message, category, filename, lineno, file, line)
        print(warning_line(prog, str(message)), file=file or sys.stderr)

    warnings.showwarning = show


def start_command(command: str | None = None) -> None:
    """Prepare this process if it is ``python -m zeroflow.<command>`` (or a program that runs
    ``command``'s ``main`` as that would, and says so), before jax is imported: a Ctrl-C or
    SIGTERM while it starts ends it with one line (``util.interrupts``); where the CUDA plugin
    is installed without a driver, jax runs on the CPU without the plugin's noise
    (``util.quiet_jax``); warnings print as the command's lines. Any other process (a program
    or a test importing the CLI modules) is left as it is."""
    command = command or interrupts.command()
    if command is None:
        return
    interrupts.install(command)
    quiet_jax.quiet_for_this_command()
    _log_as(f"zeroflow.{command}")


def start_script() -> None:
    """Prepare one of the project's own programs (``python scripts/<x>.py``,
    ``python experiments/<x>.py``, a benchmark's child process) before it imports jax, as
    ``start_command`` prepares the commands: where the CUDA plugin is installed without a
    driver, jax runs on the CPU without the plugin's noise (``util.quiet_jax``). On a machine
    with a GPU, or where ``JAX_PLATFORMS`` names another platform, nothing changes. Its signals,
    warnings and logging stay Python's own."""
    quiet_jax.quiet_for_this_command()


class ArgumentParser(argparse.ArgumentParser):
    """argparse, but a bad flag is one line (``zeroflow.<command>: error: ...``, exit 2) that
    points to ``--help`` instead of printing the whole usage block above it."""

    def error(self, message: str):
        self.exit(2, error_line(self.prog, f"{message} (--help lists the flags)") + "\n")


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
    if not logging.root.handlers:  # called from a program rather than as a command
        handler = logging.StreamHandler()
        handler.setFormatter(_CommandFormatter(prog))
        logging.basicConfig(level=logging.WARNING, handlers=[handler])
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    try:
        return main(args)
    except EXPECTED_ERRORS as e:
        if os.environ.get("ZEROFLOW_TRACEBACK"):
            raise
        message = " ".join(str(e).split("\n")[0:1]) or type(e).__name__
        if isinstance(e, OSError) and e.errno == errno.ENOSPC and e.filename:
            message = f"{message} ({_free_bytes(e.filename)} bytes free there)"
        print(error_line(prog, message), file=sys.stderr)
        _forget_abandoned_writes()
        return 2 if isinstance(e, BAD_INPUT) else 1


def _forget_abandoned_writes() -> None:
    """After the error line, the process ends with the failed operation's pending work dropped:
    e.g. the array writes of a checkpoint that ran out of room, whose coroutines Python would
    report one by one at exit ("coroutine ... was never awaited") under the line that already
    said what failed."""
    warnings.filterwarnings(
        "ignore", message="coroutine .* was never awaited", category=RuntimeWarning
    )


def _free_bytes(path) -> str:
    folder = os.path.dirname(os.path.abspath(path))
    try:
        return f"{shutil.disk_usage(folder).free:,}"
    except OSError:
        return "unknown"
