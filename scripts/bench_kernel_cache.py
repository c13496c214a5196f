"""Time XLA:GPU compiles for a target with and without the per-process kernel cache:
``python scripts/bench_kernel_cache.py [--target h100] [--repeats 2]``.

The trainer's step for configs/tiny.yaml (bf16, 32 x 256 tokens, an 8,192-entry vocabulary) is
compiled for one abstract GPU three times in a row (remat ``full``, ``full`` again,
``save_dots``), once with ``ZEROFLOW_KERNEL_CACHE=0`` and once with the cache (a fresh folder
each time), alternating, ``--repeats`` times, in this process. Prints the median seconds of
each compile and the ratio; the peaks must agree (the cache changes no buffer).
"""
from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

from zeroflow.cli.common import start_script

start_script()  # before jax: where the CUDA plugin has no driver, a CPU jax without its noise

from zeroflow.backend import kernel_cache
from zeroflow.config.io import load_config
from zeroflow.memory.measure import analysed, device_peak
from zeroflow.trainer.planning import compile_config

REPO = Path(__file__).resolve().parents[1]
OVERRIDES = ["precision.params=bf16", "train.batch_size=32", "model.seq_len=256",
             "model.vocab_size=8192"]
COMPILES = ("full", "full", "save_dots")


def _series(target: str, cached: bool) -> tuple[list[float], list[int]]:
    """Seconds and device peak of each compile in ``COMPILES``, from a fresh kernel folder."""
    os.environ[kernel_cache.ENV] = "1" if cached else "0"
    kernel_cache.reset()  # nothing to reuse from the series before
    cfg = load_config(REPO / "configs" / "tiny.yaml", OVERRIDES)
    seconds, peaks = [], []
    for remat in COMPILES:
        start = time.perf_counter()
        compiled, setup = compile_config(cfg, num_devices=1, stage=0, offload="none",
                                         update_on="device", remat=remat, target=target)
        seconds.append(time.perf_counter() - start)
        peaks.append(device_peak(analysed(compiled), setup.state))
    return seconds, peaks


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default="h100")
    p.add_argument("--repeats", type=int, default=2)
    args = p.parse_args()
    runs: dict[bool, list[list[float]]] = {False: [], True: []}
    for _ in range(args.repeats):
        for cached in (False, True):
            seconds, peaks = _series(args.target, cached)
            runs[cached].append(seconds)
            print(f"{'cache' if cached else 'no cache':8} " + "  ".join(f"{s:6.1f}" for s in seconds)
                  + f"   peaks {peaks}", flush=True)
    print(f"\nmedian seconds per compile, {args.target}, {args.repeats} repeats")
    print(f"{'compile':22} {'no cache':>9} {'cache':>9} {'ratio':>6}")
    for i, remat in enumerate(COMPILES):
        plain = statistics.median(r[i] for r in runs[False])
        cached = statistics.median(r[i] for r in runs[True])
        print(f"{i + 1}. remat {remat:12} {plain:9.1f} {cached:9.1f} {cached / plain:6.2f}")


if __name__ == "__main__":
    main()
