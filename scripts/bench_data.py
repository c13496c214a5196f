"""Benchmark the records pipeline against the trainer that consumes it.

    python scripts/bench_data.py --config configs/sft-llama.yaml
    python scripts/bench_data.py --config configs/sft-llama.yaml --machine "2-core CPU container"

Measures, with the config's data and model:

- startup: reading, checking and tokenizing every record (``load_data``);
- delivery: packed batches per second from the Grain loader, the way the trainer takes them
  (``next`` on the iterator; ``--batches`` of them after one untimed batch);
- consumption: the train step's median time (compiled once, ``--steps`` timed steps on one
  batch, each waited for), so the ratio is batches the pipeline delivers per step time.

Goal: delivery at least 10x faster than consumption. This is a benchmark, not a test: it
asserts nothing and prints one markdown table.
"""
from __future__ import annotations

import argparse
import datetime
import shlex
import statistics
import sys
import time
from pathlib import Path

from zeroflow.cli.common import start_script

start_script()  # before jax: where the CUDA plugin has no driver, a CPU jax without its noise


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="configs/sft-llama.yaml", help="run config (records data)")
    p.add_argument("overrides", nargs="*", metavar="section.key=value", help="config overrides")
    p.add_argument("--batches", type=int, default=200, help="timed batches from the loader")
    p.add_argument("--steps", type=int, default=10, help="timed train steps")
    p.add_argument("--machine", default=None, help="free-text machine description")
    return p


def time_delivery(data, cfg, batches: int) -> float:
    """Seconds per batch from the loader (after one untimed batch: building the pipeline)."""
    loader = iter(data.train_batches(batch_size=cfg.train.batch_size, seed=cfg.train.seed))
    next(loader)
    start = time.perf_counter()
    for _ in range(batches):
        next(loader)
    return (time.perf_counter() - start) / batches


def time_steps(run, batch, steps: int) -> float:
    """Median seconds of a compiled train step on ``batch`` (one untimed step compiles it; the
    same harness as every benchmark, ``benchlib.timing``)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from benchlib.timing import time_steps as timed_steps

    _, _, times = timed_steps(run.make_step(), run.init_state(), batch, warmup=1, steps=steps)
    return statistics.median(times)


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    from zeroflow.config.io import load_config
    from zeroflow.trainer import build_run

    cfg = load_config(args.config, args.overrides)
    start = time.perf_counter()
    run = build_run(cfg)
    startup = time.perf_counter() - start
    if not getattr(run.data, "packed", False):
        raise SystemExit(f"{args.config}: data.format={cfg.data.format}; this benchmark is for "
                         "records (text, prompt_completion, chat)")
    per_batch = time_delivery(run.data, cfg, args.batches)
    first = next(iter(run.data.train_batches(batch_size=cfg.train.batch_size, seed=cfg.train.seed)))
    per_step = time_steps(run, run.global_batch(first), args.steps)
    machine = args.machine or "unspecified machine"
    command = " ".join(["python scripts/bench_data.py", *map(shlex.quote, sys.argv[1:])])
    rows = [
        ("startup (read, check, tokenize; with the model set up)", f"{startup:.2f} s"),
        ("records / train examples / val examples",
         f"{run.data.records} / {len(run.data.train)} / {len(run.data.val)}"),
        (f"loader: one batch of {cfg.train.batch_size} x {cfg.model.seq_len} packed",
         f"{per_batch * 1e3:.2f} ms ({1 / per_batch:,.0f} batches/s)"),
        ("train step (median)", f"{per_step * 1e3:.1f} ms"),
        ("delivery / consumption", f"{per_step / per_batch:,.0f}x faster (goal >= 10x)"),
    ]
    print(f"Records pipeline vs trainer, {machine}, {datetime.date.today()}, `{command}`\n")
    print("| measure | value |\n|---|---|")
    for name, value in rows:
        print(f"| {name} | {value} |")
    print(f"\n{run.data.summary()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
