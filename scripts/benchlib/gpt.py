"""One GPT training configuration on one accelerator, measured: step time, tokens/s, MFU, the
memory XLA plans for the compiled step, the memory actually allocated, and what
``zeroflow.memory`` estimates for the same configuration.

A configuration is a plain dict (a "spec", JSON-able so that it can cross to a child
process): ``model`` (``ModelConfig`` fields), ``batch`` (sequences per step), ``params``
(compute dtype), ``autocast`` (None or a dtype: ``zf.Precision(autocast=...)``), optionally
``precision`` (more ``zf.Precision`` fields under autocast, e.g. ``fp8_scaling``), ``offload``,
``update_on``, ``stage``, and how many ``warmup`` and timed ``steps`` to run. The step is the
trainer's own (``zeroflow.trainer.setup.build_run``: layer-wise loss, AdamW with clipping).
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import time

# Shapes close to GPT-2 small / medium and a 1B model (SwiGLU, RMSNorm, rotary, tied 32k
# vocabulary); parameter counts are exact in every report (zeroflow.memory.count_gpt_params).
_VOCAB_32K = dict(vocab_size=32000, seq_len=1024)
PRESETS: dict[str, dict] = {
    "gpt-125m": dict(num_layers=12, embed_dim=768, num_heads=12, mlp_dim=2048, **_VOCAB_32K),
    "gpt-350m": dict(num_layers=24, embed_dim=1024, num_heads=16, mlp_dim=2816, **_VOCAB_32K),
    "gpt-1b": dict(num_layers=18, embed_dim=2048, num_heads=16, mlp_dim=5632, **_VOCAB_32K),
    "tiny": dict(num_layers=2, embed_dim=64, num_heads=4, mlp_dim=128, vocab_size=256, seq_len=32),
}
TIMING_FIELDS = ("steps", "warmup")


def train_spec(model: dict, *, batch: int, params: str = "bf16", autocast: str | None = None,
               offload: str = "none", update_on: str = "device", stage: int = 0, steps: int = 8,
               warmup: int = 2, **model_overrides) -> dict:
    return {"model": {**model, **model_overrides}, "batch": batch, "params": params,
            "autocast": autocast, "offload": offload,
            "update_on": update_on if offload != "none" else "device", "stage": stage,
            "steps": steps, "warmup": warmup}


def spec_key(spec: dict) -> str:
    """Identifies a configuration regardless of how long it is timed (for reusing results)."""
    return json.dumps({k: v for k, v in spec.items() if k not in TIMING_FIELDS}, sort_keys=True)


def config_for(spec: dict):
    """The trainer ``Config`` of a spec, on one device."""
    from zeroflow.config.schema import Config
    cfg = Config()
    cfg.model = dataclasses.replace(cfg.model, **spec["model"])
    cfg.train.batch_size = spec["batch"]
    cfg.precision.params = spec["params"]
    cfg.parallel.data, cfg.parallel.zero_stage = 1, spec["stage"]
    cfg.parallel.offload, cfg.parallel.update_on = spec["offload"], spec["update_on"]
    return cfg


def num_params(spec: dict) -> int:
    from zeroflow.memory import count_gpt_params
    return count_gpt_params(config_for(spec).model)


def estimate(spec: dict):
    """``zeroflow.memory.estimate_config`` for the spec (a ``MemoryEstimate``)."""
    from zeroflow.memory import estimate_config
    cfg = config_for(spec)
    return estimate_config(cfg, num_devices=1, stage=spec["stage"], offload=spec["offload"],
                           update_on=spec["update_on"], remat=cfg.model.remat)


def estimate_dict(spec: dict) -> dict:
    """The ZeRO formula's figures for the spec (the step's peak is XLA's compile's)."""
    est = estimate(spec)
    return {"device": est.device_bytes, "model_states": est.model_state_bytes,
            "activations": est.activation_bytes, "host": est.host_bytes,
            "between_steps": est.between_steps_bytes}


def _compiled_memory(compiled) -> dict | None:
    from zeroflow.memory.measure import from_memory_analysis
    stats = compiled.memory_analysis()
    if stats is None:
        return None
    got = from_memory_analysis(stats)
    return {**dataclasses.asdict(got), "total_bytes": got.total_bytes}


def build_without_state(spec: dict):
    """(cfg, run, batch) on the first device, as the trainer builds them; no state yet."""
    import jax
    import numpy as np

    import zeroflow as zf
    from zeroflow.trainer.setup import build_run
    cfg = config_for(spec)
    run = build_run(cfg, with_data=False, devices=jax.devices()[:1])
    if spec["autocast"]:  # the issue-12 contract: Precision(..., autocast="bf16")
        # "precision": more Precision fields (e.g. fp8_scaling), before the state is made
        # (delayed FP8 scaling puts its amax histories in it).
        prec = zf.Precision(params=spec["params"], autocast=spec["autocast"], **spec.get("precision", {}))
        run = dataclasses.replace(run, prec=prec)
    tokens = np.random.default_rng(0).integers(
        0, cfg.model.vocab_size, (spec["batch"], cfg.model.seq_len + 1), dtype=np.int32)
    return cfg, run, run.global_batch(tokens)


def _build(spec: dict):
    """(cfg, run, state, batch) on the first device, as the trainer builds them."""
    cfg, run, batch = build_without_state(spec)
    return cfg, run, run.init_state(), batch


@contextlib.contextmanager
def phase(name: str):
    """Prefix an error with the phase it happened in ("init: RESOURCE_EXHAUSTED ..."): an
    out-of-memory error while building the state is not one while training."""
    try:
        yield
    except Exception as err:
        raise RuntimeError(f"{name}: {type(err).__name__}: {err}") from err


def train_case(**spec) -> dict:
    """Runs in a child process: compile once ahead of time, then warm-up and timed steps with
    the compiled executable. Out-of-memory surfaces as an exception (the parent calls it OOM)."""
    import jax

    from benchlib.hardware import peak_bf16_flops
    from benchlib.timing import time_steps
    from zeroflow.models import flops_per_token
    with phase("init"):
        cfg, run, state, batch = _build(spec)
    start = time.perf_counter()
    with phase("compile"):
        compiled = run.make_step().lower(state, batch).compile()
    compile_s = time.perf_counter() - start
    with phase("step"):
        state, metrics, times = time_steps(compiled, state, batch, warmup=spec["warmup"],
                                           steps=spec["steps"])
    device = jax.devices()[0]
    stats = device.memory_stats() or {}
    step_s = statistics.median(times) if times else None
    tokens = spec["batch"] * cfg.model.seq_len
    flops = flops_per_token(cfg.model, cfg.train.freeze)
    peak, _ = peak_bf16_flops(device.device_kind)
    loss = float(jax.device_get(metrics["loss"]))
    return {
        "params": num_params(spec), "tokens_per_step": tokens, "flops_per_token": flops,
        "step_s": step_s, "min_step_s": min(times) if times else None,
        "tokens_per_s": tokens / step_s if step_s else None,
        "mfu": flops * tokens / step_s / peak if (peak and step_s) else None,
        "loss": loss, "loss_finite": loss == loss and abs(loss) != float("inf"),
        "compile_s": compile_s, "matmul_precision": jax.config.jax_default_matmul_precision,
        "memory": {"compiled": _compiled_memory(compiled),
                   "allocated_peak": stats.get("peak_bytes_in_use"),
                   "bytes_limit": stats.get("bytes_limit"),
                   "estimate": estimate_dict(spec)},
    }


def deviceless_case(spec: dict) -> dict:
    """Runs in a child process on the GPU machine: ``deviceless_memory`` for this GPU."""
    import jax
    return deviceless_memory(spec, jax.devices()[0].device_kind)


def deviceless_memory(spec: dict, device_kind: str) -> dict:
    """The same step compiled for this GPU's abstract twin (``zf.target_mesh``) in a child
    process on the CPU platform: the prediction a machine without a GPU makes, recorded beside
    what this GPU's compiler and allocator say."""
    from zeroflow.backend import accelerators, targets

    found = accelerators.of_kind(device_kind)  # a zf.target_mesh name where zeroflow ships a spec
    target = found.name if found and found.name in targets.TARGETS else None
    if target is None:
        return {"note": f"no target spec for {device_kind}"}
    code = ("import json, sys; from benchlib.gpt import deviceless_child; "
            "print(json.dumps(deviceless_child(json.loads(sys.argv[1]), sys.argv[2])))")
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    try:
        done = subprocess.run([sys.executable, "-c", code, json.dumps(spec), target], env=env,
                              capture_output=True, text=True, timeout=300,
                              cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    except subprocess.TimeoutExpired:
        return {"target": target, "note": "the deviceless compile took over 300 s"}
    if done.returncode:
        return {"target": target, "note": (done.stderr.strip().splitlines() or ["failed"])[-1][:200]}
    return {"target": target, **json.loads(done.stdout.strip().splitlines()[-1])}


def deviceless_child(spec: dict, target: str) -> dict:
    """In a process on the CPU platform: XLA:GPU's memory analysis of the spec's step for one
    abstract ``target`` GPU."""
    from zeroflow.memory.measure import analysed, device_peak
    from zeroflow.trainer.planning import abstract_setup
    cfg = config_for(spec)
    setup = abstract_setup(cfg, num_devices=1, stage=spec["stage"], offload=spec["offload"],
                           update_on=spec["update_on"], remat=cfg.model.remat, target=target)
    got = analysed(setup.step.lower(setup.state, setup.batch).compile())
    return {"total_bytes": got.total_bytes, "device_peak": device_peak(got, setup.state)}


def compile_fit_case(device_budget: float, **spec) -> dict:
    """Does the step fit ``device_budget`` bytes by XLA's memory analysis? Nothing is
    allocated (for CPUs, where running out of memory is no test of a GPU's)."""
    import jax

    from zeroflow import memory
    from zeroflow.trainer.planning import abstract_setup
    cfg = config_for(spec)
    setup = abstract_setup(cfg, num_devices=1, stage=spec["stage"], offload=spec["offload"],
                           update_on=spec["update_on"], remat=cfg.model.remat)
    got = memory.measure(setup.step, setup.state, setup.batch)
    need = got.total_bytes
    if jax.default_backend() == "cpu":  # the CPU counts pinned_host arrays as device arguments
        need -= memory.state_bytes(setup.state).get("pinned_host", 0)
    return {"fits": need <= device_budget, "need_bytes": need, "budget_bytes": device_budget,
            "params": num_params(spec)}
