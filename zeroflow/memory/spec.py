"""A training run described once: the model's abstract parameters, the plan, the precision,
the target and the model's FLOPs, read by the ZeRO formula (``RunSpec.model_states``), the
planner and the reports.

The parameters are the model's own (``jax.eval_shape`` of its init: for the trainer's GPT
``zeroflow.models.spec.run_spec``), never a restatement of its shapes: the state bytes below
are counted leaf by leaf from that tree, so a change to the model changes them.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import numpy as np

from zeroflow.backend.accelerators import Accelerator
from zeroflow.engine.quantized import quantized_bytes
from zeroflow.memory.estimate import DTYPE_BYTES, MemoryEstimate, estimate
from zeroflow.optim import moment_bytes

LAYERS_IN_FLIGHT = 2
"Streamed layers on the device at once: the one running and the next one being copied in."


@dataclasses.dataclass(frozen=True)
class RunSpec:
    """One run: what is trained, how it is laid out and where it runs."""

    params: Any
    "Abstract parameters (``ShapeDtypeStruct`` tree) from the model's own init."
    num_devices: int = 1
    "Data-parallel devices (the ZeRO group)."
    stage: int = 0
    offload: str = "none"
    update_on: str = "device"
    remat: str | None = None
    precision: str = "bf16"
    "Compute dtype of the weights ('bf16', 'fp16', 'fp32')."
    optimizer: str | float = "adamw"
    "An optimizer name ``zeroflow.optim.moment_bytes`` knows ('adamw', 'adamw_8bit', ...), or"
    " its state's bytes per parameter where read from the optimizer's own ``init`` (``zf.plan``)."
    layer_stack: str | None = None
    "Top-level key of ``params`` whose leaves stack the layers on their leading axis."
    frozen_params: int = 0
    "How many parameters are frozen (stored once, no gradient, master or moments)."
    quantize: str = "none"
    "How the frozen matrices are stored: 'none' (compute dtype), 'nf4', 'int8'."
    frozen_bytes: float | None = None
    "The frozen leaves' stored bytes where counted from the leaves themselves (``zf.plan``'s"
    " tree, ``zf.quantize_frozen``'s packed); None: as ``quantize`` stores them."
    model_parallel: int = 1
    "Tensor-parallel ways the weights are split over besides the data devices."
    flops_per_token: float = 0.0
    "Training FLOPs per token (forward + backward; the model's own count)."
    tokens_per_step: int = 0
    target: Accelerator | None = None
    "The accelerator's facts (``zeroflow.backend.accelerators``), or None where unknown."

    def _shapes(self) -> tuple[list[tuple[int, ...]], list[tuple[int, ...]]]:
        """The leaves' shapes: ``(stacked layers', the rest)``."""
        if isinstance(self.params, dict) and self.layer_stack in self.params:
            stack = self.params[self.layer_stack]
            rest = {k: v for k, v in self.params.items() if k != self.layer_stack}
        else:
            stack, rest = {}, self.params
        shapes = lambda tree: [tuple(np.shape(x)) for x in jax.tree.leaves(tree)]  # noqa: E731
        return shapes(stack), shapes(rest)

    @property
    def num_params(self) -> int:
        return sum(math.prod(shape) for shape in sum(self._shapes(), []))

    @property
    def resident_params(self) -> int:
        """Parameters on the device at once when the layer stack is streamed in a layer at a
        time (``offload="optimizer+params"``): everything outside it and two layers."""
        stack, rest = self._shapes()
        layers = stack[0][0] if stack else 0
        per_layer = sum(math.prod(s) for s in stack) // layers if layers else 0
        return sum(math.prod(s) for s in rest) + min(LAYERS_IN_FLIGHT, layers) * per_layer

    @property
    def optimizer_bytes_per_param(self) -> float:
        """Optimizer-state bytes per parameter, counted tensor by tensor (8-bit moments keep
        one fp32 scale per block along the last axis, small tensors fp32 moments)."""
        if not isinstance(self.optimizer, str):
            return float(self.optimizer)
        shapes = sum(self._shapes(), [])
        total = sum(moment_bytes(self.optimizer, shape) for shape in shapes)
        return total / max(1, sum(math.prod(shape) for shape in shapes))

    @property
    def frozen_bytes_per_param(self) -> float:
        """Bytes each frozen parameter is stored in: the compute dtype's width, or with a
        quantized base its matrices packed as ``zf.quantize_frozen`` packs them (the layer
        stack a layer's tensor at a time, each tensor's scales and padding included) and its
        vectors in the compute dtype."""
        if self.frozen_bytes is not None and self.frozen_params:
            return self.frozen_bytes / self.frozen_params
        width = DTYPE_BYTES[self.precision]
        if self.quantize == "none":
            return float(width)
        total = params = 0
        for shapes, stack_axes in zip(self._shapes(), (1, 0)):
            for shape in shapes:
                packed = quantized_bytes(shape, self.quantize, stack_axes)
                total += width * math.prod(shape) if packed is None else packed
                params += math.prod(shape)
        return total / max(1, params)

    @property
    def peak_flops(self) -> float | None:
        """The target's dense bf16 peak FLOP/s: what an MFU divides by, FP8 matmuls or not."""
        return None if self.target is None else self.target.bf16_flops

    def per_way(self, count: int) -> int:
        """``count`` parameters' share on one of the ``model_parallel`` tensor-parallel ways."""
        return math.ceil(count / max(self.model_parallel, 1))

    def model_states(
        self, *, activation_bytes: float = 0.0, devices_per_process: int | None = None
    ) -> MemoryEstimate:
        """The ZeRO paper's accounting of this run's parameters (``zf.memory.estimate``),
        gradients in fp32 as zeroflow's engine reduces them, per device of the data group
        (tensor parallelism splits every weight over ``model_parallel`` more)."""
        split = self.per_way
        return estimate(
            num_params=split(self.num_params),
            resident_params=split(self.resident_params),
            num_devices=self.num_devices,
            stage=self.stage,
            offload=self.offload,
            update_on=self.update_on if self.offload != "none" else "device",
            precision=self.precision,
            devices_per_process=devices_per_process,
            gradient_bytes=4,
            activation_bytes=activation_bytes,
            remat=self.remat,
            optimizer_bytes=self.optimizer_bytes_per_param,
            frozen_params=split(self.frozen_params),
            frozen_bytes_per_param=self.frozen_bytes_per_param,
        )
