"""The trainer's GPT as a ``RunSpec`` (``zeroflow.memory.spec``), and the memory figures of a
config that read it: parameters from the model's own init (``abstract_params``: its
``jax.eval_shape``), FLOPs from ``flops_per_token``, the target from the accelerator table.

``zf.memory.count_gpt_params``, ``estimate_config``, ``activations`` and
``offloaded_activations`` are these functions (the memory package names them for its callers;
nothing in it imports them).
"""

from __future__ import annotations

from typing import Any

from zeroflow.backend import accelerators
from zeroflow.memory.estimate import DTYPE_BYTES, MemoryEstimate, precision_name
from zeroflow.memory.spec import RunSpec
from zeroflow.models.flops import flops_per_token
from zeroflow.models.gpt import (
    GATED,
    LAYER_STACK,
    abstract_params,
    count_params,
    head_dim,
    num_kv_heads,
)
from zeroflow.util.settings import FP8_REMATS, REMAT_DTYPES, REMATS


def run_spec(
    cfg,
    *,
    num_devices: int | None = None,
    stage: int | None = None,
    offload: str | None = None,
    update_on: str | None = None,
    remat: str | None = None,
    target: str | None = None,
    frozen_params: int = 0,
) -> RunSpec:
    """The run a trainer ``Config`` describes; keywords override its ``parallel.*`` and
    ``model.remat``. ``frozen_params``: how many parameters ``train.freeze`` or LoRA freezes
    (``zeroflow.trainer.planning.count_frozen_params``)."""
    par, model = cfg.parallel, cfg.model
    n = num_devices if num_devices is not None else (par.data if par.data > 0 else None)
    if n is None:
        raise ValueError("parallel.data is -1 (all devices); pass num_devices")
    offload = par.offload if offload is None else offload
    found = None if target is None else accelerators.required(target)
    return RunSpec(
        params=abstract_params(model)[0],
        num_devices=n,
        stage=par.zero_stage if stage is None else stage,
        offload=offload,
        update_on=(par.update_on if update_on is None else update_on)
        if offload != "none"
        else "device",
        remat=model.remat if remat is None else remat,
        precision=cfg.precision.params,
        optimizer=cfg.train.optimizer,
        layer_stack=LAYER_STACK,
        frozen_params=frozen_params,
        quantize=model.lora.quantize if model.lora.rank else "none",
        model_parallel=max(par.model, 1),
        flops_per_token=flops_per_token(model, cfg.train.freeze),
        tokens_per_step=cfg.train.batch_size * model.seq_len,
        target=found,
    )


def estimate_config(
    cfg,
    *,
    num_devices: int | None = None,
    stage: int | None = None,
    offload: str | None = None,
    update_on: str | None = None,
    remat: str | None = None,
    devices_per_process: int | None = None,
    frozen_params: int = 0,
    remat_dtype: str | None = None,
) -> MemoryEstimate:
    """Estimate for a trainer ``zeroflow.config.Config`` (``run_spec``'s keywords override
    its choices): the ZeRO formula's model states of its parameters (``RunSpec.model_states``:
    gradients in fp32, ``train.optimizer``'s state counted tensor by tensor, frozen ones as
    ``model.lora.quantize`` stores them) plus ``activations`` per micro-batch (in
    ``remat_dtype``, default ``model.remat_dtype``)."""
    spec = run_spec(
        cfg,
        num_devices=num_devices,
        stage=stage,
        offload=offload,
        update_on=update_on,
        remat=remat,
        frozen_params=frozen_params,
    )
    micro = cfg.train.batch_size // (spec.num_devices * cfg.parallel.grad_accum)
    if micro < 1:
        raise ValueError(
            f"train.batch_size {cfg.train.batch_size} is smaller than data devices "
            f"{spec.num_devices} x grad_accum {cfg.parallel.grad_accum}"
        )
    acts = activations(
        cfg.model,
        micro_batch=micro,
        remat=spec.remat,
        precision=spec.precision,
        remat_dtype=remat_dtype,
    )
    return spec.model_states(activation_bytes=acts, devices_per_process=devices_per_process)


def count_gpt_params(model) -> int:
    """Parameter count of the GPT model of ``model`` (a ``ModelConfig``), from its abstract
    init: nothing allocated."""
    return count_params(abstract_params(model)[0])


def optimizer_bytes_per_param(model, optimizer: str) -> float:
    """Optimizer-state bytes per parameter of the GPT under ``optimizer`` (``train.optimizer``)."""
    return RunSpec(abstract_params(model)[0], optimizer=optimizer).optimizer_bytes_per_param


def _check_micro_batch(micro_batch: Any) -> None:
    if isinstance(micro_batch, bool) or not isinstance(micro_batch, int) or micro_batch < 1:
        raise ValueError(f"micro_batch must be an int >= 1, got {micro_batch!r}")


FP8_SCALE_BYTES = 4
"One fp32 scale beside each tensor kept in FP8 (``zeroflow.autocast.fp8_saved``)."


def _fp8_remat_dtype(model, remat: str, remat_dtype: str | None) -> bool:
    """Whether ``remat`` keeps its saved activations in FP8: ``remat_dtype`` (default
    ``model.remat_dtype``) is 'fp8' and the policy saves something (as the model runs it:
    remat 'none' stays in the compute dtype)."""
    remat_dtype = getattr(model, "remat_dtype", "compute") if remat_dtype is None else remat_dtype
    if remat_dtype not in REMAT_DTYPES:
        raise ValueError(f"unknown remat dtype {remat_dtype!r}; choose one of {list(REMAT_DTYPES)}")
    return remat_dtype == "fp8" and remat in FP8_REMATS


def fp8_dots_per_token(model) -> tuple[int, int]:
    """``(elements per token, tensors)`` of the matmul outputs ``remat_dtype='fp8'`` keeps in
    e4m3 under the dots policies: q, k, v, the attention output, up and (gated) gate."""
    q, kv = model.num_heads * head_dim(model), num_kv_heads(model) * head_dim(model)
    gated = model.mlp_activation in GATED
    return q + 2 * kv + model.embed_dim + (2 if gated else 1) * model.mlp_dim, 5 + gated


def _saved_per_layer(model, remat: str, fp8: bool, width: int, tokens: int) -> float:
    """What one scanned block keeps for the backward pass in device memory under ``remat``
    ('save_dots' or 'full'; the offloading policies' host part is ``offloaded_activations``).
    save_dots keeps the outputs of the weight matmuls (q, k, v, out, up, gate, down) plus the
    block input; attention scores and norms are recomputed. With ``fp8`` the six outputs
    ``fp8_dots_per_token`` counts are one byte each plus a scale (the block input stays at
    ``width``); full keeps only the block input (the scan carry), with ``fp8`` one byte each."""
    h = model.embed_dim
    if remat == "full":
        return tokens * h + FP8_SCALE_BYTES if fp8 else width * tokens * h
    q, kv = model.num_heads * head_dim(model), num_kv_heads(model) * head_dim(model)
    gated = model.mlp_activation in GATED
    dots = width * tokens * (h + q + 2 * kv + h + (2 if gated else 1) * model.mlp_dim + h)
    if not fp8:
        return dots
    elements, tensors = fp8_dots_per_token(model)
    return dots - (width - 1) * tokens * elements + tensors * FP8_SCALE_BYTES


def activations(
    model,
    *,
    micro_batch: int,
    remat: str | None = None,
    precision: Any = "bf16",
    remat_dtype: str | None = None,
) -> float:
    """Saved activations of the GPT model per device for one micro-batch of ``micro_batch``
    sequences, under ``remat`` (default ``model.remat``) in ``remat_dtype`` (default
    ``model.remat_dtype``). The formula is in docs/memory.md."""
    remat = model.remat if remat is None else remat
    if remat not in REMATS:
        raise ValueError(f"unknown remat policy {remat!r}; choose one of {list(REMATS)}")
    _check_micro_batch(micro_batch)
    fp8 = _fp8_remat_dtype(model, remat, remat_dtype)
    width = DTYPE_BYTES[precision_name(precision)]
    b, s, h, f = micro_batch, model.seq_len, model.embed_dim, model.mlp_dim
    heads = model.num_heads
    q, kv = heads * head_dim(model), num_kv_heads(model) * head_dim(model)
    gated = model.mlp_activation in GATED
    tokens = b * s
    # The tiled MLP (model.mlp_chunk) holds one chunk's intermediates at a time.
    mlp_tokens = b * min(model.mlp_chunk, s) if model.mlp_chunk else tokens
    # Everything one block keeps for its backward pass when nothing is recomputed:
    # two norm inputs + two norm outputs (4h), q/k/v (q + 2kv), attention output (q),
    # MLP up/gate/hidden (3f gated, 2f not); scores: fp32 softmax + compute-dtype probs,
    # or with a flash kernel (cudnn, pallas) none of them, only its fp32 softmax statistics.
    flash = getattr(model, "attention", "xla") in ("cudnn", "pallas")
    scores = b * heads * s * (4 if flash else s * (4 + width))
    per_layer_none = (
        width * (tokens * (4 * h + 2 * q + 2 * kv) + mlp_tokens * (3 if gated else 2) * f) + scores
    )
    layers = model.num_layers
    if remat == "none":
        blocks = layers * per_layer_none
    elif remat in ("save_dots", "full"):  # + one block being recomputed
        blocks = layers * _saved_per_layer(model, remat, fp8, width, tokens) + per_layer_none
    elif remat == "offload_input":  # the layer inputs are in host memory (offloaded_activations)
        blocks = per_layer_none
    else:  # offload_dots: its matmul outputs are in host memory (offloaded_activations), the
        # block input (at its width, FP8 or not) on the device as full's
        blocks = layers * _saved_per_layer(model, "full", False, width, tokens) + per_layer_none
    return float(blocks + width * tokens * 3 * h + _loss_bytes(model, b, s))


def _loss_bytes(model, b: int, s: int) -> float:
    """Embedding output, final norm in/out aside: the loss's fp32 logits and their softmax, or
    with the chunked cross-entropy (model.loss_chunk) one tile of each and the fp32 gradient of
    the output projection it accumulates."""
    v, h = model.vocab_size, model.embed_dim
    if model.loss_chunk:
        tile = b * min(model.loss_chunk, s) * min(model.loss_vocab_chunk, v)
        return 2 * 4 * tile + 4 * v * h
    return 2 * 4 * b * s * v


def offloaded_activations(
    model,
    *,
    micro_batch: int,
    remat: str | None = None,
    precision: Any = "bf16",
    remat_dtype: str | None = None,
) -> float:
    """Activations an offloading remat keeps in pinned host memory per device for one
    micro-batch: for 'offload_dots' save_dots's matmul outputs, the block input aside; for
    'offload_input' each block's input (0 for other policies); in FP8 where ``remat_dtype``
    (default ``model.remat_dtype``) is 'fp8' (``_saved_per_layer``)."""
    remat = model.remat if remat is None else remat
    fp8 = _fp8_remat_dtype(model, remat, remat_dtype)
    width = DTYPE_BYTES[precision_name(precision)]
    tokens = micro_batch * model.seq_len
    if remat == "offload_input":
        return float(model.num_layers * _saved_per_layer(model, "full", fp8, width, tokens))
    if remat != "offload_dots":
        return 0.0
    saved = _saved_per_layer(model, "save_dots", fp8, width, tokens)
    device = _saved_per_layer(model, "full", False, width, tokens)
    return float(model.num_layers * (saved - device))
