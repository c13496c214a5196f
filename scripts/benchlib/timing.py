"""Wall-clock timing of jitted calls: medians of synchronised calls after warm-up calls."""
from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import jax


def median_seconds(fn: Callable, *args, warmup: int, iters: int) -> float:
    """Median seconds of ``iters`` calls of ``fn(*args)``, each ending in block_until_ready,
    after ``warmup`` untimed calls (the first of which compiles)."""
    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def forward_and_backward(fn: Callable) -> Callable:
    """``jit((*inputs, d_out) -> (out, grads))``: one forward and one backward pass of ``fn``."""
    def run(*args):
        *inputs, d_out = args
        out, vjp = jax.vjp(fn, *inputs)
        return out, vjp(d_out)
    return jax.jit(run)


def time_steps(step: Callable, state, batch, *, warmup: int, steps: int):
    """Run a state-donating ``step(state, batch) -> (state, metrics)``; return the final state,
    the last metrics and the seconds of each timed step (warm-up steps not included)."""
    metrics = None
    for _ in range(warmup):
        state, metrics = step(state, batch)
    jax.block_until_ready((state, metrics))
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        state, metrics = step(state, batch)
        jax.block_until_ready((state, metrics))
        times.append(time.perf_counter() - start)
    return state, metrics, times
