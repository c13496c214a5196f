"""Does AdamW with 8-bit (or bf16) moments train as well as fp32 AdamW? Trains
``configs/tiny.yaml`` for 300 steps through the trainer, once per ``train.optimizer``
(``adamw``, ``adamw_8bit``, ``adamw_bf16``), same seed, data and schedule, and prints per run:
the final training loss (mean over the last 30 steps), the held-out loss at the end, their
ratio to fp32 AdamW's (goal: within 1%), and the optimizer state's bytes per parameter counted
from the state's leaves (the moments and their scales; the step counter is left out).

    python experiments/adamw_8bit.py                        # ~5-10 min on 2 CPU cores
    python experiments/adamw_8bit.py --steps 100 --out /tmp/adamw_8bit.md
    python experiments/adamw_8bit.py --only adamw,adamw_8bit   # the reference comes first
"""
from __future__ import annotations

import argparse
import math
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Measure this checkout's zeroflow, not an installed one (``python experiments/x.py`` puts
# experiments/ first on sys.path, not the repository).
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from zeroflow.cli.common import start_script  # noqa: E402

start_script()  # before jax: where the CUDA plugin has no driver, a CPU jax without its noise

import jax  # noqa: E402
import numpy as np  # noqa: E402

from zeroflow.config.io import apply_overrides, load_config  # noqa: E402
from zeroflow.optim import ADAMW_CHOICES  # noqa: E402
from zeroflow.trainer import train  # noqa: E402
from zeroflow.trainer.setup import build_run  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


def state_bytes_per_param(cfg) -> float:
    """Bytes of the optimizer state's per-parameter leaves (scalars such as the step count left
    out) over the number of parameters, from the abstract state (nothing allocated)."""
    state = build_run(cfg, with_data=False).abstract_state()
    params = sum(math.prod(x.shape) for x in jax.tree.leaves(state.master))
    moments = sum(math.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(state.opt_state)
                  if x.shape != ())
    return moments / params


def run_one(name: str, steps: int, base: Path, config: str) -> dict:
    cfg = apply_overrides(load_config(config), [
        f"train.steps={steps}", f"train.optimizer={name}", f"run.dir={base / name}",
        "run.progress=false", "checkpoint.every=0"])
    start = time.perf_counter()
    result = train(cfg)
    losses = [result.losses[k] for k in sorted(result.losses)]
    tail = max(1, steps // 10)
    return {"name": name, "final": float(np.mean(losses[-tail:])), "last": losses[-1],
            "eval": result.eval.get("eval_loss", float("nan")), "tail": tail,
            "bytes": state_bytes_per_param(cfg), "seconds": time.perf_counter() - start}


def table(rows: list[dict]) -> str:
    ref = rows[0]
    lines = ["| optimizer | state bytes / param | final train loss (mean of last "
             f"{ref['tail']}) | ratio to adamw | held-out loss | ratio to adamw | wall s |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| `{r['name']}` | {r['bytes']:.3f} | {r['final']:.4f} | "
                     f"{r['final'] / ref['final']:.4f} | {r['eval']:.4f} | "
                     f"{r['eval'] / ref['eval']:.4f} | {r['seconds']:.0f} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--config", default=str(REPO / "configs" / "tiny.yaml"))
    p.add_argument("--only", default=",".join(ADAMW_CHOICES),
                   help="comma-separated optimizers to run (the first is the ratios' reference)")
    p.add_argument("--out", default=None, help="also write the table (markdown) here")
    args = p.parse_args(argv)
    names = args.only.split(",")
    if unknown := [n for n in names if n not in ADAMW_CHOICES]:
        p.error(f"unknown optimizer(s) {unknown} in --only; valid: {', '.join(ADAMW_CHOICES)}")
    with tempfile.TemporaryDirectory() as tmp:
        rows = [run_one(name, args.steps, Path(tmp), args.config) for name in names]
    text = table(rows)
    print(text)
    if args.out:
        date = subprocess.run(["date"], capture_output=True, text=True).stdout.strip()
        command = "python experiments/adamw_8bit.py " + " ".join(argv or sys.argv[1:])
        Path(args.out).write_text(
            f"# AdamW with 8-bit and bf16 moments vs fp32 AdamW\n\n"
            f"Command: `{command.strip()}`\n\nMachine: {platform.machine()} CPU container, "
            f"{os.cpu_count()} cores, one jax CPU device (jax {jax.__version__}); date: {date}.\n"
            f"Config: configs/tiny.yaml with train.steps={args.steps} (same seed, data, schedule "
            f"for every run).\n\n{text}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
