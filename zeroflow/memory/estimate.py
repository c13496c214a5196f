"""Analytic memory per device (and per host process) for ZeRO stages, offload and remat.

Model states follow the ZeRO paper's accounting (Rajbhandari et al. 2020, section 3.1): with
mixed-precision Adam every parameter costs 2 bytes of compute weights, 2 bytes of gradients and
K = 12 bytes of fp32 master weights + two fp32 moments. Stage 1 divides the 12 by the number of
data-parallel devices N, stage 2 also the gradients, stage 3 also the compute weights:

    stage 0: (2 + 2 + 12) P      stage 2: 2 P + (2 + 12) P / N
    stage 1: (2 + 2) P + 12 P / N    stage 3: (2 + 2 + 12) P / N

fp32 training keeps one fp32 copy of the weights, shared by compute and optimizer, so 4 + 4
(gradients) + 8 (moments) = 16 bytes per parameter at stage 0. At stages 1 and 2 the shared
copy is stored sharded and gathered whole for the forward/backward pass, so the gathered 4 P
counts as compute weights and the stored 4 P / N as master; at stage 3 compute and storage
share one sharded layout again (4 P / N).

A frozen parameter (``frozen_params``; ``zf.init_train_state(trainable=...)``) costs only its
stored bytes, b P_f at stages 0-2 and b P_f / N at stage 3, no gradient, master or optimizer
state: b is the compute dtype's width (2 for bf16), or, for a base ``zf.quantize_frozen``
stores in 4 or 8 bits, its packed bytes per parameter (``frozen_bytes_per_param``: about 0.52
for NF4, 1.06 for int8).

The activation formula for the GPT model and the meaning of each field are in docs/memory.md.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from zeroflow.autocast.precision import DTYPES
from zeroflow.backend.mesh import planning_mesh
from zeroflow.engine.plan import OFFLOAD_CHOICES, UPDATE_ON_CHOICES, ZERO_STAGES, ZeroPlan
from zeroflow.engine.plan_rules import host_update_problem
from zeroflow.engine.quantized import quantized_bytes
from zeroflow.optim import moment_bytes

# Re-exported (their home is util.units, importable without jax).
from zeroflow.util.units import REMATS as REMATS
from zeroflow.util.units import format_bytes as format_bytes
from zeroflow.util.units import parse_bytes as parse_bytes

STAGES = ZERO_STAGES
OFFLOADS = OFFLOAD_CHOICES
UPDATE_ONS = UPDATE_ON_CHOICES
DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
ADAM_BYTES = 8
"Optimizer-state bytes per parameter for Adam/AdamW: two fp32 moments."


@dataclasses.dataclass(frozen=True)
class ModelStates:
    """Bytes of each kind of model state (per device, or per process for host memory)."""

    compute_weights: float = 0.0
    gradients: float = 0.0
    master: float = 0.0
    optimizer: float = 0.0

    @property
    def total(self) -> float:
        return self.compute_weights + self.gradients + self.master + self.optimizer


@dataclasses.dataclass(frozen=True)
class MemoryEstimate:
    """What one choice of stage / offload / remat needs.

    ``device``: model states on each device during forward and backward; ``host``: model
    states in each process's pinned host memory; ``update_bytes``: model states on each device
    while the optimizer update runs (with ``update_on="device"`` the offloaded master and
    optimizer state are streamed in for it; this is the bound where all of it is resident at
    once); ``activation_bytes``: saved activations per device for one micro-batch (0 when no
    model config was given). ``between_steps_bytes``: what stays on each device between steps
    (the TrainState's device-memory arrays: compute weights, and master + optimizer state when
    not offloaded).
    """

    num_params: int
    num_devices: int
    stage: int
    offload: str
    update_on: str
    precision: str
    device: ModelStates
    host: ModelStates
    update_bytes: float
    between_steps_bytes: float
    activation_bytes: float = 0.0
    remat: str | None = None

    @property
    def model_state_bytes(self) -> float:
        """Per-device model states at the step's peak, without activations."""
        return max(self.device.total, self.update_bytes)

    @property
    def device_bytes(self) -> float:
        """Per-device peak: forward/backward (model states + activations) or the update."""
        return max(self.device.total + self.activation_bytes, self.update_bytes)

    @property
    def host_bytes(self) -> float:
        """Per-process pinned host memory for offloaded model states."""
        return self.host.total


GATED = ("swiglu", "geglu")
"MLP activations with a gate: three projections (gate, up, down) instead of two."


def _precision_name(precision: Any) -> str:
    name = getattr(precision, "params", precision)
    if name not in DTYPE_BYTES:
        raise ValueError(
            f"unknown precision {precision!r}; use a zf.Precision or one of {sorted(DTYPE_BYTES)}"
        )
    return name


def _check_int(name: str, value: Any, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")
    return value


def estimate(
    *,
    num_params: int,
    num_devices: int,
    stage: int,
    offload: str = "none",
    update_on: str = "device",
    precision: Any = "bf16",
    devices_per_process: int | None = None,
    gradient_bytes: int | None = None,
    optimizer_bytes: float = ADAM_BYTES,
    activation_bytes: float = 0.0,
    remat: str | None = None,
    resident_params: int | None = None,
    frozen_params: int = 0,
    frozen_bytes_per_param: float | None = None,
) -> MemoryEstimate:
    """Model-state memory of ZeRO ``stage`` with ``num_devices`` data-parallel devices.

    ``precision``: a ``zf.Precision`` or its params string ("bf16", "fp16", "fp32").
    ``devices_per_process``: how many devices share one host process's memory (default: all
    devices up to 8, one process per 8-accelerator host). ``gradient_bytes``: bytes per
    gradient element; default the compute dtype's (the paper's accounting; zeroflow's engine
    reduces gradients in fp32, pass 4 for its peak). ``optimizer_bytes``: per parameter,
    8 for Adam, 4 with bf16 moments, about 2 with 8-bit ones (``optimizer_bytes_per_param``).
    ``activation_bytes``: per device and micro-batch, see ``activations``.
    ``resident_params``: with ``offload="optimizer+params"``, how many parameters' compute
    weights are on the device at once during forward/backward when the layer stack is
    streamed in one layer at a time (default: all, as when nothing is streamed).
    ``frozen_params``: how many of the ``num_params`` are frozen: stored once in the compute
    dtype (beside the compute weights, offloaded with them), nothing else.
    ``frozen_bytes_per_param``: bytes each frozen parameter is stored in, where not the
    compute dtype's (a quantized base: ``stored_frozen_bytes_per_param`` of a GPT config).
    """
    n = _check_inputs(num_params, num_devices, stage, offload, update_on, activation_bytes)
    per_process = (
        min(n, 8)
        if devices_per_process is None
        else _check_int("devices_per_process", devices_per_process, 1)
    )
    name = _precision_name(precision)
    grad_width = (
        DTYPE_BYTES[name]
        if gradient_bytes is None
        else _check_int("gradient_bytes", gradient_bytes, 1)
    )
    p = float(num_params)
    if (
        isinstance(frozen_params, bool)
        or not isinstance(frozen_params, (int, float))
        or not (0 <= frozen_params <= p)
    ):
        raise ValueError(
            f"frozen_params must be a number in [0, num_params={num_params}], got {frozen_params!r}"
        )
    frozen_width = float(
        DTYPE_BYTES[name] if frozen_bytes_per_param is None else frozen_bytes_per_param
    )
    if not frozen_width > 0:
        raise ValueError(f"frozen_bytes_per_param must be > 0, got {frozen_bytes_per_param!r}")
    # The plan's own reading of the choices (a planning mesh: nothing but the sizes is needed).
    plan = ZeroPlan(planning_mesh(n), stage=stage, offload=offload, update_on=update_on)
    states = _model_states(
        plan, name, p, float(frozen_params), grad_width, optimizer_bytes, frozen_width
    )
    resident = (
        p
        if resident_params is None
        else min(float(_check_int("resident_params", resident_params, 0)), p)
    )
    return _memory_estimate(
        plan,
        states,
        name=name,
        params=p,
        resident=resident,
        per_process=per_process,
        activation_bytes=float(activation_bytes),
        remat=remat,
    )


def _check_inputs(num_params, num_devices, stage, offload, update_on, activation_bytes) -> int:
    """The number of devices, once every choice of ``estimate`` is known to be valid."""
    if isinstance(num_params, bool) or not isinstance(num_params, (int, float)) or num_params < 0:
        raise ValueError(f"num_params must be a number >= 0, got {num_params!r}")
    n = _check_int("num_devices", num_devices, 1)
    if isinstance(stage, bool) or stage not in STAGES:
        raise ValueError(f"unknown ZeRO stage {stage!r}; choose one of {list(STAGES)}")
    if offload not in OFFLOADS:
        raise ValueError(f"unknown offload {offload!r}; choose one of {list(OFFLOADS)}")
    if update_on not in UPDATE_ONS:
        raise ValueError(f"unknown update_on {update_on!r}; choose one of {list(UPDATE_ONS)}")
    problem = host_update_problem(offload, update_on)
    if problem:
        raise ValueError(problem)
    if activation_bytes < 0:
        raise ValueError(f"activation_bytes must be >= 0, got {activation_bytes!r}")
    return n


@dataclasses.dataclass(frozen=True)
class _StateBytes:
    """Per-device bytes of each model state under one plan, wherever it is kept."""

    compute: float
    "Compute weights, frozen ones included, on the device during forward/backward."
    frozen: float
    "Frozen weights: stored as used, no master, gradient or moments."
    master: float
    grads: float
    opt: float
    trained_weights: float
    "The trained weights' compute copy (0 where fp32 gathers it from the master each step)."
    stored_weights: float
    "Compute-dtype weights kept between steps."
    host_compute: float
    "Compute weights kept in host memory."


def _model_states(
    plan: ZeroPlan,
    name: str,
    p: float,
    f: float,
    grad_width: int,
    optimizer_bytes: float,
    frozen_width: float,
) -> _StateBytes:
    """The ZeRO paper's accounting of ``p`` parameters (``f`` of them frozen, ``frozen_width``
    bytes each) in precision ``name`` under ``plan``."""
    n, width, trained = plan.data_size, DTYPE_BYTES[name], p - f

    def split(sharded: bool) -> float:
        return 1.0 / n if sharded else 1.0

    # Stored as used (a quantized one dequantized inside the step, a layer at a time): no
    # master, gradient or moments.
    frozen = frozen_width * f * split(plan.shards_compute)
    # On the device during forward/backward.
    compute = width * trained * split(plan.shards_compute) + frozen
    # fp32: one copy serves compute and optimizer. Where storage and compute layouts agree
    # (stages 0 and 3) that copy is the master itself; at stages 1 and 2 the compute copy is
    # gathered from the sharded master for each step and dropped after it.
    shared = name == "fp32" and plan.shards_storage == plan.shards_compute
    gathered = name == "fp32" and plan.gathers_whole_weights
    master = 0.0 if shared else 4 * trained * split(plan.shards_storage)
    trained_weights = 0.0 if gathered else compute - frozen
    # zeroflow keeps no compute copy at stage 3 (ZeroPlan.keeps_compute_copy): each use casts
    # the master's shard as it gathers it. The paper's accounting (``device``) keeps its copy.
    cast_on_use = width < 4 and not plan.keeps_compute_copy(DTYPES[name])
    with_params = plan.offloads_params
    return _StateBytes(
        compute=compute,
        frozen=frozen,
        master=master,
        grads=grad_width * trained * split(plan.shards_grads),
        opt=optimizer_bytes * trained * split(plan.shards_storage),
        trained_weights=trained_weights,
        stored_weights=(0.0 if cast_on_use else trained_weights) + frozen,  # kept between steps
        host_compute=(
            (trained_weights if (with_params or (shared and plan.offloads)) else 0.0)
            + (frozen if with_params else 0.0)
        ),
    )


def _memory_estimate(
    plan: ZeroPlan,
    states: _StateBytes,
    *,
    name: str,
    params: float,
    resident: float,
    per_process: int,
    activation_bytes: float,
    remat: str | None,
) -> MemoryEstimate:
    """``states`` placed on the device and the host as ``plan`` keeps them, during forward and
    backward, during the update and between steps."""
    s, offloaded = states, plan.offloads
    # Weights kept on the host come in for forward/backward, the streamed layers one at a time.
    streamed = plan.offloads_params and s.host_compute > 0 and params > 0
    forward = s.compute * resident / params if streamed else s.compute
    device = ModelStates(
        compute_weights=forward,
        gradients=s.grads,
        master=0.0 if offloaded else s.master,
        optimizer=0.0 if offloaded else s.opt,
    )
    if not plan.updates_on_host:
        update = (
            s.compute + s.grads + s.master + s.opt
        )  # new compute weights are made on the device
    else:
        # The update runs on the host; compute weights stored there stay there.
        update = s.compute - s.host_compute + s.grads
    between = s.stored_weights - s.host_compute + (0.0 if offloaded else s.master + s.opt)
    host = ModelStates(
        compute_weights=s.host_compute * per_process,
        master=(s.master if offloaded else 0.0) * per_process,
        optimizer=(s.opt if offloaded else 0.0) * per_process,
    )
    return MemoryEstimate(
        num_params=int(params),
        num_devices=plan.data_size,
        stage=plan.stage,
        offload=plan.offload,
        update_on=plan.update_on,
        precision=name,
        device=device,
        host=host,
        update_bytes=update,
        between_steps_bytes=between,
        activation_bytes=activation_bytes,
        remat=remat,
    )


# --------------------------------------------------------------------------- activations
def activations(
    model, *, micro_batch: int, remat: str | None = None, precision: Any = "bf16"
) -> float:
    """Saved activations of the GPT model per device for one micro-batch of ``micro_batch``
    sequences, under ``remat`` (default ``model.remat``). The formula is in docs/memory.md."""
    remat = model.remat if remat is None else remat
    if remat not in REMATS:
        raise ValueError(f"unknown remat policy {remat!r}; choose one of {list(REMATS)}")
    _check_int("micro_batch", micro_batch, 1)
    width = DTYPE_BYTES[_precision_name(precision)]
    b, s, h, f, v = micro_batch, model.seq_len, model.embed_dim, model.mlp_dim, model.vocab_size
    heads = model.num_heads
    head = model.head_dim or h // heads
    kv = (model.num_kv_heads or heads) * head
    q = heads * head
    swiglu = model.mlp_activation in GATED
    tokens = b * s
    # The tiled MLP (model.mlp_chunk) holds one chunk's intermediates at a time.
    mlp_tokens = b * min(model.mlp_chunk, s) if model.mlp_chunk else tokens
    # Everything one block keeps for its backward pass when nothing is recomputed:
    # two norm inputs + two norm outputs (4h), q/k/v (q + 2kv), attention output (q),
    # MLP up/gate/hidden (3f swiglu, 2f gelu); scores: fp32 softmax + compute-dtype probs,
    # or with a flash kernel (cudnn, pallas) none of them, only its fp32 softmax statistics.
    flash = getattr(model, "attention", "xla") in ("cudnn", "pallas")
    scores = b * heads * s * (4 if flash else s * (4 + width))
    per_layer_none = (
        width * (tokens * (4 * h + 2 * q + 2 * kv) + mlp_tokens * (3 if swiglu else 2) * f) + scores
    )
    # save_dots keeps the outputs of the weight matmuls (q, k, v, out, up, gate, down) plus
    # the block input; attention scores and norms are recomputed.
    per_layer_dots = width * tokens * (h + q + 2 * kv + h + (2 if swiglu else 1) * f + h)
    per_layer_full = width * tokens * h  # only the block input (the scan carry)
    layers = model.num_layers
    if remat == "none":
        blocks = layers * per_layer_none
    elif remat == "save_dots":
        blocks = layers * per_layer_dots + per_layer_none  # + one block being recomputed
    elif remat == "offload_input":  # the layer inputs are in host memory (offloaded_activations)
        blocks = per_layer_none
    else:  # full, and offload_dots: its matmul outputs are in host memory (offloaded_activations)
        blocks = layers * per_layer_full + per_layer_none
    # Embedding output, final norm in/out, and the loss: the fp32 logits and their softmax, or
    # with the chunked cross-entropy (model.loss_chunk) one tile of each and the fp32 gradient
    # of the output projection it accumulates.
    if model.loss_chunk:
        tile = b * min(model.loss_chunk, s) * min(model.loss_vocab_chunk, v)
        loss_bytes = 2 * 4 * tile + 4 * v * h
    else:
        loss_bytes = 2 * 4 * tokens * v
    return float(blocks + width * tokens * 3 * h + loss_bytes)


def offloaded_activations(
    model, *, micro_batch: int, remat: str | None = None, precision: Any = "bf16"
) -> float:
    """Activations an offloading remat keeps in pinned host memory per device for one
    micro-batch: for 'offload_dots' save_dots's matmul outputs, the block input aside; for
    'offload_input' each block's input (0 for other policies)."""
    remat = model.remat if remat is None else remat
    if remat == "offload_input":
        return float(
            model.num_layers
            * DTYPE_BYTES[_precision_name(precision)]
            * micro_batch
            * model.seq_len
            * model.embed_dim
        )
    if remat != "offload_dots":
        return 0.0
    saved = activations(model, micro_batch=micro_batch, remat="save_dots", precision=precision)
    device = activations(model, micro_batch=micro_batch, remat="full", precision=precision)
    return float(saved - device)


def _gpt_param_counts(model) -> tuple[int, int]:
    """``(parameters per scanned block, parameters outside the blocks)`` of the GPT model."""
    h, f, v = model.embed_dim, model.mlp_dim, model.vocab_size
    head = model.head_dim or h // model.num_heads
    q = model.num_heads * head
    kv = (model.num_kv_heads or model.num_heads) * head
    projections = 3 if model.mlp_activation in GATED else 2
    mlp = projections * h * f
    norms = 2 * h * (2 if model.norm == "layernorm" else 1)
    norms += 2 * h * model.post_norms + 2 * head * model.qk_norm  # Gemma's post-norms, qk-norm
    # Biases (Qwen2's q/k/v, GPT-2's everywhere) and GPT-2's learned positions.
    biases = (q + 2 * kv) if model.attn_bias in ("qkv", "all") else 0
    biases += h if model.attn_bias == "all" else 0
    if model.mlp_bias:
        biases += (projections - 1) * f + h
    block = h * (2 * q + 2 * kv) + mlp + norms + biases
    final = h * (2 if model.norm == "layernorm" else 1)
    head_params = 0 if model.tie_embeddings else h * v
    positions = 0
    if model.positions == "learned":
        positions = (model.max_positions or model.seq_len) * h
    return block, v * h + final + head_params + positions


Shapes = list[tuple[int, ...]]


def _gpt_param_shapes(model) -> Shapes:
    """The shapes of the GPT model's parameters (the scanned blocks' with their leading layers
    axis), the same parameters ``_gpt_param_counts`` counts: what blockwise optimizer state
    depends on (the last axis and each tensor's size)."""
    block, rest = _gpt_stack_and_rest_shapes(model)
    return block + rest


def _gpt_stack_and_rest_shapes(model) -> tuple[Shapes, Shapes]:
    """``_gpt_param_shapes`` in two: the scanned blocks' (leading layers axis) and the rest."""
    h, f, v, layers = model.embed_dim, model.mlp_dim, model.vocab_size, model.num_layers
    head = model.head_dim or h // model.num_heads
    heads, kv = model.num_heads, model.num_kv_heads or model.num_heads
    projections = 3 if model.mlp_activation in GATED else 2
    norm: Shapes = [(h,)] * (2 if model.norm == "layernorm" else 1)  # scale (and bias)
    block: Shapes = [(h, heads, head), (h, kv, head), (h, kv, head), (heads, head, h)]
    block += [(h, f)] * (projections - 1) + [(f, h)] + norm * 2
    if model.attn_bias in ("qkv", "all"):
        block += [(heads, head), (kv, head), (kv, head)]
    if model.attn_bias == "all":
        block += [(h,)]
    if model.mlp_bias:
        block += [(f,)] * (projections - 1) + [(h,)]
    rest: Shapes = [(v, h)] + norm + ([] if model.tie_embeddings else [(h, v)])
    if model.positions == "learned":
        rest += [(model.max_positions or model.seq_len, h)]
    return [(layers, *shape) for shape in block], rest


def optimizer_bytes_per_param(model, optimizer: str) -> float:
    """Optimizer-state bytes per parameter of the GPT model under ``optimizer``
    (``train.optimizer``): 8 for fp32 AdamW, 4 for bf16 moments; for 8-bit moments counted
    tensor by tensor with ``adamw_8bit``'s defaults (its block size along the last axis, fp32
    moments below ``MIN_8BIT_SIZE`` entries)."""
    shapes = _gpt_param_shapes(model)
    total = sum(moment_bytes(optimizer, shape) for shape in shapes)
    return total / sum(math.prod(shape) for shape in shapes)


def stored_frozen_bytes_per_param(model, precision: str) -> float:
    """Bytes per frozen parameter of the GPT model stored as the trainer stores it: in the
    compute dtype ``precision``, or, with LoRA and ``model.lora.quantize`` nf4 / int8, its
    matrices packed as ``zf.quantize_frozen`` packs them (the layer stack one layer's tensor at
    a time), its vectors in the compute dtype. Counted tensor by tensor from the layout, since
    each tensor's scales and padding add to its bytes."""
    width = DTYPE_BYTES[_precision_name(precision)]
    kind = model.lora.quantize
    if model.lora.rank == 0 or kind == "none":
        return float(width)
    stack, rest = _gpt_stack_and_rest_shapes(model)
    total = params = 0
    for shapes, stack_axes in ((stack, 1), (rest, 0)):
        for shape in shapes:
            size = math.prod(shape)
            packed = quantized_bytes(shape, kind, stack_axes)
            total += width * size if packed is None else packed
            params += size
    return total / params


def count_gpt_params(model) -> int:
    """Parameter count of the GPT model from its config, without building it."""
    block, rest = _gpt_param_counts(model)
    return model.num_layers * block + rest


LAYERS_IN_FLIGHT = 2
"Streamed layers on the device at once: the one running and the next one being copied in."


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
) -> MemoryEstimate:
    """Estimate for a trainer ``zeroflow.config.Config``; keyword arguments override its
    ``parallel.*`` / ``model.remat`` choices. Gradients are counted in fp32 (4 bytes), as
    zeroflow's engine reduces them, activations per micro-batch are included, and the
    optimizer state is ``train.optimizer``'s (``optimizer_bytes_per_param``).
    ``frozen_params``: how many of the GPT's parameters ``train.freeze`` (or LoRA) freezes
    (``zeroflow.trainer.planning.count_frozen_params``), stored as ``model.lora.quantize``
    says (``stored_frozen_bytes_per_param``)."""
    par = cfg.parallel
    n = num_devices if num_devices is not None else (par.data if par.data > 0 else None)
    if n is None:
        raise ValueError("parallel.data is -1 (all devices); pass num_devices")
    offload = par.offload if offload is None else offload
    update_on = (
        (par.update_on if update_on is None else update_on) if offload != "none" else "device"
    )
    micro = cfg.train.batch_size // (n * par.grad_accum)
    if micro < 1:
        raise ValueError(
            f"train.batch_size {cfg.train.batch_size} is smaller than data devices "
            f"{n} x grad_accum {par.grad_accum}"
        )
    remat = cfg.model.remat if remat is None else remat
    acts = activations(cfg.model, micro_batch=micro, remat=remat, precision=cfg.precision.params)
    model_parallel = max(par.model, 1)
    # Tensor parallelism splits the weights it covers over `model` too; treat all as split.
    # optimizer+params streams the scanned blocks in one at a time (the trainer's train step
    # and evaluation both do); everything outside them comes in whole.
    block, rest = _gpt_param_counts(cfg.model)
    resident = rest + min(LAYERS_IN_FLIGHT, cfg.model.num_layers) * block
    return estimate(
        num_params=math.ceil(count_gpt_params(cfg.model) / model_parallel),
        resident_params=math.ceil(resident / model_parallel),
        num_devices=n,
        stage=par.zero_stage if stage is None else stage,
        offload=offload,
        update_on=update_on,
        precision=cfg.precision.params,
        devices_per_process=devices_per_process,
        gradient_bytes=4,
        activation_bytes=acts,
        remat=remat,
        optimizer_bytes=optimizer_bytes_per_param(cfg.model, cfg.train.optimizer),
        frozen_params=math.ceil(frozen_params / model_parallel),
        frozen_bytes_per_param=stored_frozen_bytes_per_param(cfg.model, cfg.precision.params),
    )


def hierarchical_copy_bytes(
    *, num_params: int, num_devices: int, hosts: int, precision: Any = "bf16"
) -> float:
    """Per-device bytes that ZeRO++ hpZ adds at stage 3 on ``hosts`` hosts of
    ``num_devices / hosts`` devices: its compute-weight copy, split over a host's L devices
    (``width x P / L``), where plain stage 3 keeps no compute copy (each use casts the master's
    shard as it gathers it, ``ZeroPlan.keeps_compute_copy``); the master, gradients and
    optimizer state do not change (``zf.memory.state_bytes`` of the state reads it from its
    shapes)."""
    n = _check_int("num_devices", num_devices, 1)
    h = _check_int("hosts", hosts, 1)
    if n % h:
        raise ValueError(f"hosts={h} must divide num_devices={n}")
    width = DTYPE_BYTES[_precision_name(precision)]
    return width * float(num_params) * h / n
