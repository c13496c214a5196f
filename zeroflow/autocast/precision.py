"""Precision as one value: compute dtype, master dtype and the loss-scaling policy."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import struct

from zeroflow.autocast.policy import AutocastPolicy
from zeroflow.util.settings import AUTOCAST as AUTOCAST  # re-exported: the names stay here too
from zeroflow.util.settings import DTYPE_NAMES, FP8_HISTORY, check_precision
from zeroflow.util.settings import FP8_SELECT as FP8_SELECT
from zeroflow.util.settings import MASTER_DTYPES as MASTER_DTYPES
from zeroflow.util.settings import parse_loss_scale as parse_loss_scale

DTYPES = dict(zip(DTYPE_NAMES, (jnp.float32, jnp.bfloat16, jnp.float16), strict=True))


@struct.dataclass
class LossScaleState:
    """Current loss scale, the count of clean steps since it last changed and the count of
    consecutive skipped steps. ``dynamic`` (static): whether the scale adapts; a static scale is
    always the configured one, also after restoring a checkpoint saved with another."""

    scale: jax.Array
    good_steps: jax.Array
    skips: jax.Array
    dynamic: bool = struct.field(pytree_node=False, default=True)


@dataclasses.dataclass(frozen=True)
class Precision:
    """``params``: compute dtype of the weights the forward pass uses; ``master``: dtype of the
    weights the optimizer updates; ``loss_scale``: "none", "dynamic" or a positive float;
    ``autocast``: "none", or "bf16" / "fp16" / "fp8" to run the loss under ``zf.autocast``."""

    params: str = "fp32"
    master: str = "fp32"
    loss_scale: Any = "none"
    init_scale: float = 2.0**15
    "Starting scale for dynamic loss scaling."
    growth_interval: int = 2000
    "Clean steps after which a dynamic scale doubles."
    min_scale: float = 1.0
    "Dynamic scale never halves below this."
    max_consecutive_skips: int = 20
    "Consecutive skipped steps (non-finite gradients) after which the trainer stops."
    autocast: str = "none"
    "Run the loss under zf.autocast in this dtype: 'none', 'bf16', 'fp16' or 'fp8'."
    reduce: str = "fp32"
    "What gradients are summed over devices in: 'fp32' (the exact sum of half-precision"
    " gradients) or the compute dtype (half the bytes on the wire, and half-size transients of"
    " large gradients, as PyTorch FSDP's reduce_dtype and a bf16 GSPMD program; each device's"
    " sum is rounded to that dtype)."
    fp8_scaling: str = "tensor"
    "autocast='fp8': per-'tensor' or per-'row' scales of the e4m3 operands (docs/autocast.md)."
    fp8_select: str = "cost"
    "autocast='fp8': which matmuls run in FP8: 'cost' (the roofline model) or 'all' eligible."
    fp8_history: int = FP8_HISTORY
    "fp8_scaling='delayed': steps of amax history per tensor (the state carries them)."
    fp8_margin: int = 0
    "fp8_scaling='delayed': the scale leaves 2**margin of headroom above the history's max."

    @classmethod
    def from_config(cls, section) -> Precision:
        """From the config's ``precision`` section (``zeroflow.config.PrecisionConfig``), whose
        fields carry the same names: a field only one side has fails here, not silently."""
        return cls(**dataclasses.asdict(section))

    def __post_init__(self):
        # the checks are plain Python (zeroflow.util.settings): the config runs them before jax
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        object.__setattr__(self, "loss_scale", check_precision(**fields))

    def autocast_policy(self) -> AutocastPolicy:
        """The policy ``make_train_step`` runs the loss under (the FP8 choices)."""
        return AutocastPolicy(
            fp8_scaling=self.fp8_scaling,
            fp8_cost_model=self.fp8_select == "cost",
            fp8_history=self.fp8_history,
            fp8_margin=self.fp8_margin,
        )

    @property
    def delayed_fp8(self) -> bool:
        """FP8 matmuls with delayed scaling: the train state carries their amax histories."""
        return self.autocast == "fp8" and self.fp8_scaling == "delayed"

    @property
    def summary(self) -> str:
        """What the forward pass computes in, for the training banner: under autocast that is
        the autocast dtype, not the (fp32) weights'."""
        if self.autocast == "none":
            return self.params
        return f"autocast {self.autocast} (weights {self.params})"

    @property
    def compute_dtype(self):
        return DTYPES[self.params]

    @property
    def reduce_dtype(self):
        return DTYPES[self.reduce]

    @property
    def dynamic(self) -> bool:
        return self.loss_scale == "dynamic"

    @property
    def scaled(self) -> bool:
        return self.loss_scale != "none"

    def init_loss_scale(self) -> LossScaleState | None:
        if not self.scaled:
            return None
        zero = jnp.asarray(0, jnp.int32)
        return LossScaleState(
            scale=jnp.asarray(self.start_scale, jnp.float32),
            good_steps=zero,
            skips=zero,
            dynamic=self.dynamic,
        )

    @property
    def start_scale(self) -> float:
        return self.init_scale if self.dynamic else float(self.loss_scale)

    def step_scale(self, state: LossScaleState | None) -> jax.Array:
        """The scale a step multiplies the loss by: a static one is always the configured one."""
        if state is None:
            return jnp.ones((), jnp.float32)
        return state.scale if self.dynamic else jnp.asarray(float(self.loss_scale), jnp.float32)

    def next_loss_scale(self, state: LossScaleState | None, finite: jax.Array):
        """Halve on a non-finite gradient, double after ``growth_interval`` clean steps; count
        consecutive skipped steps."""
        if state is None:
            return state
        skips = jnp.where(finite, 0, state.skips + 1).astype(jnp.int32)
        if not self.dynamic:
            return LossScaleState(
                scale=self.step_scale(state),
                good_steps=state.good_steps,
                skips=skips,
                dynamic=False,
            )
        good = jnp.where(finite, state.good_steps + 1, 0)
        grow = good >= self.growth_interval
        scale = jnp.where(
            finite,
            jnp.where(grow, state.scale * 2.0, state.scale),
            jnp.maximum(state.scale * 0.5, self.min_scale),
        )
        return LossScaleState(
            scale=scale.astype(jnp.float32),
            good_steps=jnp.where(grow, 0, good).astype(jnp.int32),
            skips=skips,
            dynamic=True,
        )
