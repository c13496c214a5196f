"""Ctrl-C and SIGTERM while a command starts: one line and the signal's exit code, at once.

A KeyboardInterrupt raised at an arbitrary point of start-up lands in whatever runs then: an
import (a raw traceback), a garbage-collection callback of XLA's (printed as "Exception ignored"
and lost, so the run goes on), or a compile whose threads are torn down under it (a segfault).
Before the first step there is nothing to keep, so the command ends on the spot instead: the
handler writes one line and leaves with ``os._exit`` (no interpreter teardown, no half-run
finalizers). The trainer replaces the handler with its own for the steps (it saves a
checkpoint first) and puts this one back after.

It is installed only for the ``python -m zeroflow.<command>`` programs, before jax is imported
(``zeroflow.cli.common.start_command``); ``import zeroflow`` leaves the process's signals alone.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
from collections.abc import Callable, Iterator

COMMANDS = ("train", "sample", "export", "launch", "memory", "planner")
"The ``python -m zeroflow.<name>`` programs."


def command() -> str | None:
    """The zeroflow command this process runs as ``python -m zeroflow.<name>``, if any."""
    argv = list(getattr(sys, "orig_argv", ()))
    for i, arg in enumerate(argv[:-1]):
        if arg == "-m":
            module = argv[i + 1]
            name = module.removeprefix("zeroflow.")
            return name if module.startswith("zeroflow.") and name in COMMANDS else None
    return None


_stderr: int | None = None
"A copy of descriptor 2 made at install: while jax starts, 2 may point at /dev/null."
_installed_for: str | None = None
"The command the handler was installed for, named in its line."


_undo: list[Callable[[], None]] = []
"What ``undone_if_stopped`` blocks ask to be undone before the process ends, innermost last."


@contextlib.contextmanager
def undone_if_stopped(undo: Callable[[], None]) -> Iterator[None]:
    """Call ``undo`` if a signal ends the process at once while inside this block: e.g. a run
    folder made for a run that never started is removed, as a failed start removes it."""
    _undo.append(undo)
    try:
        yield
    finally:
        _undo.remove(undo)


def _end_now(signum: int, _frame) -> None:
    name = signal.Signals(signum).name
    for undo in reversed(_undo):
        with contextlib.suppress(Exception):  # the process ends whatever happens
            undo()
    os.write(
        _stderr if _stderr is not None else 2,
        f"zeroflow.{_installed_for}: stopped by {name}\n".encode(),
    )
    os._exit(128 + signum)


def install(command_name: str) -> None:
    """SIGINT and SIGTERM end this process, the command ``command_name``, at once (see above)."""
    global _stderr, _installed_for
    _installed_for = command_name
    _stderr = os.dup(2)
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, _end_now)
