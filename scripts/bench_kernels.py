"""Benchmark the Pallas kernels: flash attention against cuDNN and XLA, block-sparse matmul
against dense, optionally a sweep of attention tile sizes.

    PYTHONPATH=. python scripts/bench_kernels.py --out /tmp/kernels             # on a GPU
    PYTHONPATH=. python scripts/bench_kernels.py --out /tmp/kernels --tiles     # + tile sweep
    PYTHONPATH=. python scripts/bench_kernels.py --quick --out /tmp/kernels     # CPU smoke test

This is the GPU report's kernels stage (scripts/gpu_report.py) with sizes chosen on the
command line and no time limit to speak of: each measurement runs in its own process (an OOM
or a compile crash costs one cell), every number is the median of --iters synchronised calls
after --warmup calls, and report.md / report.json / results.jsonl land in --out as they come.
Attention is bf16 with B*S = --tokens and H*D = --width; TFLOP/s counts 4*B*H*S*S*D forward
FLOPs (half when causal) and 3.5x that forward+backward. --quick shrinks every size so the
kernels run in the Pallas interpreter on a CPU: its numbers only show that the script works.
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

from gpureport.profiles import FULL, QUICK  # noqa: E402
from gpureport.session import RunOptions, run_report  # noqa: E402

NO_LIMIT_S = 4 * 3600.0


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--out", type=Path, required=True, help="folder for report.md and the raw records")
    p.add_argument("--quick", action="store_true", help="tiny sizes on the CPU (smoke test)")
    p.add_argument("--seq-lens", type=_ints, default=[512, 1024, 2048, 4096, 8192, 16384])
    p.add_argument("--head-dims", type=_ints, default=[64, 128])
    p.add_argument("--masks", choices=("causal", "full", "both"), default="both")
    p.add_argument("--impls", default="pallas,cudnn,xla", help="attention implementations to time")
    p.add_argument("--tokens", type=int, default=16384, help="B*S of every attention call")
    p.add_argument("--width", type=int, default=2048, help="H*D of every attention call")
    p.add_argument("--matmul", default="4096x4096x4096", help="M x K x N of the block-sparse matmul")
    p.add_argument("--sparsities", default="0.5,0.75,0.9,0.95")
    p.add_argument("--block-sizes", type=_ints, default=[32, 64, 128])
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--skip", choices=("attention", "block_sparse"), action="append", default=[],
                   help="leave out one benchmark (repeatable)")
    p.add_argument("--tiles", action="store_true", help="also sweep the attention tile sizes of the report")
    return p.parse_args(argv)


def profile_for(args):
    if args.quick:
        tiles = QUICK.attention_tiles if args.tiles else {**QUICK.attention_tiles, "configs": []}
        return dataclasses.replace(QUICK, attention_tiles=tiles)
    masks = {"causal": [True], "full": [False], "both": [False, True]}[args.masks]
    m, k, n = (int(x) for x in args.matmul.lower().split("x"))
    configs = [dict(seq=s, head_dim=d, causal=c, tokens=args.tokens, width=args.width)
               for d in args.head_dims for s in args.seq_lens for c in masks]
    timing = dict(warmup=args.warmup, iters=args.iters)
    return dataclasses.replace(
        FULL, time_limit_s=NO_LIMIT_S, budgets={**FULL.budgets, "kernels": NO_LIMIT_S},
        attention_timing=dict(configs=[] if "attention" in args.skip else configs,
                              impls=args.impls.split(","), passes=["fwd", "fwd+bwd"], **timing),
        block_sparse_timing=dict(m=m, k=k, n=n, dtype="bf16",
                                 block_sizes=[] if "block_sparse" in args.skip else args.block_sizes,
                                 sparsities=[float(x) for x in args.sparsities.split(",")],
                                 passes=["fwd", "fwd+bwd"], **timing),
        attention_tiles={**FULL.attention_tiles, **timing,
                         "configs": FULL.attention_tiles["configs"] if args.tiles else []})


def main(argv=None) -> int:
    args = parse_args(argv)
    command = shlex.join(["python", "scripts/bench_kernels.py", *sys.argv[1:]])
    options = RunOptions(out=args.out, command=command, stages=("kernels",), require_gpu=not args.quick)
    run_report(profile_for(args), options)
    print((args.out / "report.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
