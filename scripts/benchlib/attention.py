"""Flash attention on the accelerator: correctness against the references, TFLOP/s against
``jax.nn.dot_product_attention`` (XLA and cuDNN), and a sweep over tile sizes.

Each public function here is a generator of ``Case``s for ``benchlib.isolate``; every case
returns a JSON-able dict. On a CPU the Pallas kernels run in the interpreter: the same code
paths, numbers that mean nothing.
"""
from __future__ import annotations

import functools
from collections.abc import Iterator

import jax
import jax.numpy as jnp

from benchlib.isolate import Case
from benchlib.timing import forward_and_backward, median_seconds
from pallas_kernels import TuningConfig, flash_attention, reference_attention

DTYPES = {"bf16": jnp.bfloat16, "fp16": jnp.float16, "fp32": jnp.float32}
IMPLS = ("pallas", "cudnn", "xla")
BACKWARD_FLOPS_FACTOR = 3.5
"fwd+bwd FLOPs / fwd FLOPs: the backward pass does 2.5x the forward's matmul work."


def attention_fn(impl: str, *, causal: bool, window=None, tuning: dict | None = None,
                 interpret: bool | None = None):
    """``(q, k, v) -> out`` for one implementation, [B, S, H, D] layout. ``tuning``: the
    Pallas kernel's ``TuningConfig`` fields; ``interpret``: its mode (None: compiled on a GPU,
    interpreted elsewhere)."""
    if impl == "pallas":
        config = TuningConfig(**tuning) if tuning else None
        return functools.partial(flash_attention, causal=causal, window=window, tuning=config,
                                 interpret=interpret)
    if impl in ("cudnn", "xla"):
        return functools.partial(jax.nn.dot_product_attention, is_causal=causal,
                                 local_window_size=window, implementation=impl)
    raise ValueError(f"unknown attention implementation {impl!r}; choose one of {IMPLS}")


def attention_flops(batch: int, heads: int, q_len: int, kv_len: int, head_dim: int,
                    causal: bool, pass_: str) -> float:
    """Matmul FLOPs: 4*B*H*Sq*Skv*D forward (two matmuls), half of it causal; x3.5 fwd+bwd."""
    forward = 4.0 * batch * heads * q_len * kv_len * head_dim * (0.5 if causal else 1.0)
    return forward * (BACKWARD_FLOPS_FACTOR if pass_ == "fwd+bwd" else 1.0)


def random_qkv(batch: int, q_len: int, kv_len: int, heads: int, kv_heads: int, head_dim: int,
               dtype, seed: int = 0):
    """q, k, v and an output cotangent, standard normal, made on the device."""
    keys = jax.random.split(jax.random.key(seed), 4)
    shapes = [(batch, q_len, heads, head_dim), (batch, kv_len, kv_heads, head_dim),
              (batch, kv_len, kv_heads, head_dim), (batch, q_len, heads, head_dim)]
    return [jax.random.normal(key, shape, jnp.float32).astype(dtype) for key, shape in zip(keys, shapes)]


# --------------------------------------------------------------------------- correctness
def _max_error(got, want) -> float:
    return float(jnp.max(jnp.abs(got.astype(jnp.float32) - want.astype(jnp.float32))))


def mosaic_calls(fn, *args) -> int:
    """How many Mosaic GPU kernels the lowered program calls: 3 for flash attention's forward
    and backward when compiled, 0 in the CPU interpreter."""
    return jax.jit(fn).lower(*args).as_text().count("stablehlo.custom_call @mosaic_gpu")


def check_attention(spec: dict) -> dict:
    """Forward and dq/dk/dv of the Pallas kernel against an fp32 reference, next to the same
    errors of XLA's attention computed in the input dtype ("naive"). Passes when the kernel's
    error is at most twice the naive one (plus 1e-3 of the output's scale)."""
    dtype = DTYPES[spec["dtype"]]
    window = tuple(spec["window"]) if spec.get("window") else None
    q, k, v, d_out = random_qkv(spec["batch"], spec["q_len"], spec["kv_len"], spec["heads"],
                                spec["kv_heads"], spec["head_dim"], dtype, seed=spec.get("seed", 0))
    kernel = attention_fn("pallas", causal=spec["causal"], window=window,
                          tuning=spec.get("tuning"))
    naive = attention_fn("xla", causal=spec["causal"], window=window)
    reference = functools.partial(reference_attention, causal=spec["causal"], window=window)
    # The reference sees the same (rounded) inputs in fp32, so its gradients are not rounded.
    fp32 = [x.astype(jnp.float32) for x in (q, k, v, d_out)]
    results = {}
    for name, fn, args in (("kernel", kernel, (q, k, v, d_out)), ("naive", naive, (q, k, v, d_out)),
                           ("reference", reference, fp32)):
        out, grads = forward_and_backward(fn)(*args)
        results[name] = (out, *grads)
    errors, passed = {}, True
    for index, output in enumerate(("out", "dq", "dk", "dv")):
        want = results["reference"][index]
        scale = float(jnp.max(jnp.abs(want)))
        err_kernel = _max_error(results["kernel"][index], want)
        err_naive = _max_error(results["naive"][index], want)
        ok = err_kernel <= 2 * err_naive + 1e-3 * scale
        passed &= ok
        errors[output] = {"kernel": err_kernel, "naive": err_naive, "scale": scale, "ok": ok}
    return {"spec": spec, "errors": errors, "passed": bool(passed),
            "dtypes_kept": all(x.dtype == dtype for x in results["kernel"]),
            "kernel_calls": mosaic_calls(forward_and_backward(kernel), q, k, v, d_out)}


def correctness_cases(checks: list[dict]) -> Iterator[Case]:
    for spec in checks:
        yield Case(spec["name"], functools.partial(check_attention, spec))


# --------------------------------------------------------------------------- timing
def config_shape(config: dict) -> tuple[int, int]:
    """(batch, heads) of a timing config: ``tokens`` per call, ``width`` = heads * head_dim."""
    return max(1, config["tokens"] // config["seq"]), config["width"] // config["head_dim"]


def time_attention(config: dict, impl: str, pass_: str, *, warmup: int, iters: int,
                   tuning: dict | None = None) -> dict:
    seq, head_dim, causal = config["seq"], config["head_dim"], config["causal"]
    batch, heads = config_shape(config)
    dtype = DTYPES[config.get("dtype", "bf16")]
    q, k, v, d_out = random_qkv(batch, seq, seq, heads, heads, head_dim, dtype)
    fn = attention_fn(impl, causal=causal, tuning=tuning)
    if pass_ == "fwd":
        seconds = median_seconds(jax.jit(fn), q, k, v, warmup=warmup, iters=iters)
    else:
        seconds = median_seconds(forward_and_backward(fn), q, k, v, d_out, warmup=warmup, iters=iters)
    flops = attention_flops(batch, heads, seq, seq, head_dim, causal, pass_)
    return {"seq": seq, "batch": batch, "heads": heads, "head_dim": head_dim, "causal": causal,
            "impl": impl, "pass": pass_, "ms": seconds * 1e3, "tflops": flops / seconds / 1e12,
            "tuning": tuning}


def config_label(config: dict) -> str:
    return f"S={config['seq']} D={config['head_dim']} {'causal' if config['causal'] else 'full'}"


def timing_cases(configs: list[dict], impls: list[str], passes: list[str], warmup: int,
                 iters: int) -> Iterator[Case]:
    for config in configs:
        for impl in impls:
            for pass_ in passes:
                run = functools.partial(time_attention, config, impl, pass_, warmup=warmup, iters=iters)
                yield Case(f"{config_label(config)} {impl} {pass_}", run)


def tile_label(blocks: dict) -> str:
    return " ".join(f"{key}={value}" for key, value in sorted(blocks.items()))


def tile_cases(config: dict, candidates: list[dict], passes: list[str], warmup: int,
               iters: int) -> Iterator[Case]:
    """The Pallas kernel at one shape under each candidate ``TuningConfig``."""
    for blocks in candidates:
        for pass_ in passes:
            yield Case(f"{config_label(config)} {pass_} {tile_label(blocks)}",
                       functools.partial(time_attention, config, "pallas", pass_, warmup=warmup,
                                         iters=iters, tuning=blocks))
