"""The flags of ``python -m zeroflow.memory`` and ``python -m zeroflow.planner``, each checked
where argparse reads it: a bad value is one line naming the flag and what it takes, exit 2,
before jax is imported or anything is compiled or written. Nothing here imports jax."""

from __future__ import annotations

import argparse
import importlib.metadata
import math
import os

from zeroflow.cli.common import ArgumentParser
from zeroflow.util.compat import cuda_plugin_install_hint, cuda_plugin_module
from zeroflow.util.units import parse_bytes

STAGE_CHOICES = (0, 1, 2, 3)


class PlanParser(ArgumentParser):
    """``prog`` is how the command is typed (``python -m zeroflow.memory``); its errors read
    ``zeroflow.memory: error: ...``, the prefix every zeroflow command's errors share."""

    def error(self, message: str):
        name = self.prog.removeprefix("python -m ")
        self.exit(2, f"{name}: error: {message} (--help lists the flags)\n")


def _int(text: str) -> int:
    try:
        return int(text.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"takes a whole number, got {text!r}") from None


def count(text: str) -> int:
    """An int >= 1."""
    value = _int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


count.__name__ = "int"


def at_least(low: int):
    """An int >= ``low``."""

    def parse(text: str) -> int:
        value = _int(text)
        if value < low:
            raise argparse.ArgumentTypeError(f"must be at least {low}, got {value}")
        return value

    parse.__name__ = "int"
    return parse


def counts(text: str) -> list[int]:
    """Comma-separated ints >= 1 (e.g. 1,8,16)."""
    items = [x for x in text.split(",") if x.strip()]
    if not items:
        raise argparse.ArgumentTypeError(f"takes comma-separated whole numbers >= 1, got {text!r}")
    values = [_int(x) for x in items]
    bad = [v for v in values if v < 1]
    if bad:
        raise argparse.ArgumentTypeError(f"takes whole numbers >= 1, got {bad[0]}")
    return values


counts.__name__ = "list of ints"


def stages(text: str) -> list[int]:
    """Comma-separated ZeRO stages."""
    values = [_int(x) for x in text.split(",") if x.strip()]
    bad = [v for v in values if v not in STAGE_CHOICES]
    if not values or bad:
        got = bad[0] if bad else repr(text)
        raise argparse.ArgumentTypeError(f"takes ZeRO stages among 0,1,2,3, got {got}")
    return values


stages.__name__ = "list of stages"


def memory_size(text: str) -> int:
    """A memory size above 0 ('80GB', '24GiB', '512MB')."""
    try:
        value = parse_bytes(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be more than 0 bytes, got {text!r}")
    return value


memory_size.__name__ = "memory size"


def fraction(text: str) -> float:
    """A number in [0, 1)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"takes a number in [0, 1), got {text!r}") from None
    if not math.isfinite(value) or not 0 <= value < 1:
        raise argparse.ArgumentTypeError(f"takes a number in [0, 1), got {text}")
    return value


fraction.__name__ = "fraction"


def check_between(parser: argparse.ArgumentParser, args, low: str, high: str) -> None:
    """``--low`` must not exceed ``--high`` (attribute names with underscores)."""
    a, b = getattr(args, low), getattr(args, high)
    if a is not None and b is not None and a > b:
        flag = lambda name: "--" + name.replace("_", "-")  # noqa: E731
        parser.error(f"{flag(low)} {a} is more than {flag(high)} {b}")


def check_out_folder(parser: argparse.ArgumentParser, out: str | None, flag: str = "--out"):
    """An output folder must be a folder (or not exist yet): checked before any work."""
    if out and os.path.exists(out) and not os.path.isdir(out):
        parser.error(f"{flag} {out} is a file; give a folder (it is created if missing)")


def require_cuda_plugin(parser: argparse.ArgumentParser, flag: str, value, otherwise: str = ""):
    """A GPU target is compiled by XLA:GPU, which comes with the CUDA plugin: without it, one
    line with the pip command for this jax (exit 2), before anything is compiled."""
    if cuda_plugin_module() is not None:
        return
    try:
        version = importlib.metadata.version("jaxlib")
    except importlib.metadata.PackageNotFoundError:
        version = importlib.metadata.version("jax")
    parser.error(
        f"{flag} {value} compiles for a GPU with XLA:GPU, which needs the CUDA plugin: "
        f"{cuda_plugin_install_hint(version)} (and JAX_PLATFORMS=cpu without a GPU){otherwise}"
    )
