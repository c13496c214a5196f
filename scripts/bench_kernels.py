"""Benchmark the Pallas kernels on a GPU; prints markdown tables (optionally written to --out).

    PYTHONPATH=. python scripts/bench_kernels.py --out docs/bench_h100.md   # GPU, ~10-20 min
    PYTHONPATH=. python scripts/bench_kernels.py --quick                    # CPU smoke test, <1 min

Attention: TFLOP/s of pallas_kernels.flash_attention vs jax.nn.dot_product_attention with
implementation="xla" and "cudnn", at B*S = 16k tokens and H*D = 2048, S = 512..16384, head_dim
64 and 128, causal or not. Forward FLOPs = 4*B*H*S*S*D (half when causal); forward+backward
counts 3.5x that. Block-sparse: time of block_sparse_matmul vs a dense jnp.dot of the same
shape, in bf16, forward and forward+backward.

Every number is the median of --iters timed calls after --warmup calls, each ending in
block_until_ready. --quick shrinks every size so that the kernels run in the Pallas
interpreter on a CPU: its numbers only show that the script works.
"""
from __future__ import annotations

import argparse
import datetime
import functools
import statistics
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import block_sparse_matmul, flash_attention, random_layout

FULL = dict(
    tokens=16384, width=2048, seq_lens=(512, 1024, 2048, 4096, 8192, 16384), head_dims=(64, 128),
    matmul=(4096, 4096, 4096), sparsities=(0.5, 0.75, 0.9, 0.95), block_sizes=(32, 64, 128),
)
QUICK = dict(
    tokens=64, width=64, seq_lens=(64,), head_dims=(32,),
    matmul=(64, 128, 128), sparsities=(0.5, 0.75), block_sizes=(32,),
)


def median_seconds(fn: Callable, *args, warmup: int, iters: int) -> float:
    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def forward_and_backward(attention: Callable) -> Callable:
    """jit(q, k, v, d_out -> (out, dq, dk, dv)): one forward and one backward pass."""
    def run(q, k, v, d_out):
        out, vjp = jax.vjp(attention, q, k, v)
        return out, vjp(d_out)
    return jax.jit(run)


def attention_impls(causal: bool) -> dict[str, Callable]:
    return {
        "pallas": functools.partial(flash_attention, causal=causal),
        "xla": functools.partial(jax.nn.dot_product_attention, is_causal=causal,
                                 implementation="xla"),
        "cudnn": functools.partial(jax.nn.dot_product_attention, is_causal=causal,
                                   implementation="cudnn"),
    }


def _describe_failure(err: Exception) -> str:
    text = str(err)
    if "RESOURCE_EXHAUSTED" in text or "Out of memory" in text or "out of memory" in text:
        return "OOM"
    return "n/a"


def bench_attention(sizes: dict, dtype, warmup: int, iters: int) -> list[str]:
    rows = ["| S | B | H | D | causal | pass | pallas TFLOP/s | xla TFLOP/s | cudnn TFLOP/s |",
            "|---|---|---|---|---|---|---|---|---|"]
    print("\n".join(rows), flush=True)
    rng = np.random.default_rng(0)
    for head_dim in sizes["head_dims"]:
        heads = sizes["width"] // head_dim
        for seq in sizes["seq_lens"]:
            batch = max(1, sizes["tokens"] // seq)
            shape = (batch, seq, heads, head_dim)
            q, k, v, d_out = (jnp.asarray(rng.standard_normal(shape, np.float32), dtype)
                              for _ in range(4))
            for causal in (False, True):
                fwd_flops = 4 * batch * heads * seq * seq * head_dim * (0.5 if causal else 1.0)
                for name, flops in (("fwd", fwd_flops), ("fwd+bwd", 3.5 * fwd_flops)):
                    cells = []
                    for impl, attention in attention_impls(causal).items():
                        if name == "fwd":
                            fn, args = jax.jit(attention), (q, k, v)
                        else:
                            fn, args = forward_and_backward(attention), (q, k, v, d_out)
                        try:
                            seconds = median_seconds(fn, *args, warmup=warmup, iters=iters)
                            cells.append(f"{flops / seconds / 1e12:.3g}")
                        except Exception as err:  # cudnn absent, OOM, unsupported shape
                            cells.append(_describe_failure(err))
                    rows.append(f"| {seq} | {batch} | {heads} | {head_dim} | {causal} | {name} | "
                                + " | ".join(cells) + " |")
                    print(rows[-1], flush=True)
    return rows


def bench_block_sparse(sizes: dict, dtype, warmup: int, iters: int) -> list[str]:
    m, k, n = sizes["matmul"]
    rows = [f"M x K x N = {m} x {k} x {n}, {jnp.dtype(dtype).name}", "",
            "| block | sparsity | blocks kept | dense fwd ms | sparse fwd ms | fwd speedup | "
            "dense fwd+bwd ms | sparse fwd+bwd ms | fwd+bwd speedup |",
            "|---|---|---|---|---|---|---|---|---|"]
    print("\n".join(rows), flush=True)
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((m, k), np.float32), dtype)
    dy = jnp.asarray(rng.standard_normal((m, n), np.float32), dtype)
    w = jnp.asarray(rng.standard_normal((k, n), np.float32) / np.sqrt(k), dtype)
    dense = lambda x, w: jnp.dot(x, w)
    time_of = lambda fn, *args: median_seconds(fn, *args, warmup=warmup, iters=iters)
    dense_fwd = time_of(jax.jit(dense), x, w)
    dense_both = time_of(jax.jit(lambda x, w, dy: jax.vjp(dense, x, w)[1](dy)), x, w, dy)
    for block in sizes["block_sizes"]:
        for sparsity in sizes["sparsities"]:
            layout = random_layout(k // block, n // block, 1.0 - sparsity, seed=0)
            blocks = jnp.asarray(
                rng.standard_normal((int(layout.sum()), block, block), np.float32) / np.sqrt(k),
                dtype)
            sparse = functools.partial(block_sparse_matmul, layout=layout, block_size=block)
            sparse_fwd = time_of(jax.jit(sparse), x, blocks)
            sparse_both = time_of(jax.jit(lambda x, b, dy: jax.vjp(sparse, x, b)[1](dy)),
                                  x, blocks, dy)
            rows.append(
                f"| {block} | {sparsity:.0%} | {int(layout.sum())}/{layout.size} | "
                f"{dense_fwd * 1e3:.3f} | {sparse_fwd * 1e3:.3f} | {dense_fwd / sparse_fwd:.2f}x | "
                f"{dense_both * 1e3:.3f} | {sparse_both * 1e3:.3f} | "
                f"{dense_both / sparse_both:.2f}x |")
            print(rows[-1], flush=True)
    return rows


def header(quick: bool) -> list[str]:
    device = jax.devices()[0]
    mode = "interpret mode (--quick smoke test, not a performance number)" if quick else "compiled"
    return [
        "# Kernel benchmarks", "",
        f"- device: {device.device_kind} ({jax.default_backend()}, {jax.device_count()} device(s))",
        f"- jax {jax.__version__}, date {datetime.date.today().isoformat()}",
        f"- kernels: {mode}", "",
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes; runs on CPU")
    parser.add_argument("--out", help="also write the markdown report to this file")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--skip", choices=("attention", "block_sparse"), action="append",
                        default=[], help="leave out one benchmark (repeatable)")
    args = parser.parse_args()
    sizes = QUICK if args.quick else FULL
    warmup, iters = (1, 2) if args.quick else (args.warmup, args.iters)

    report = header(args.quick)
    print("\n".join(report), flush=True)
    if "attention" not in args.skip:
        print("## Attention (bf16)\n", flush=True)
        report += ["## Attention (bf16)", ""]
        report += bench_attention(sizes, jnp.bfloat16, warmup, iters) + [""]
    if "block_sparse" not in args.skip:
        print("\n## Block-sparse matmul\n", flush=True)
        report += ["## Block-sparse matmul", ""]
        report += bench_block_sparse(sizes, jnp.bfloat16, warmup, iters) + [""]
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(report))
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
