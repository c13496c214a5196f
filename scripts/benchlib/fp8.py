"""What FP8 buys on this accelerator, each figure measured side by side with its bf16 baseline
in one process (``benchlib.timing``: interleaved calls, medians, ratios of the medians).

- ``gemm_cases``: a square GEMM as ``zeroflow.autocast.fp8`` builds it, against ``jnp.dot`` in
  bf16: the e4m3 x e4m3 product of operands already in e4m3 (the raw FP8 GEMM), ``scaled_dot``
  from bf16 operands (amax, scale and cast included), and ``scaled_dot``'s forward and backward
  (the e5m2 gradient GEMMs) against bf16's.
- ``step_cases``: the trainer's GPT step under each precision of a list, compiled in one
  process, the first (the baseline) timed interleaved against each other one in turn.

On a CPU (XLA:CPU computes with the float8 types) the same code runs on tiny shapes: numbers
that mean nothing, code paths that are the GPU's.
"""
from __future__ import annotations

import copy
import functools
import math
import statistics
from collections.abc import Iterator

import jax
import jax.numpy as jnp
from jax import lax

from benchlib.isolate import Case
from benchlib.timing import compare_to_baseline, forward_and_backward, interleaved_seconds

MATMUL = (((1,), (0,)), ((), ()))
"``dot_general``'s dimension numbers of ``a @ b`` for matrices."


def _problem() -> str | None:
    """Why this process's device cannot run FP8 matmuls (``zeroflow.autocast.fp8``'s check)."""
    from zeroflow.autocast import fp8
    return fp8.device_problem(jax.devices()[0])


def _gemm_counts(fn, *args) -> dict:
    """FP8 and other GEMMs in the compiled program (XLA:GPU's GEMM fusions and cuBLAS calls;
    XLA:CPU has neither, so 0 and 0 there)."""
    from zeroflow.autocast.fp8_hlo import count_gemms
    found = count_gemms(jax.jit(fn).lower(*args).compile().as_text())
    return {"fp8": found.fp8, "other": found.other}


def random_operands(size: int):
    """Three [size, size] bf16 matrices, standard normal, made on the device."""
    keys = jax.random.split(jax.random.key(0), 3)
    return [jax.random.normal(k, (size, size), jnp.float32).astype(jnp.bfloat16) for k in keys]


def e4m3_product(q_a, q_b, s_a, s_b):
    """The forward GEMM of ``zeroflow.autocast.fp8.scaled_dot`` once its operands are e4m3: the
    product straight into bf16 (fp32 accumulation inside the GEMM), times the two scales."""
    acc = lax.dot_general(q_a, q_b, MATMUL, preferred_element_type=jnp.bfloat16)
    return (acc.astype(jnp.float32) * (s_a * s_b)).astype(jnp.bfloat16)


def scaled_dot_bf16(a, b):
    """``a @ b`` through ``zeroflow.autocast.fp8.scaled_dot`` (tensor scaling), bf16 out."""
    from zeroflow.autocast import fp8
    return fp8.scaled_dot(a, b, MATMUL, jnp.bfloat16)


def _compare(calls: dict, flops: float, warmup: int, iters: int) -> dict:
    """Interleaved medians of ``calls`` ({name: call}, the first the baseline), TFLOP/s and
    each one's speed-up over the baseline (baseline time / its time)."""
    times = interleaved_seconds(list(calls.values()), warmup=warmup, rounds=iters)
    out = {}
    for name, own in zip(calls, times):
        cmp = compare_to_baseline(times[0], own)
        out[name] = {"ms": cmp.candidate_s * 1e3, "tflops": flops / cmp.candidate_s / 1e12,
                     "speedup": 1.0 / cmp.ratio,
                     "speedup_iqr": [1.0 / cmp.round_ratio_iqr[1], 1.0 / cmp.round_ratio_iqr[0]]}
    return out


def time_gemm_forward(size: int, warmup: int, iters: int) -> dict:
    """bf16 ``jnp.dot`` vs the e4m3 GEMM and vs ``scaled_dot`` from bf16, forward only."""
    from zeroflow.autocast import fp8
    problem = _problem()
    if problem:
        return {"not_applicable": problem}
    a, b, _ = random_operands(size)
    s_a, s_b = fp8.scale_of(a, fp8.E4M3), fp8.scale_of(b, fp8.E4M3)
    q_a, q_b = fp8.quantize(a, s_a, fp8.E4M3), fp8.quantize(b, s_b, fp8.E4M3)
    bf16, raw, scaled = jax.jit(jnp.dot), jax.jit(e4m3_product), jax.jit(scaled_dot_bf16)
    calls = {"bf16": lambda: bf16(a, b), "e4m3": lambda: raw(q_a, q_b, s_a, s_b),
             "scaled_dot": lambda: scaled(a, b)}
    timed = _compare(calls, 2.0 * size**3, warmup, iters)
    return {"size": size, "pass": "fwd", **timed, "fp8_speedup": timed["e4m3"]["speedup"],
            "gemms": {"e4m3": _gemm_counts(e4m3_product, q_a, q_b, s_a, s_b),
                      "bf16": _gemm_counts(jnp.dot, a, b)}}


def time_gemm_backward(size: int, warmup: int, iters: int) -> dict:
    """bf16 ``jnp.dot`` vs ``scaled_dot``, forward and backward (three GEMMs each; FP8's
    backward multiplies an e5m2 gradient by the saved e4m3 operands)."""
    problem = _problem()
    if problem:
        return {"not_applicable": problem}
    a, b, d_out = random_operands(size)
    bf16, scaled = forward_and_backward(jnp.dot), forward_and_backward(scaled_dot_bf16)
    calls = {"bf16": lambda: bf16(a, b, d_out), "scaled_dot": lambda: scaled(a, b, d_out)}
    timed = _compare(calls, 6.0 * size**3, warmup, iters)
    return {"size": size, "pass": "fwd+bwd", **timed, "fp8_speedup": timed["scaled_dot"]["speedup"],
            "gemms": {"scaled_dot": _gemm_counts(forward_and_backward(scaled_dot_bf16), a, b, d_out)}}


def gemm_cases(size: int, warmup: int, iters: int) -> Iterator[Case]:
    yield Case(f"{size}^3 fwd", functools.partial(time_gemm_forward, size, warmup, iters))
    yield Case(f"{size}^3 fwd+bwd", functools.partial(time_gemm_backward, size, warmup, iters))


# --------------------------------------------------------------------------- the GPT step
def variant_spec(base: dict, autocast: str, precision: dict) -> dict:
    """``base`` (a ``benchlib.gpt`` spec) under ``Precision(autocast=..., **precision)``."""
    spec = copy.deepcopy(base)
    spec["autocast"], spec["precision"] = autocast, dict(precision)
    return spec


class SharedStateStep:
    """One compiled step on a state it shares with the other steps of the same state layout:
    each call is one training step from wherever the last of them left the state, so the
    variants hold one model's state between them, not one each (what lets a ~1B model's
    variants be timed interleaved on one GPU)."""

    def __init__(self, step, holder: dict, batch):
        self.step, self.holder, self.batch, self.metrics = step, holder, batch, None

    def __call__(self):
        self.holder["state"], self.metrics = self.step(self.holder["state"], self.batch)
        return self.holder["state"], self.metrics


_BUILT: dict = {"holders": {}, "steps": {}, "facts": {}}
"""This process's compiled variants and the train states they share, kept from one case to the
next (a restarted child builds again what it needs)."""


def _build_step(base: dict, variant: list) -> None:
    """Compile ``variant`` (label, autocast, Precision fields) into ``_BUILT``. The Precision
    settings that add to the train state (delayed scaling's amax histories, a loss scale) key
    the shared states."""
    from benchlib import gpt
    from zeroflow.autocast.fp8_hlo import count_gemms
    label, autocast, precision = variant
    if label in _BUILT["steps"]:
        return
    _, run, batch = gpt.build_without_state(variant_spec(base, autocast, precision))
    layout = (run.prec.delayed_fp8, run.prec.scaled)
    holder = _BUILT["holders"].setdefault(layout, {})
    if "state" not in holder:
        holder["state"] = run.init_state()
    compiled = run.make_step().lower(holder["state"], batch).compile()
    found = count_gemms(compiled.as_text())
    _BUILT["facts"][label] = {"compiled": gpt._compiled_memory(compiled),
                              "gemms": {"fp8": found.fp8, "other": found.other}}
    _BUILT["steps"][label] = SharedStateStep(compiled, holder, batch)


def compare_steps(base: dict, variants: list, warmup: int, steps: int) -> dict:
    """The variants' steps (the first is the baseline) compiled in this process, then timed
    interleaved (one step of each per round); tokens/s and each one's speed-up over the
    baseline, from the medians."""
    from benchlib import gpt
    problem = _problem()
    if problem:
        return {"not_applicable": problem}
    for variant in variants:
        _build_step(base, variant)
    labels = [label for label, *_ in variants]
    runners = [_BUILT["steps"][label] for label in labels]
    times = interleaved_seconds(runners, warmup=warmup, rounds=steps)
    tokens = base["batch"] * base["model"]["seq_len"]
    out = {}
    for label, runner, own in zip(labels, runners, times):
        cmp = compare_to_baseline(times[0], own)
        loss = float(jax.device_get(runner.metrics["loss"]))
        out[label] = {**_BUILT["facts"][label], "step_s": statistics.median(own),
                      "tokens_per_s": tokens / statistics.median(own), "speedup": 1.0 / cmp.ratio,
                      "speedup_iqr": [1.0 / cmp.round_ratio_iqr[1], 1.0 / cmp.round_ratio_iqr[0]],
                      "loss": loss, "loss_finite": math.isfinite(loss)}
    stats = jax.devices()[0].memory_stats() or {}
    return {"baseline": labels[0], "variants": out, "params": gpt.num_params(base),
            "fp8_speedup": out[labels[-1]]["speedup"],  # for the progress line
            "tokens_per_step": tokens, "steps": steps,
            "allocated_peak_all": stats.get("peak_bytes_in_use")}


def step_cases(base: dict, variants: list, warmup: int, steps: int) -> Iterator[Case]:
    """The baseline against each other variant in turn, in one process (so each comparison is
    interleaved, and the baseline is compiled once): a variant whose compile or steps run out
    of time costs that variant, not the comparisons before it."""
    baseline, *others = variants
    for other in others:
        yield Case(f"{baseline[0]} vs {other[0]}",
                   functools.partial(compare_steps, base, [baseline, other], warmup, steps))
