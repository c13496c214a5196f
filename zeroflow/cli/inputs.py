"""Checks of what the user gives train, sample and export, made where it is read: a bound on
each integer flag (with the reason for it), paths that the OS would refuse for their form (a
name too long, a folder that is a file), and an output that already exists. Each problem is
a ``ValueError`` naming the flag, which the CLIs report in one line with exit code 2."""

from __future__ import annotations

import argparse
from pathlib import Path

from zeroflow.util.limits import SEED_MAX, STEP_MAX
from zeroflow.util.paths import path_problem

__all__ = ["SEED_MAX", "STEP_MAX", "check_new_output", "check_path", "int_between", "non_empty"]

CPU_DEVICES_MAX = 4096
"More emulated CPU devices than any mesh zeroflow plans for; each costs host memory and threads."


def int_between(low: int, high: int, why: str):
    """An argparse type: an int in ``[low, high]``; ``why`` says where ``high`` comes from."""

    def parse(text: str) -> int:
        value = int(text)  # argparse turns a ValueError here into "invalid int value"
        if value < low:
            raise argparse.ArgumentTypeError(f"must be at least {low}, got {value}")
        if value > high:
            raise argparse.ArgumentTypeError(f"must be at most {high:,} ({why}), got {value}")
        return value

    parse.__name__ = "int"
    return parse


def seed_type():
    return int_between(0, SEED_MAX, "what a JAX key holds: a larger seed repeats a smaller one")


def non_empty(text: str) -> str:
    """An argparse type: a string that is not empty (or only spaces)."""
    if not text.strip():
        raise argparse.ArgumentTypeError("must not be empty")
    return text


non_empty.__name__ = "text"


def check_path(flag: str, path: Path) -> None:
    """ValueError naming ``flag`` when ``path`` cannot name a file or folder here."""
    if problem := path_problem(path):
        raise ValueError(f"{flag} {_short(path)}: {problem}")


def check_new_output(flag: str, path: Path) -> None:
    """``path`` must not exist yet (a file, or a folder with anything in it): a command
    refuses it before any work instead of replacing it at the end."""
    check_path(flag, path)
    if path.is_file() or (path.is_dir() and any(path.iterdir())):
        raise ValueError(
            f"{flag} {_short(path)} already exists; remove it or give another path "
            "(nothing is overwritten)"
        )


def _short(path: Path, limit: int = 120) -> str:
    text = str(path)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"
