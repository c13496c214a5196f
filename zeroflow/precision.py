"""Precision as one value: compute dtype, master dtype and the loss-scaling policy."""
from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import struct

DTYPES = {"fp32": jnp.float32, "bf16": jnp.bfloat16, "fp16": jnp.float16}
AUTOCAST = ("none", "bf16", "fp16")


@struct.dataclass
class LossScaleState:
    """Current loss scale and the count of clean steps since it last changed."""
    scale: jax.Array
    good_steps: jax.Array


@dataclasses.dataclass(frozen=True)
class Precision:
    """``params``: compute dtype of the weights the forward pass uses; ``master``: dtype of the
    weights the optimizer updates; ``loss_scale``: "none", "dynamic" or a positive float;
    ``autocast``: "none", or "bf16" / "fp16" to run the loss under ``zf.autocast``."""
    params: str = "fp32"
    master: str = "fp32"
    loss_scale: Any = "none"
    init_scale: float = 2.0 ** 15
    "Starting scale for dynamic loss scaling."
    growth_interval: int = 2000
    "Clean steps after which a dynamic scale doubles."
    min_scale: float = 1.0
    "Dynamic scale never halves below this."
    autocast: str = "none"
    "Run the loss under zf.autocast in this dtype: 'none', 'bf16' or 'fp16'."

    def __post_init__(self):
        if self.params not in DTYPES:
            raise ValueError(f"unknown params dtype {self.params!r}; choose one of {sorted(DTYPES)}")
        if self.master != "fp32":
            raise ValueError(f"unknown master dtype {self.master!r}; master weights are 'fp32'")
        ls = self.loss_scale
        if isinstance(ls, str):
            if ls not in ("none", "dynamic"):
                try:
                    object.__setattr__(self, "loss_scale", float(ls))
                except ValueError:
                    raise ValueError(
                        f"loss_scale must be 'none', 'dynamic' or a positive number, got {ls!r}") from None
        elif isinstance(ls, bool) or not isinstance(ls, (int, float)):
            raise ValueError(f"loss_scale must be 'none', 'dynamic' or a positive number, got {ls!r}")
        if isinstance(self.loss_scale, (int, float)) and not self.loss_scale > 0:
            raise ValueError(f"a static loss_scale must be positive, got {self.loss_scale!r}")
        if self.growth_interval < 1:
            raise ValueError(f"growth_interval must be >= 1, got {self.growth_interval}")
        self._check_autocast()

    def _check_autocast(self):
        if self.autocast not in AUTOCAST:
            raise ValueError(f"unknown autocast {self.autocast!r}; choose one of {list(AUTOCAST)}")
        if self.autocast == "none":
            return
        if self.params not in ("fp32", self.autocast):
            raise ValueError(f"autocast={self.autocast!r} with params={self.params!r} mixes two half "
                             f"types; use params='fp32' or params={self.autocast!r}")
        if self.autocast == "fp16" and not self.scaled:
            raise ValueError("autocast='fp16' needs loss scaling (gradients below 6e-8 flush to zero "
                             "in fp16); set loss_scale='dynamic' or a number")

    @property
    def compute_dtype(self):
        return DTYPES[self.params]

    @property
    def dynamic(self) -> bool:
        return self.loss_scale == "dynamic"

    @property
    def scaled(self) -> bool:
        return self.loss_scale != "none"

    def init_loss_scale(self) -> LossScaleState | None:
        if not self.scaled:
            return None
        start = self.init_scale if self.dynamic else float(self.loss_scale)
        return LossScaleState(scale=jnp.asarray(start, jnp.float32),
                              good_steps=jnp.asarray(0, jnp.int32))

    def next_loss_scale(self, state: LossScaleState | None, finite: jax.Array):
        """Halve on a non-finite gradient, double after ``growth_interval`` clean steps."""
        if state is None or not self.dynamic:
            return state
        good = jnp.where(finite, state.good_steps + 1, 0)
        grow = good >= self.growth_interval
        scale = jnp.where(finite,
                          jnp.where(grow, state.scale * 2.0, state.scale),
                          jnp.maximum(state.scale * 0.5, self.min_scale))
        return LossScaleState(scale=scale.astype(jnp.float32),
                              good_steps=jnp.where(grow, 0, good).astype(jnp.int32))
