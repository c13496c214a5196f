"""Block-sparse matmul on the accelerator: correctness against the reference, and time against
a dense ``jnp.dot`` of the same shape. Generators of ``Case``s for ``benchlib.isolate``."""
from __future__ import annotations

import functools
from collections.abc import Iterator

import jax
import jax.numpy as jnp
import numpy as np

from benchlib.attention import DTYPES
from benchlib.isolate import Case
from benchlib.timing import forward_and_backward, median_seconds
from pallas_kernels import block_sparse_matmul, random_layout, reference_block_sparse_matmul, to_dense


def _operands(m: int, k: int, n: int, block: int, density: float, dtype, seed: int = 0):
    """x [m, k], the kept blocks of a random layout, dy [m, n], and the layout itself."""
    layout = random_layout(k // block, n // block, density, seed=seed)
    keys = jax.random.split(jax.random.key(seed), 3)
    x = jax.random.normal(keys[0], (m, k), jnp.float32).astype(dtype)
    blocks = (jax.random.normal(keys[1], (int(layout.sum()), block, block), jnp.float32)
              / np.sqrt(k)).astype(dtype)
    dy = jax.random.normal(keys[2], (m, n), jnp.float32).astype(dtype)
    return x, blocks, dy, layout


def _max_error(got, want) -> float:
    return float(jnp.max(jnp.abs(got.astype(jnp.float32) - want.astype(jnp.float32))))


def check_block_sparse(spec: dict) -> dict:
    """y, dx and dblocks of the kernel against the fp32 reference, next to the errors of a
    dense matmul in the input dtype ("naive"); passes at most twice the naive error (plus 1e-3
    of the scale)."""
    dtype, block = DTYPES[spec["dtype"]], spec["block"]
    x, blocks, dy, layout = _operands(spec["m"], spec["k"], spec["n"], block, spec["density"], dtype,
                                      seed=spec.get("seed", 0))
    kernel = functools.partial(block_sparse_matmul, layout=layout, block_size=block,
                               block_m=spec.get("block_m", 64))
    reference = functools.partial(reference_block_sparse_matmul, layout=layout, block_size=block)

    def naive(x, blocks):
        return jnp.dot(x, to_dense(blocks, layout, block))

    runs = {}
    for name, fn, args in (("kernel", kernel, (x, blocks, dy)), ("naive", naive, (x, blocks, dy)),
                           ("reference", reference, [a.astype(jnp.float32) for a in (x, blocks, dy)])):
        out, grads = forward_and_backward(fn)(*args)
        runs[name] = (out, *grads)
    errors, passed = {}, True
    for index, output in enumerate(("y", "dx", "dblocks")):
        want = runs["reference"][index]
        scale = float(jnp.max(jnp.abs(want)))
        err_kernel = _max_error(runs["kernel"][index], want)
        err_naive = _max_error(runs["naive"][index], want)
        ok = err_kernel <= 2 * err_naive + 1e-3 * scale
        passed &= ok
        errors[output] = {"kernel": err_kernel, "naive": err_naive, "scale": scale, "ok": ok}
    return {"spec": spec, "errors": errors, "passed": bool(passed),
            "kept_blocks": int(layout.sum()), "total_blocks": int(layout.size),
            "compiled_calls": mosaic_calls(forward_and_backward(kernel), x, blocks, dy)}


def mosaic_calls(fn, *args) -> int:
    """How many Mosaic GPU kernels the lowered program calls: >0 means the kernels were really
    compiled (0 in the CPU interpreter)."""
    return jax.jit(fn).lower(*args).as_text().count("mosaic_gpu")


def correctness_cases(checks: list[dict]) -> Iterator[Case]:
    for spec in checks:
        yield Case(spec["name"], functools.partial(check_block_sparse, spec))


def _time(fn, args, warmup: int, iters: int) -> float:
    return median_seconds(fn, *args, warmup=warmup, iters=iters)


def time_dense(m: int, k: int, n: int, dtype: str, pass_: str, warmup: int, iters: int) -> dict:
    x, w, dy = (jax.random.normal(jax.random.key(i), shape, jnp.float32).astype(DTYPES[dtype])
                for i, shape in enumerate(((m, k), (k, n), (m, n))))
    if pass_ == "fwd":
        seconds = _time(jax.jit(jnp.dot), (x, w), warmup, iters)
    else:
        seconds = _time(forward_and_backward(jnp.dot), (x, w, dy), warmup, iters)
    return {"kind": "dense", "pass": pass_, "ms": seconds * 1e3, "m": m, "k": k, "n": n,
            "tflops": 2 * m * k * n * (3 if pass_ == "fwd+bwd" else 1) / seconds / 1e12}


def time_sparse(m: int, k: int, n: int, dtype: str, block: int, sparsity: float, pass_: str,
                warmup: int, iters: int) -> dict:
    x, blocks, dy, layout = _operands(m, k, n, block, 1.0 - sparsity, DTYPES[dtype])
    fn = functools.partial(block_sparse_matmul, layout=layout, block_size=block)
    if pass_ == "fwd":
        seconds = _time(jax.jit(fn), (x, blocks), warmup, iters)
    else:
        seconds = _time(forward_and_backward(fn), (x, blocks, dy), warmup, iters)
    return {"kind": "sparse", "pass": pass_, "ms": seconds * 1e3, "block": block,
            "sparsity": sparsity, "kept_blocks": int(layout.sum()), "total_blocks": int(layout.size)}


def timing_cases(m: int, k: int, n: int, dtype: str, block_sizes: list[int],
                 sparsities: list[float], passes: list[str], warmup: int, iters: int) -> Iterator[Case]:
    """Dense first (the baseline every speedup divides), then each block size x sparsity."""
    for pass_ in passes:
        yield Case(f"dense {pass_}", functools.partial(time_dense, m, k, n, dtype, pass_, warmup, iters))
    for block in block_sizes:
        for sparsity in sparsities:
            for pass_ in passes:
                yield Case(f"block {block} sparsity {sparsity:.0%} {pass_}",
                           functools.partial(time_sparse, m, k, n, dtype, block, sparsity, pass_,
                                             warmup, iters))
