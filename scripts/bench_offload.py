"""Offload on one accelerator: the step-time cost of keeping the optimizer state in host memory,
and the largest GPT that trains with and without it.

    PYTHONPATH=. python scripts/bench_offload.py --out /tmp/offload             # ~1B GPT, on a GPU
    PYTHONPATH=. python scripts/bench_offload.py --out /tmp/offload --mode ratio --steps 20
    PYTHONPATH=. python scripts/bench_offload.py --out /tmp/offload --mode largest --width 4096
    PYTHONPATH=. python scripts/bench_offload.py --quick --out /tmp/offload     # CPU smoke test

This is the GPU report's offload stage (scripts/gpu_report.py) with sizes chosen on the command
line and no time limit to speak of; report.md, report.json and results.jsonl land in --out.

*ratio*: median step time of each offload choice (none, optimizer with the update on the
device and on the host, optimizer+params) over the plain run's, for a GPT of --layers x
--width (default ~1.0B: 18 layers, width 2048, SwiGLU 5632, vocab 32000, seq 1024, batch 16,
bf16, remat none, cuDNN attention). Each choice runs in its own process. Goal: <= 1.5x.

*largest*: for no offload and optimizer/host, the deepest GPT at --width that trains (batch
8, remat full): the search starts where zeroflow.memory predicts the limit and probes, one
process each, until the answer flips, then bisects. ``--fit-by run`` (default) runs two real
steps per probe, an out-of-memory error meaning "does not fit"; ``--fit-by compile`` compares
XLA's memory analysis with --device-memory instead (nothing allocated; the CPU smoke test).
"""
from __future__ import annotations

import argparse
import dataclasses
import shlex
import sys
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parent)]

from zeroflow.cli.common import start_script  # noqa: E402

start_script()  # before jax: where the CUDA plugin has no driver, a CPU jax without its noise

from benchlib.gpt import train_spec  # noqa: E402
from gpureport.profiles import FULL, QUICK  # noqa: E402
from gpureport.session import RunOptions, run_report  # noqa: E402

NO_LIMIT_S = 4 * 3600.0
RATIO_CHOICES = [["none", "device"], ["optimizer", "device"], ["optimizer", "host"],
                 ["optimizer+params", "device"], ["optimizer+params", "host"]]
SEARCHES = [["none", "device"], ["optimizer", "device"], ["optimizer", "host"],
            ["optimizer+params", "host"]]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--out", type=Path, required=True, help="folder for report.md and the raw records")
    p.add_argument("--quick", action="store_true", help="tiny CPU smoke test (< 1 minute)")
    p.add_argument("--mode", choices=("ratio", "largest", "all"), default="all")
    p.add_argument("--layers", type=int, default=18, help="layers of the ratio model")
    p.add_argument("--width", type=int, default=2048)
    p.add_argument("--mlp-dim", type=int, default=5632)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--batch", type=int, default=16, help="batch of the ratio model")
    p.add_argument("--search-batch", type=int, default=8, help="batch of the largest-model probes")
    p.add_argument("--remat", choices=("none", "full", "save_dots"), default="none", help="ratio model")
    p.add_argument("--attention", choices=("xla", "cudnn", "pallas"), default="cudnn")
    p.add_argument("--stage", type=int, default=0, choices=(0, 1, 2, 3))
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--max-layers", type=int, default=400)
    p.add_argument("--max-probes", type=int, default=8)
    p.add_argument("--fit-by", choices=("run", "compile"), default="run")
    p.add_argument("--device-memory", type=float, default=80e9, help="bytes, for --fit-by compile")
    return p.parse_args(argv)


def profile_for(args):
    base = QUICK if args.quick else dataclasses.replace(
        FULL, time_limit_s=NO_LIMIT_S, budgets={**FULL.budgets, "offload": NO_LIMIT_S})
    if args.quick:
        ratio, largest = base.offload_ratio, base.largest
    else:
        model = dict(num_layers=args.layers, embed_dim=args.width, num_heads=max(1, args.width // 128),
                     mlp_dim=args.mlp_dim, vocab_size=args.vocab, seq_len=args.seq_len)
        common = dict(attention=args.attention, stage=args.stage)
        ratio = dict(base=train_spec(model, batch=args.batch, remat=args.remat, steps=args.steps,
                                     warmup=args.warmup, **common), choices=RATIO_CHOICES)
        largest = {**base.largest, "base": train_spec(model, batch=args.search_batch, remat="full", steps=1,
                                                      warmup=1, **common),
                   "searches": SEARCHES, "fit_by": args.fit_by, "compile_budget": args.device_memory,
                   "max_layers": args.max_layers, "max_probes": args.max_probes}
    if args.mode == "largest":
        ratio = {**ratio, "choices": []}
    if args.mode == "ratio":
        largest = {**largest, "searches": []}
    return dataclasses.replace(base, offload_ratio=ratio, largest=largest)


def main(argv=None) -> int:
    args = parse_args(argv)
    command = shlex.join(["python", "scripts/bench_offload.py", *sys.argv[1:]])
    options = RunOptions(out=args.out, command=command, stages=("offload",), require_gpu=not args.quick)
    run_report(profile_for(args), options)
    print((args.out / "report.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
