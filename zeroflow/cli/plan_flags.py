"""What ``python -m zeroflow.memory`` and ``python -m zeroflow.planner`` share: their flags, each
checked where argparse reads it (a bad value is one line naming the flag and what it takes,
exit 2, before jax is imported or anything is compiled or written), and the restart that gives
XLA its start-up settings. Nothing here imports jax."""

from __future__ import annotations

import argparse
import importlib.metadata
import math
import os
import sys
from pathlib import Path
from typing import NoReturn

from zeroflow.cli.common import ArgumentParser
from zeroflow.util import xla_log
from zeroflow.util.compat import cuda_plugin_install_hint, cuda_plugin_module
from zeroflow.util.settings import OFFLOAD_CHOICES, REMAT_DTYPES, REMATS, ZERO_STAGES
from zeroflow.util.units import parse_bytes

GPUS = sorted(p.stem for p in (Path(__file__).parents[1] / "backend" / "gpu_specs").glob("*.txtpb"))
"The GPU targets XLA:GPU can compile for without the GPU (``zeroflow.backend.targets``)."
ATTENTIONS = ("xla", "cudnn", "pallas")
CHILD = "ZEROFLOW_PLAN_RESTARTED"
FAST_CPU_COMPILE = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
"XLA:CPU options that change only its generated code (the emulated devices never run it)."


class PlanParser(ArgumentParser):
    """``prog`` is how the command is typed (``python -m zeroflow.memory``); its errors read
    ``zeroflow.memory: error: ...``, the prefix every zeroflow command's errors share."""

    def error(self, message: str) -> NoReturn:
        name = self.prog.removeprefix("python -m ")
        self.exit(2, f"{name}: error: {message} (--help lists the flags)\n")


def _int(text: str) -> int:
    try:
        return int(text.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"takes a whole number, got {text!r}") from None


def at_least(low: int):
    """An int >= ``low``."""

    def parse(text: str) -> int:
        value = _int(text)
        if value < low:
            raise argparse.ArgumentTypeError(f"must be at least {low}, got {value}")
        return value

    parse.__name__ = "int"
    return parse


count = at_least(1)


def counts(text: str) -> list[int]:
    """Comma-separated ints >= 1 (e.g. 1,8,16)."""
    values = [_int(x) for x in text.split(",") if x.strip()]
    bad = [v for v in values if v < 1]
    if not values or bad:
        got = bad[0] if bad else repr(text)
        raise argparse.ArgumentTypeError(f"takes comma-separated whole numbers >= 1, got {got}")
    return values


counts.__name__ = "list of ints"


def one_of(valid, name: str, cast=str):
    """Comma-separated values among ``valid`` (``cast`` from text; GPU names in any case)."""

    def parse(text: str) -> list:
        items = [x.strip() for x in text.split(",") if x.strip()]
        items = [x.lower() for x in items] if valid is GPUS else items
        bad = [x for x in items if x not in map(str, valid)]
        if not items or bad:
            got = repr(bad[0] if bad else text)
            raise argparse.ArgumentTypeError(
                f"takes {name} among {','.join(map(str, valid))}, got {got}"
            )
        return [cast(x) for x in items]

    parse.__name__ = f"list of {name}"
    return parse


stages = one_of(ZERO_STAGES, "ZeRO stages", int)
offloads = one_of(OFFLOAD_CHOICES, "offloads")
remats = one_of(REMATS, "remat policies")
remat_dtypes = one_of(REMAT_DTYPES, "remat dtypes")
attentions = one_of(ATTENTIONS, "attention kernels")
gpus = one_of(GPUS, "GPU targets")


def gpu(text: str) -> str:
    """One GPU target."""
    if text.strip().lower() not in GPUS:
        raise argparse.ArgumentTypeError(f"takes a GPU target among {','.join(GPUS)}, got {text!r}")
    return text.strip().lower()


gpu.__name__ = "GPU target"


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
        value = math.nan
    if not math.isfinite(value) or not 0 <= value < 1:
        raise argparse.ArgumentTypeError(f"takes a number in [0, 1), got {text!r}")
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


def start_xla(prog: str, devices: int, gpus: bool, command_line: bool) -> None:
    """Give XLA what it reads when it starts: ``devices`` emulated CPU devices (offloaded plans
    for GPUs compile through CPU devices standing in for them) with fast CPU code generation
    (nothing runs, the buffers are the same) and, for ``gpus``, XLA:GPU's scheduler statistics
    (its step estimate). From the command line the command starts itself again with them, once;
    called from Python, only the device count is set, for a backend not yet started."""
    env = os.environ if not command_line else dict(os.environ)
    flags = env.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags:
        flags += f" --xla_force_host_platform_device_count={devices} {FAST_CPU_COMPILE}"
        env["XLA_FLAGS"] = flags.strip()
    if not command_line or os.environ.get(CHILD):
        return
    env.update({CHILD: "1", "ZEROFLOW_QUIET_XLA_INFO": "1"})
    if gpus:
        xla_log.enable(env)
        env.setdefault("JAX_PLATFORMS", "cpu")
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, "-m", prog, *sys.argv[1:]], env)


def drop_xla_info() -> None:
    """In the restarted command: drop XLA's notes that change no answer."""
    if os.environ.get("ZEROFLOW_QUIET_XLA_INFO"):
        from zeroflow.xla import schedule  # imports jax: after the restart

        schedule.drop_info_lines()
