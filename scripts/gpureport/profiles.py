"""What the report measures: the GPU profile (``full``) and its CPU smoke-test twin (``quick``).

Both run the same stages and code paths; ``quick`` shrinks every shape so the Pallas kernels
run in the interpreter on a CPU in seconds. Items come in priority order within each stage:
when a budget runs out, the tail is what is skipped.
"""
from __future__ import annotations

import dataclasses

from benchlib.gpt import PRESETS, train_spec

STAGE_ORDER = ("env", "correctness", "kernels", "training", "fp8", "memory", "offload", "autocast")
"""fp8 right after training: a first 540 s call on an H100 reaches it (the later stages need a
second call anyway)."""


@dataclasses.dataclass(frozen=True)
class Profile:
    name: str
    time_limit_s: float
    "The whole run, in seconds: under 600, so that one run fits a 10-minute job limit."
    budgets: dict
    "Seconds per stage; an item is not started when its stage's budget is spent."
    child_vars: dict
    "Environment of every child process."
    matmul_size: int
    "Side of the bf16 matmul that measures what the vendor library reaches (env stage)."
    attention_checks: tuple
    block_sparse_checks: tuple
    attention_timing: dict
    "configs (seq, head_dim, causal, tokens, width), impls, passes, warmup, iters."
    attention_tiles: dict
    "configs, candidate TuningConfig fields, passes, warmup, iters."
    block_sparse_timing: dict
    training_runs: tuple
    "(label, spec) pairs; the memory stage measures the same configurations."
    offload_ratio: dict
    "base spec and the (offload, update_on) choices; the first choice is the baseline."
    largest: dict
    "base spec (layers vary), searches, fit_by ('run' or 'compile'), limits."
    autocast: dict
    "base spec and the modes (label, params dtype, autocast dtype)."
    fp8: dict
    """gemm (size, warmup, iters); step (base spec, variants (label, autocast, more Precision
    fields; the first is the baseline), warmup, steps); saved (base spec, remat dtypes)."""
    device_memory: float
    "Device bytes assumed when the env stage did not report the allocator's limit."


def _attn(name, *, batch=2, q_len, kv_len=None, heads, kv_heads=None, head_dim, dtype="bf16",
          causal=True, window=None, tuning=None) -> dict:
    return dict(name=name, batch=batch, q_len=q_len, kv_len=kv_len or q_len, heads=heads,
                kv_heads=kv_heads or heads, head_dim=head_dim, dtype=dtype, causal=causal,
                window=window, tuning=tuning)


def _sparse(name, *, m, k, n, block, density, dtype="bf16", block_m=64) -> dict:
    return dict(name=name, m=m, k=k, n=n, block=block, density=density, dtype=dtype, block_m=block_m)


def _gpt_runs(entries, steps: int, warmup: int) -> tuple:
    runs = []
    for preset, attention, remat, batch in entries:
        label = f"{preset} {attention} remat={remat} batch={batch}"
        runs.append((label, train_spec(PRESETS[preset], batch=batch, attention=attention, remat=remat,
                                       steps=steps, warmup=warmup)))
    return tuple(runs)


FP8_VARIANTS = [["bf16 autocast", "bf16", {}], ["fp8 tensor", "fp8", {}],
                ["fp8 delayed", "fp8", {"fp8_scaling": "delayed"}]]
"""The fp8 stage's step: (label, precision.autocast, more precision fields), the baseline first:
FP8 with current (per-tensor) scaling and with delayed scaling against bf16 autocast."""

FULL = Profile(
    name="full",
    time_limit_s=540,
    budgets={"env": 60, "correctness": 75, "kernels": 130, "training": 170, "fp8": 130, "memory": 240,
             "offload": 240, "autocast": 100},
    # The allocator takes 92% of the GPU instead of 75%: the largest-model search needs it.
    child_vars={"XLA_PYTHON_CLIENT_MEM_FRACTION": "0.92"},
    matmul_size=8192,
    attention_checks=(
        _attn("causal MHA bf16 S=1024 D=64", q_len=1024, heads=8, head_dim=64),
        _attn("causal GQA 16q/4kv bf16 S=2048 D=128", q_len=2048, heads=16, kv_heads=4, head_dim=128),
        _attn("full MQA fp16 S=1024 D=128", q_len=1024, heads=8, kv_heads=1, head_dim=128, dtype="fp16",
              causal=False),
        _attn("causal fp16 tail S=1000 D=64", q_len=1000, heads=8, head_dim=64, dtype="fp16"),
        _attn("full bf16 q=384 kv=640 D=80 (padded head)", q_len=384, kv_len=640, heads=4, head_dim=80,
              causal=False),
        _attn("causal window 256 bf16 S=2048 D=64", q_len=2048, heads=8, head_dim=64, window=[256, 0]),
        _attn("window +-128 bf16 S=1024 D=128", q_len=1024, heads=4, head_dim=128, causal=False,
              window=[128, 128]),
        _attn("causal bf16 S=4096 D=128 tiles 64/64", batch=1, q_len=4096, heads=8, head_dim=128,
              tuning={"block_k": 64, "block_k_dq": 64}),
        _attn("causal bf16 S=2048 D=64 tiles 128/128", batch=1, q_len=2048, heads=8, head_dim=64,
              tuning={"block_k": 128, "block_k_dq": 128}),
    ),
    block_sparse_checks=(
        _sparse("bf16 block 64 density 25%", m=1024, k=1024, n=2048, block=64, density=0.25),
        _sparse("bf16 block 128 density 10%", m=2048, k=2048, n=2048, block=128, density=0.1),
        _sparse("fp16 block 32 density 50% tail rows m=1000", m=1000, k=512, n=1024, block=32,
                density=0.5, dtype="fp16"),
        _sparse("bf16 block 32 density 25%", m=512, k=512, n=512, block=32, density=0.25),
    ),
    # The Mosaic GPU kernels first (pallas), at head dim 128 from 4K to 32K tokens per row
    # (32K tokens per call: XLA's attention may run out of memory at 16K-32K, a crash record).
    attention_timing=dict(
        configs=[dict(seq=s, head_dim=128, causal=True, tokens=32768, width=2048)
                 for s in (4096, 8192, 16384, 32768)]
        + [dict(seq=8192, head_dim=64, causal=True, tokens=32768, width=2048),
           dict(seq=8192, head_dim=128, causal=False, tokens=32768, width=2048)],
        impls=["pallas", "cudnn", "xla"], passes=["fwd+bwd", "fwd"], warmup=2, iters=10),
    attention_tiles=dict(
        configs=[dict(seq=8192, head_dim=d, causal=True, tokens=32768, width=2048) for d in (128, 64)],
        candidates=[
            {"block_k": 128, "block_k_dq": 64},  # the default
            {"block_k": 64, "block_k_dq": 64},
        ],  # block_k_dq=128 fits shared memory at head dim 64 only (a correctness case above)
        passes=["fwd", "fwd+bwd"], warmup=2, iters=10),
    block_sparse_timing=dict(m=4096, k=4096, n=4096, dtype="bf16", block_sizes=[128, 64],
                             sparsities=[0.9, 0.75, 0.5], passes=["fwd", "fwd+bwd"], warmup=2, iters=10),
    training_runs=_gpt_runs([("gpt-1b", "cudnn", "none", 16), ("gpt-1b", "pallas", "none", 16),
                             ("gpt-125m", "cudnn", "none", 32), ("gpt-350m", "cudnn", "none", 16),
                             ("gpt-1b", "cudnn", "full", 16), ("gpt-1b", "cudnn", "save_dots", 16),
                             ("gpt-350m", "pallas", "none", 16)], steps=10, warmup=3),
    offload_ratio=dict(
        base=train_spec(PRESETS["gpt-1b"], batch=16, attention="cudnn", remat="none", steps=6, warmup=2),
        choices=[["none", "device"], ["optimizer", "device"], ["optimizer", "host"]]),
    largest=dict(
        base=train_spec(PRESETS["gpt-1b"], batch=8, attention="cudnn", remat="full", steps=1, warmup=1),
        searches=[["none", "device"], ["optimizer", "host"]], fit_by="run", max_layers=400,
        max_probes=4, host_memory_fraction=0.85),
    autocast=dict(
        base=train_spec(PRESETS["gpt-125m"], batch=32, attention="xla", remat="none", steps=10, warmup=3),
        modes=[["fp32", "fp32", None], ["autocast bf16", "fp32", "bf16"], ["hand bf16", "bf16", None]]),
    fp8=dict(
        gemm=dict(size=8192, warmup=3, iters=20),
        # Batch 8: the three variants hold two train states (delayed scaling's has amax histories)
        # and one step's activations, within the 92% of an 80 GB GPU the children get.
        step=dict(base=train_spec(PRESETS["gpt-1b"], batch=8, attention="cudnn", remat="none"),
                  variants=FP8_VARIANTS, warmup=2, steps=8),
        # The compute-dtype run is the training stage's "gpt-1b cudnn remat=save_dots batch=16".
        saved=dict(base=train_spec(PRESETS["gpt-1b"], batch=16, attention="cudnn", remat="save_dots",
                                   steps=2, warmup=1),
                   remat_dtypes=["compute", "fp8"])),
    device_memory=80e9,
)

_TINY_TILES = {"block_k": 64, "block_k_dq": 64}

QUICK = Profile(
    name="quick",
    time_limit_s=600,
    budgets={"env": 60, "correctness": 120, "kernels": 120, "training": 120, "fp8": 180, "memory": 240,
             "offload": 180, "autocast": 120},
    child_vars={"JAX_PLATFORMS": "cpu",
                # Compile fast: the smoke test checks that every path runs, not CPU speed.
                "XLA_FLAGS": "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"},
    matmul_size=128,
    # One case covering causal masking, GQA, a sequence tail and a padded head dim (bf16: XLA:CPU
    # has no fp16 x fp16 -> fp32 dot for the comparison).
    attention_checks=(_attn("causal GQA 4q/2kv bf16 S=40 D=24", batch=1, q_len=40, heads=4, kv_heads=2,
                            head_dim=24, tuning=_TINY_TILES),),
    block_sparse_checks=(_sparse("bf16 block 32 density 50%", m=40, k=64, n=64, block=32, density=0.5,
                                 block_m=64),),
    attention_timing=dict(configs=[dict(seq=32, head_dim=16, causal=True, tokens=32, width=32)],
                          impls=["pallas", "xla"], passes=["fwd", "fwd+bwd"], warmup=1, iters=1),
    attention_tiles=dict(configs=[dict(seq=32, head_dim=16, causal=True, tokens=32, width=32)],
                         candidates=[_TINY_TILES], passes=["fwd"], warmup=1, iters=1),
    block_sparse_timing=dict(m=32, k=64, n=64, dtype="bf16", block_sizes=[32], sparsities=[0.75],
                             passes=["fwd", "fwd+bwd"], warmup=1, iters=1),
    training_runs=_gpt_runs([("tiny", "xla", "none", 4), ("tiny", "pallas", "none", 4)], steps=2, warmup=1),
    offload_ratio=dict(
        base=train_spec(PRESETS["tiny"], batch=4, attention="xla", remat="none", steps=2, warmup=1),
        choices=[["none", "device"], ["optimizer", "device"], ["optimizer", "host"]]),
    largest=dict(
        base=train_spec(PRESETS["tiny"], batch=4, attention="xla", remat="none", steps=1, warmup=1),
        searches=[["none", "device"], ["optimizer", "host"]], fit_by="compile", compile_budget=5e6,
        max_layers=6, max_probes=2, host_memory_fraction=0.85),
    autocast=dict(
        base=train_spec(PRESETS["tiny"], batch=4, attention="xla", remat="none", steps=2, warmup=1),
        modes=[["fp32", "fp32", None], ["autocast bf16", "fp32", "bf16"], ["hand bf16", "bf16", None]]),
    fp8=dict(
        gemm=dict(size=64, warmup=1, iters=2),
        # fp8_select='all': the roofline keeps a tiny model's matmuls in bf16, and the smoke test
        # is there to run the FP8 path (XLA:CPU computes with the float8 types).
        step=dict(base=train_spec(PRESETS["tiny"], batch=4, attention="xla", remat="none"),
                  variants=[[label, autocast, {**fields, "fp8_select": "all"} if autocast == "fp8" else fields]
                            for label, autocast, fields in FP8_VARIANTS], warmup=1, steps=2),
        saved=dict(base=train_spec(PRESETS["tiny"], batch=4, attention="xla", remat="save_dots",
                                   steps=1, warmup=1),
                   remat_dtypes=["compute", "fp8"])),
    device_memory=80e9,
)

PROFILES = {"full": FULL, "quick": QUICK}
