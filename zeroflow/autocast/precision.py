"""Precision as one value: compute dtype, master dtype and the loss-scaling policy."""

from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Any

import jax
import jax.numpy as jnp
from flax import struct

from zeroflow.autocast import fp8
from zeroflow.autocast.policy import AutocastPolicy

DTYPES = {"fp32": jnp.float32, "bf16": jnp.bfloat16, "fp16": jnp.float16}
MASTER_DTYPES = ("fp32",)
AUTOCAST = ("none", "bf16", "fp16", "fp8")
FP8_SELECT = ("cost", "all")
"How autocast='fp8' picks its FP8 matmuls: the roofline model, or every eligible one."


def parse_loss_scale(value: Any) -> str | float:
    """``"none"``, ``"dynamic"`` or a positive finite number (also given as text, as YAML and
    the command line give it) -> that value, a number as float; anything else -> ValueError.
    The one parser of loss-scale settings: ``Precision`` and the config validation use it."""
    if isinstance(value, str):
        if value in ("none", "dynamic"):
            return value
        try:
            value = float(value)
        except ValueError:
            raise ValueError(
                f"loss_scale must be 'none', 'dynamic' or a positive number, got {value!r}"
            ) from None
    elif not _is_number(value):
        raise ValueError(
            f"loss_scale must be 'none', 'dynamic' or a positive number, got {value!r}"
        )
    if not (value > 0 and math.isfinite(value)):
        raise ValueError(f"a static loss_scale must be a positive finite number, got {value!r}")
    return value


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
    ``autocast``: "none", or "bf16" / "fp16" to run the loss under ``zf.autocast``."""

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

    @classmethod
    def from_config(cls, section) -> Precision:
        """From the config's ``precision`` section (``zeroflow.config.PrecisionConfig``), whose
        fields carry the same names: a field only one side has fails here, not silently."""
        return cls(**dataclasses.asdict(section))

    def __post_init__(self):
        if not isinstance(self.params, str) or self.params not in DTYPES:
            raise ValueError(
                f"unknown params dtype {self.params!r}; choose one of {sorted(DTYPES)}"
            )
        if self.master not in MASTER_DTYPES:
            raise ValueError(f"unknown master dtype {self.master!r}; master weights are 'fp32'")
        object.__setattr__(self, "loss_scale", parse_loss_scale(self.loss_scale))
        self._check_scaling_fields()
        self._check_autocast()
        if not isinstance(self.reduce, str) or self.reduce not in ("fp32", self.params):
            raise ValueError(
                f"unknown reduce dtype {self.reduce!r}; gradients are summed in 'fp32' "
                f"or the compute dtype (params={self.params!r})"
            )

    def _check_scaling_fields(self):
        for name in ("init_scale", "min_scale"):
            value = getattr(self, name)
            if not _is_number(value) or not (value > 0 and math.isfinite(value)):
                raise ValueError(f"{name} must be a positive finite number, got {value!r}")
        for name in ("growth_interval", "max_consecutive_skips"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if self.min_scale > self.init_scale:
            raise ValueError(
                f"min_scale ({self.min_scale:g}) must not exceed init_scale ({self.init_scale:g})"
            )

    def _check_autocast(self):
        if not isinstance(self.autocast, str) or self.autocast not in AUTOCAST:
            raise ValueError(f"unknown autocast {self.autocast!r}; choose one of {list(AUTOCAST)}")
        if self.autocast == "none":
            return
        if self.autocast == "fp8":
            self._check_fp8()
            return
        if self.params not in ("fp32", self.autocast):
            raise ValueError(
                f"autocast={self.autocast!r} with params={self.params!r} mixes two half "
                f"types; use params='fp32' or params={self.autocast!r}"
            )
        if self.autocast == "fp16" and not self.scaled:
            raise ValueError(
                "autocast='fp16' needs loss scaling (gradients below 6e-8 flush to zero "
                "in fp16); set loss_scale='dynamic' or a number"
            )

    def _check_fp8(self):
        fp8.check_scaling(self.fp8_scaling, "fp8_scaling")
        if self.fp8_select not in FP8_SELECT:
            raise ValueError(
                f"unknown fp8_select {self.fp8_select!r}; choose one of {list(FP8_SELECT)}"
            )
        if self.params not in ("fp32", "bf16"):
            raise ValueError(
                f"autocast='fp8' runs around bf16, not params={self.params!r}; "
                "use params='fp32' or params='bf16'"
            )

    def autocast_policy(self) -> AutocastPolicy:
        """The policy ``make_train_step`` runs the loss under (the FP8 choices)."""
        return AutocastPolicy(
            fp8_scaling=self.fp8_scaling, fp8_cost_model=self.fp8_select == "cost"
        )

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


def _is_number(value) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)
