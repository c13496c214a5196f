"""``python -m zeroflow.planner --config X [--gpus h100,a100,l4] [--devices 1,8] [--out DIR]``

For each GPU x device count, searches ZeRO stage, offload and where the update runs, remat,
micro-batch split, attention kernel and ZeRO++ options for the config's GPT, compiles the most
promising plans with XLA for that GPU (no GPU needed), and prints the fastest plan whose
compiled peak fits, with its host memory, XLA:GPU's step estimate, tokens/s and MFU. The whole
search goes to DIR/search.json, each row's plan to DIR/<gpu>-x<devices>.overrides (for
``python -m zeroflow.train --config X $(cat FILE)``) and DIR/<gpu>-x<devices>.yaml. Without
--gpus it plans for this machine's devices.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from zeroflow.cli import plan_flags as flags
from zeroflow.cli.common import run_cli
from zeroflow.config.io import add_config_arguments, load_config
from zeroflow.util.settings import MAX_FAILED_COMPILES, REMATS, ZERO_STAGES

PROG = "zeroflow.planner"


def parser() -> argparse.ArgumentParser:
    p = flags.PlanParser(prog=f"python -m {PROG}", description=__doc__.split("\n\n")[1])
    add = p.add_argument
    add("--gpus", "--target", type=flags.gpus, help="GPU targets, e.g. h100,a100,l4,h200")
    add("--devices", type=flags.counts, help="device counts, e.g. 1,8,16 (default 1,8)")
    add("--out", help="output folder (default plans/<config name>)")
    add("--margin", type=flags.fraction, default=0.1, help="memory kept free (default 0.1)")
    add("--device-memory", type=flags.memory_size, help="memory per device instead (80GB)")
    add(
        "--max-compiles",
        type=flags.count,
        default=3,
        help="compiles per row at most (default 3); a failed compile is reported and not "
        f"counted, {MAX_FAILED_COMPILES} failures end a row",
    )
    add("--min-compiles", type=flags.count, default=2, help="compiles per row at least")
    add("--stages", type=flags.stages, default=list(ZERO_STAGES))
    add("--remats", type=flags.remats, default=list(REMATS))
    add("--attentions", type=flags.attentions, help="default: the config's, and cudnn on GPUs")
    add("--grad-accums", type=flags.counts, help="micro-batch splits (default: all)")
    add("--no-zeropp", action="store_true", help="leave out ZeRO++ options")
    add("--fp8", action="store_true", help="also try FP8 matmuls and gathers (approximate)")
    return add_config_arguments(p)


def main_args(args: argparse.Namespace) -> int:
    from zeroflow.planner import results
    from zeroflow.planner.library import plan_config

    cfg = load_config(args.config, args.overrides)
    out = Path(
        args.out or os.path.join("plans", Path(args.config).stem if args.config else "default")
    )
    started = time.perf_counter()
    keys = ["gpus", "devices", "margin", "device_memory", "max_compiles", "min_compiles"]
    keys += ["stages", "remats", "attentions", "grad_accums", "fp8"]
    with _progress() as tick:
        plan = plan_config(
            cfg,
            name=args.config or "default config",
            zeropp=not args.no_zeropp,
            progress=tick,
            **{k: getattr(args, k) for k in keys},
        )
    results.render(plan)
    results.write(plan, cfg, out, args.config, time.perf_counter() - started)
    return 0


@contextlib.contextmanager
def _progress():
    """A progress bar of the search's compiles (done / its bound, elapsed, time left) on a
    terminal; where stderr is not one (piped, a log file), one line per compile instead."""
    if not sys.stderr.isatty():
        yield _progress_lines(time.perf_counter())
        return
    from rich import progress as rp

    columns = (rp.TextColumn("compiles"), rp.BarColumn(), rp.MofNCompleteColumn())
    columns += (rp.TimeElapsedColumn(), rp.TextColumn("left"), rp.TimeRemainingColumn())
    with rp.Progress(*columns, rp.TextColumn("{task.description}"), transient=True) as bar:
        task = bar.add_task("", total=None)
        yield lambda done, total, what: bar.update(
            task, completed=done, total=total, description=what
        )


def _progress_lines(started: float):
    """``tick(done, total, what)`` printing ``zeroflow.planner: compile k of N ...`` lines
    with the time spent and, from the mean compile so far, the time left."""
    said = [-1]

    def clock(seconds: float) -> str:
        minutes, secs = divmod(int(seconds), 60)
        return f"{minutes}:{secs:02d}"

    def tick(done: int, total: int, what: str) -> None:
        if done == said[0]:
            return
        said[0] = done
        spent = time.perf_counter() - started
        left = f", about {clock(spent / done * (total - done))} left" if done else ""
        line = f"{PROG}: compile {done} of {total} done ({clock(spent)}{left}) {what}"
        print(line.rstrip(), file=sys.stderr, flush=True)

    return tick


def main(argv: Sequence[str] | None = None) -> int:
    p = parser()
    args = p.parse_intermixed_args(list(sys.argv[1:] if argv is None else argv))
    flags.check_between(p, args, "min_compiles", "max_compiles")
    flags.check_out_folder(p, args.out)
    if args.gpus:
        flags.require_cuda_plugin(p, "--gpus", ",".join(args.gpus))
    if argv is None:
        flags.start_xla(PROG, max(args.devices or [1, 8]), gpus=bool(args.gpus), command_line=True)
    flags.drop_xla_info()
    return run_cli(PROG, main_args, p, argv)
