"""``python -m zeroflow.planner --config X [--gpus h100,a100,l4] [--devices 1,8] [--out DIR]``

For each GPU x device count, searches ZeRO stage, offload and where the update runs, remat,
micro-batch split, attention kernel and ZeRO++ options for the config's GPT, compiles the most
promising plans with XLA for that GPU (no GPU needed), and prints the fastest plan whose
compiled peak fits, with its host memory, XLA:GPU's step estimate, tokens/s and MFU. The whole
search goes to DIR/search.json, each row's plan to DIR/<gpu>-x<devices>.overrides (for
``python -m zeroflow.train --config X $(cat FILE)``) and DIR/<gpu>-x<devices>.yaml. Without
--gpus it plans for this machine's devices.

XLA reads its logging and the number of CPU devices when it starts, so the command starts
itself again with XLA:GPU's scheduler statistics on and as many CPU devices as the largest
device count (offloaded plans are compiled through CPU devices standing in for the GPUs).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from zeroflow.cli.common import run_cli
from zeroflow.cli.plan_flags import (
    PlanParser,
    check_between,
    check_out_folder,
    count,
    counts,
    fraction,
    memory_size,
    require_cuda_plugin,
    stages,
)
from zeroflow.config.io import add_config_arguments, load_config, save_config
from zeroflow.util import xla_log
from zeroflow.util.units import REMATS

PROG = "zeroflow.planner"
CHILD = "ZEROFLOW_PLANNER_STARTED"
FAST_CPU_COMPILE = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
"XLA:CPU options that change only its generated code (the emulated devices never run it)."


def parser() -> argparse.ArgumentParser:
    p = PlanParser(prog=f"python -m {PROG}", description=__doc__.split("\n\n")[1])
    p.add_argument("--gpus", "--target", default=None, help="GPU targets, e.g. h100,a100,l4,h200")
    p.add_argument(
        "--devices", type=counts, default=None, help="device counts, e.g. 1,8,16 (default 1,8)"
    )
    p.add_argument("--out", default=None, help="output folder (default plans/<config name>)")
    p.add_argument("--margin", type=fraction, default=0.1, help="memory kept free (default 0.1)")
    p.add_argument(
        "--device-memory", type=memory_size, default=None, help="memory per device instead (80GB)"
    )
    p.add_argument("--max-compiles", type=count, default=3, help="compiles per row at most")
    p.add_argument("--min-compiles", type=count, default=2, help="compiles per row at least")
    p.add_argument("--stages", type=stages, default=[0, 1, 2, 3])
    p.add_argument("--remats", default=",".join(REMATS))
    p.add_argument("--attentions", default=None, help="default: the config's, and cudnn on GPUs")
    p.add_argument(
        "--grad-accums", type=counts, default=None, help="micro-batch splits (default: all)"
    )
    p.add_argument("--no-zeropp", action="store_true", help="leave out ZeRO++ options")
    return add_config_arguments(p)


def checked_args(argv) -> argparse.Namespace:
    """The flags, each checked as argparse reads it, then those checked together: all before
    jax starts or anything is compiled or written."""
    p = parser()
    args = p.parse_intermixed_args(argv)
    check_between(p, args, "min_compiles", "max_compiles")
    check_out_folder(p, args.out)
    if args.gpus:
        require_cuda_plugin(p, "--gpus", args.gpus)
    return args


def _restart(args) -> None:
    """Start again with the environment XLA reads at start-up (see the module doc)."""
    if os.environ.get(CHILD):
        return
    env = dict(os.environ, **{CHILD: "1", "ZEROFLOW_QUIET_XLA_INFO": "1"})
    if args.gpus:
        xla_log.enable(env)
        env.setdefault("JAX_PLATFORMS", "cpu")
    wanted = args.devices or [1, 8]
    flags = env.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags:
        flags += f" --xla_force_host_platform_device_count={max(wanted)} {FAST_CPU_COMPILE}"
    env["XLA_FLAGS"] = flags.strip()
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, "-m", PROG, *sys.argv[1:]], env)


def main_args(args: argparse.Namespace) -> int:
    from zeroflow.planner.config_plan import plan_config

    cfg = load_config(args.config, args.overrides)
    name = Path(args.config).stem if args.config else "default"
    out = Path(args.out or os.path.join("plans", name))
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="zeroflow-planner-") as scratch, _progress() as tick:
        plan, said = plan_config(
            cfg,
            name=args.config or "default config",
            gpus=[g.strip() for g in args.gpus.split(",")] if args.gpus else None,
            devices=args.devices,
            margin=args.margin,
            device_memory=args.device_memory,
            max_compiles=args.max_compiles,
            min_compiles=args.min_compiles,
            stages=args.stages,
            remats=[r.strip() for r in args.remats.split(",")],
            attentions=[a.strip() for a in args.attentions.split(",")] if args.attentions else None,
            zeropp=not args.no_zeropp,
            grad_accums=args.grad_accums,
            cache_dir=scratch,
            progress=tick,
        )
    from zeroflow.planner.report import render

    for line in said:
        print(line)
    render(plan)
    _write(plan, cfg, out, args.config, time.perf_counter() - started)
    return 0


def _write(plan, cfg, out: Path, config_path: str | None, seconds: float) -> None:
    from zeroflow.config.io import apply_overrides

    out.mkdir(parents=True, exist_ok=True)
    data = plan.as_json()
    data["wall_seconds"] = round(seconds, 1)
    (out / "search.json").write_text(json.dumps(data, indent=1))
    written = []
    for s in plan.summaries():
        if s.best is None or not s.overrides:
            continue
        stem = out / f"{s.row.where.name}-x{s.row.where.devices}"
        stem.with_suffix(".overrides").write_text(" ".join(s.overrides) + "\n")
        save_config(apply_overrides(cfg, s.overrides), stem.with_suffix(".yaml"))
        written.append(stem)
    print(f"wrote {out / 'search.json'} (the whole search) in {seconds:.0f} s")
    if written:
        config = f"--config {config_path} " if config_path else ""
        print(
            f"run a plan: python -m zeroflow.train {config}$(cat {written[0]}.overrides), "
            f"or --config {written[0]}.yaml"
        )


@contextlib.contextmanager
def _progress():
    """A progress bar of the search's compiles (done / its bound, elapsed, time left) on a
    terminal; where stderr is not one (piped, a log file), one line per compile instead."""
    if not sys.stderr.isatty():
        yield _progress_lines(time.perf_counter())
        return
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    columns = (
        TextColumn("compiles"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TextColumn("left"),
        TimeRemainingColumn(),
        TextColumn("{task.description}"),
    )
    with Progress(*columns, transient=True) as bar:
        task = bar.add_task("", total=None)

        def tick(done: int, total: int, what: str) -> None:
            bar.update(task, completed=done, total=total, description=what)

        yield tick


def _progress_lines(started: float):
    """``tick(done, total, what)`` printing ``zeroflow.planner: compile k of N ...`` lines
    with the time spent and, from the mean compile so far, the time left."""
    said = [-1]

    def tick(done: int, total: int, what: str) -> None:
        if done == said[0]:
            return
        said[0] = done
        spent = time.perf_counter() - started
        left = f", about {_clock(spent / done * (total - done))} left" if done else ""
        print(
            f"{PROG}: compile {done} of {total} done ({_clock(spent)}{left}) {what}".rstrip(),
            file=sys.stderr,
            flush=True,
        )

    return tick


def _clock(seconds: float) -> str:
    minutes, secs = divmod(int(seconds), 60)
    return f"{minutes}:{secs:02d}"


def main(argv: Sequence[str] | None = None) -> int:
    args = checked_args(list(sys.argv[1:] if argv is None else argv))
    if argv is None:
        _restart(args)
    if os.environ.get("ZEROFLOW_QUIET_XLA_INFO"):
        from zeroflow.memory import schedule  # imports jax: after the restart

        schedule.drop_info_lines()
    return run_cli(PROG, main_args, parser(), argv)
