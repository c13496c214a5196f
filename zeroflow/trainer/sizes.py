"""A model too large for any machine this job has, or in a precision its devices cannot
compile, refused before anything is built.

An absurd size (``model.embed_dim=1000000000000``) would otherwise end deep inside JAX, with an
integer overflow or an allocation failure, after minutes of work. ``check_fits`` counts the
parameters by formula and compares the least memory they need with all the memory the job's
processes have (every device's and every host's): a model over it cannot train, whatever the
ZeRO stage or offload. The figure is a lower bound (weights alone, at the fewest bytes any
precision stores them in), so a model it lets through may still not fit; the memory planner
(``python -m zeroflow.memory``) says whether it does.
"""

from __future__ import annotations

import dataclasses
import os

from zeroflow.config.schema import Config, ModelConfig

SIZE_KEYS = ("vocab_size", "embed_dim", "mlp_dim", "num_layers", "num_heads", "head_dim", "seq_len")
"The model keys that make the weights (and the activations) large."


def least_bytes(model: ModelConfig, batch_size: int, quantized_base: bool) -> int:
    """The fewest bytes a run of ``model`` can hold: its weights at 2 bytes each (half a byte
    for an NF4/int8-quantized LoRA base) and one layer's activations of one batch at 2 bytes."""
    heads = model.num_heads * (model.head_dim or model.embed_dim // max(model.num_heads, 1))
    kv = (model.num_kv_heads or model.num_heads) * (
        model.head_dim or model.embed_dim // max(model.num_heads, 1)
    )
    per_layer = model.embed_dim * (2 * heads + 2 * kv) + 2 * model.embed_dim * model.mlp_dim
    weights = model.num_layers * per_layer + model.vocab_size * model.embed_dim
    activations = batch_size * model.seq_len * model.embed_dim
    return int(weights * (0.5 if quantized_base else 2) + 2 * activations)


def job_memory() -> int:
    """Bytes of memory the job has: this host's RAM and its devices' own memory, times the
    processes (CPU devices share the host's RAM and add nothing)."""
    import jax

    page, pages = os.sysconf("SC_PAGE_SIZE"), os.sysconf("SC_PHYS_PAGES")
    device_bytes = 0
    for device in jax.local_devices():
        if device.platform != "cpu":
            stats = device.memory_stats() or {}
            device_bytes += int(stats.get("bytes_limit", 0))
    return (page * pages + device_bytes) * jax.process_count()


def _largest_key(model: ModelConfig, batch_size: int, quantized: bool) -> str:
    """The size key whose value, put back to its default, shrinks the need the most."""
    defaults = ModelConfig()

    def without(key: str) -> int:
        return least_bytes(
            dataclasses.replace(model, **{key: getattr(defaults, key)}), batch_size, quantized
        )

    return min(SIZE_KEYS, key=without)


def check_fits(cfg: Config, model: ModelConfig | None = None, memory: int | None = None) -> None:
    """ValueError naming the model key and the memory the run would need when even its least
    need is over the job's memory (``memory``: bytes, measured when None)."""
    from zeroflow.trainer.setup import run_model_config

    model = model or run_model_config(cfg)
    quantized = model.lora.rank > 0 and model.lora.quantize != "none"
    need = least_bytes(model, cfg.train.batch_size, quantized)
    have = job_memory() if memory is None else memory
    if need <= have:
        return
    key = _largest_key(model, cfg.train.batch_size, quantized)
    raise ValueError(
        f"model.{key}={getattr(model, key)} makes a model that needs at least "
        f"{_size(need)} (its weights at 2 bytes each and one layer's activations), more than "
        f"the {_size(have)} of memory this job has (devices and host RAM of every process); "
        f"give a smaller model.{key}"
    )


def _size(nbytes: int) -> str:
    for unit, scale in (("EB", 1e18), ("PB", 1e15), ("TB", 1e12), ("GB", 1e9), ("MB", 1e6)):
        if nbytes >= scale:
            return f"{nbytes / scale:,.1f} {unit}"
    return f"{nbytes:,} bytes"


def check_backend(cfg: Config) -> None:
    """ValueError naming ``precision.params`` when the devices cannot compile the step in it:
    XLA:CPU has no fp16 matrix product with fp32 accumulation for the step's batched products
    ("The precision 'F16_F16_F32' is not supported by dot_general on CPU"), found otherwise only
    as the first step compiles."""
    import jax

    if cfg.precision.params == "fp16" and jax.devices()[0].platform == "cpu":
        raise ValueError(
            "precision.params=fp16 does not compile on CPU (XLA:CPU has no fp16 matrix "
            "product with fp32 accumulation); on CPU use precision.params=bf16 (the same 2 bytes "
            "per weight, no loss scale needed) or fp32; fp16 trains on GPUs"
        )
