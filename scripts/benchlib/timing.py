"""Wall-clock timing of jitted calls, the one harness every benchmark uses.

Every timed call ends in ``block_until_ready`` and comes after untimed warm-up calls (the first
compiles). Variants compared with each other run interleaved in one process, one call of each
per round, so that load from other processes and clock changes hit them alike; they are
reported as medians and as the ratio of each median to the baseline's.
"""
from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax


def synchronised_seconds(call: Callable[[], Any]) -> float:
    """Seconds of one ``call()``, waiting for every array it returns."""
    start = time.perf_counter()
    jax.block_until_ready(call())
    return time.perf_counter() - start


def interleaved_seconds(calls: Sequence[Callable[[], Any]], *, warmup: int,
                        rounds: int) -> list[list[float]]:
    """Per-call seconds of each of ``calls``: ``warmup`` untimed calls of each, then ``rounds``
    rounds that call each once in turn. Returns one list of ``rounds`` times per call."""
    for _ in range(warmup):
        for call in calls:
            jax.block_until_ready(call())
    times: list[list[float]] = [[] for _ in calls]
    for _ in range(rounds):
        for call, out in zip(calls, times):
            out.append(synchronised_seconds(call))
    return times


def median_seconds(fn: Callable, *args, warmup: int, iters: int) -> float:
    """Median seconds of ``iters`` calls of ``fn(*args)`` after ``warmup`` untimed calls."""
    [times] = interleaved_seconds([lambda: fn(*args)], warmup=warmup, rounds=iters)
    return statistics.median(times)


class Comparison(NamedTuple):
    """A candidate's interleaved times against the baseline's: the medians, the ratio of the
    medians (candidate / baseline) and the 25th-75th percentile of the per-round ratios."""
    baseline_s: float
    candidate_s: float
    ratio: float
    round_ratio_iqr: tuple[float, float]


def compare_to_baseline(baseline: Sequence[float], candidate: Sequence[float]) -> Comparison:
    """``baseline`` and ``candidate``: times of the same rounds of ``interleaved_seconds``."""
    round_ratios = [c / b for b, c in zip(baseline, candidate)]
    q = (statistics.quantiles(round_ratios, n=4, method="inclusive") if len(round_ratios) > 1
         else round_ratios * 3)
    base, cand = statistics.median(baseline), statistics.median(candidate)
    return Comparison(base, cand, cand / base, (q[0], q[2]))


class StepRunner:
    """A jitted, state-donating ``step(state, batch) -> (state, metrics)`` and the state it
    threads through; a call is one step, so runners can be timed by ``interleaved_seconds``."""

    def __init__(self, name: str, step: Callable, state, batch):
        self.name, self.step, self.state, self.batch = name, step, state, batch
        self.metrics = None

    def __call__(self):
        self.state, self.metrics = self.step(self.state, self.batch)
        return self.state, self.metrics


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
    runner = StepRunner("step", step, state, batch)
    [times] = interleaved_seconds([runner], warmup=warmup, rounds=steps)
    return runner.state, runner.metrics, times
