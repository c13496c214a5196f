"""Analytic memory per device (and per host process) for ZeRO stages, offload and remat.

Model states follow the ZeRO paper's accounting (Rajbhandari et al. 2020, section 3.1): with
mixed-precision Adam every parameter costs 2 bytes of compute weights, 2 of gradients and
K = 12 of fp32 master weights + two moments; stage 1 divides the 12 by the N data-parallel
devices, stage 2 also the gradients, stage 3 also the compute weights. fp32 training, frozen
parameters, quantized bases and offload are in docs/memory.md ("Model states"). A run's
parameters as the model makes them (``zeroflow.memory.spec.RunSpec``) give these counts.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from zeroflow.autocast.precision import DTYPES
from zeroflow.backend.mesh import planning_mesh
from zeroflow.engine.plan import OFFLOAD_CHOICES, UPDATE_ON_CHOICES, ZERO_STAGES, ZeroPlan
from zeroflow.engine.plan_rules import host_update_problem

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


def precision_name(precision: Any) -> str:
    """The compute dtype's name of a ``zf.Precision`` or of its params string."""
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
    8 for Adam, 4 with bf16 moments, ~2 with 8-bit ones (``RunSpec.optimizer_bytes_per_param``).
    ``activation_bytes``: per device and micro-batch (``zeroflow.models.spec.activations``).
    ``resident_params``: with ``offload="optimizer+params"``, how many parameters' compute
    weights are on the device at once during forward/backward when the layer stack is
    streamed in one layer at a time (default: all, as when nothing is streamed).
    ``frozen_params``: how many of the ``num_params`` are frozen: stored once in the compute
    dtype (beside the compute weights, offloaded with them), nothing else.
    ``frozen_bytes_per_param``: bytes each frozen parameter is stored in, where not the
    compute dtype's (a quantized base: ``RunSpec.frozen_bytes_per_param``).
    """
    n = _check_inputs(num_params, num_devices, stage, offload, update_on, activation_bytes)
    name = precision_name(precision)
    p, width = float(num_params), DTYPE_BYTES[name]
    if isinstance(frozen_params, bool) or not (
        isinstance(frozen_params, (int, float)) and 0 <= frozen_params <= p
    ):
        raise ValueError(
            f"frozen_params must be a number in [0, num_params={num_params}], got {frozen_params!r}"
        )
    frozen_width = float(width if frozen_bytes_per_param is None else frozen_bytes_per_param)
    if not frozen_width > 0:
        raise ValueError(f"frozen_bytes_per_param must be > 0, got {frozen_bytes_per_param!r}")
    return _memory_estimate(
        # The plan's own reading of the choices (a planning mesh: nothing but the sizes counts).
        ZeroPlan(planning_mesh(n), stage=stage, offload=offload, update_on=update_on),
        name,
        p,
        float(frozen_params),
        grad_width=width
        if gradient_bytes is None
        else _check_int("gradient_bytes", gradient_bytes, 1),
        optimizer_bytes=optimizer_bytes,
        frozen_width=frozen_width,
        resident=p
        if resident_params is None
        else min(float(_check_int("resident_params", resident_params, 0)), p),
        per_process=min(n, 8)
        if devices_per_process is None
        else _check_int("devices_per_process", devices_per_process, 1),
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


def _memory_estimate(
    plan: ZeroPlan,
    name: str,
    p: float,
    f: float,
    *,
    grad_width,
    optimizer_bytes,
    frozen_width,
    resident: float,
    per_process: int,
    activation_bytes: float,
    remat: str | None,
) -> MemoryEstimate:
    """The ZeRO paper's accounting of ``p`` parameters (``f`` of them frozen, ``frozen_width``
    bytes each) in precision ``name``, placed on the device and the host as ``plan`` keeps them:
    during forward and backward, during the update and between steps."""
    n, width, trained, offloaded = plan.data_size, DTYPE_BYTES[name], p - f, plan.offloads
    split = lambda sharded: 1.0 / n if sharded else 1.0  # noqa: E731
    # Frozen: stored as used (a quantized one dequantized inside the step, a layer at a time).
    frozen = frozen_width * f * split(plan.shards_compute)
    compute = width * trained * split(plan.shards_compute) + frozen  # during forward/backward
    # fp32: one copy serves compute and optimizer. Where storage and compute layouts agree
    # (stages 0 and 3) that copy is the master itself; at stages 1 and 2 the compute copy is
    # gathered from the sharded master for each step and dropped after it.
    shared = name == "fp32" and plan.shards_storage == plan.shards_compute
    master = 0.0 if shared else 4 * trained * split(plan.shards_storage)
    grads = grad_width * trained * split(plan.shards_grads)
    opt = optimizer_bytes * trained * split(plan.shards_storage)
    trained_weights = 0.0 if name == "fp32" and plan.gathers_whole_weights else compute - frozen
    # zeroflow keeps no compute copy at stage 3 (ZeroPlan.keeps_compute_copy): each use casts
    # the master's shard as it gathers it. The paper's accounting (``device``) keeps its copy.
    cast_on_use = width < 4 and not plan.keeps_compute_copy(DTYPES[name])
    stored = (0.0 if cast_on_use else trained_weights) + frozen  # kept between steps
    with_params = plan.offloads_params
    on_host = (trained_weights if (with_params or (shared and offloaded)) else 0.0) + (
        frozen if with_params else 0.0
    )
    # Weights kept on the host come in for forward/backward, the streamed layers one at a time.
    streamed = with_params and on_host > 0 and p > 0
    return MemoryEstimate(
        num_params=int(p),
        num_devices=n,
        stage=plan.stage,
        offload=plan.offload,
        update_on=plan.update_on,
        precision=name,
        device=ModelStates(
            compute * resident / p if streamed else compute,
            grads,
            0.0 if offloaded else master,
            0.0 if offloaded else opt,
        ),
        host=ModelStates(
            compute_weights=on_host * per_process,
            master=(master if offloaded else 0.0) * per_process,
            optimizer=(opt if offloaded else 0.0) * per_process,
        ),
        # On the device the update makes new compute weights; on the host those stored there
        # stay there.
        update_bytes=compute - on_host + grads
        if plan.updates_on_host
        else compute + grads + master + opt,
        between_steps_bytes=stored - on_host + (0.0 if offloaded else master + opt),
        activation_bytes=activation_bytes,
        remat=remat,
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
    width = DTYPE_BYTES[precision_name(precision)]
    return width * float(num_params) * h / n
