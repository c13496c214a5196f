"""The values each layer's settings accept, and the checks of the precision settings: plain
Python, no jax.

The config (``zeroflow.config``) validates a run against these before anything imports jax,
so that a mistyped key or value is reported at once; the layers that act on the settings
(``autocast.precision``, ``optim.adam``, ``engine.plan``, ``engine.quantized``) read their own
names from here, so there is one spelling of each.
"""

from __future__ import annotations

import math
import numbers
from typing import Any

# --- precision (zeroflow.autocast.precision) -----------------------------------------------------

DTYPE_NAMES = ("fp32", "bf16", "fp16")
"The compute dtypes by name (``Precision.params``, ``Precision.reduce``)."
MASTER_DTYPES = ("fp32",)
AUTOCAST = ("none", "bf16", "fp16", "fp8")
FP8_SCALINGS = ("tensor", "row", "delayed")
"""How autocast='fp8' scales its operands: one scale per tensor or per row from the tensor being
cast (current scaling), or per tensor from an amax history carried between steps (delayed)."""
FP8_HISTORY = 1024
"Steps of amax history per tensor under delayed scaling: Transformer Engine's and Flax's default."
FP8_SELECT = ("cost", "all")
"How autocast='fp8' picks its FP8 matmuls: the roofline model, or every eligible one."

# --- optimizers (zeroflow.optim) -----------------------------------------------------------------

ADAMW_CHOICES = ("adamw", "adamw_8bit", "adamw_bf16")

# --- ZeRO plan and frozen weights (zeroflow.engine) ----------------------------------------------

ZERO_STAGES = (0, 1, 2, 3)
OFFLOAD_CHOICES = ("none", "optimizer", "optimizer+params")
UPDATE_ON_CHOICES = ("device", "host")
QUANTIZE_WEIGHTS_CHOICES = (None, "int8", "fp8")
QUANTIZE_GRADS_CHOICES = (None, "int8")
QUANTIZE_KINDS = ("nf4", "int8")
"How ``quantize_frozen`` stores frozen weights."

# --- activation memory (the model's remat, which zeroflow.memory estimates) ----------------------

REMATS = ("none", "full", "save_dots", "offload_dots", "offload_input")
REMAT_DTYPES = ("compute", "fp8")
"What a remat policy keeps its saved activations in: the compute dtype, or e4m3 with scales."
FP8_DOTS_REMATS = ("save_dots", "offload_dots")
"Remat policies whose saved matmul outputs model.remat_dtype='fp8' keeps in e4m3."
FP8_INPUT_REMATS = ("full", "offload_input")
"Remat policies whose saved layer inputs model.remat_dtype='fp8' keeps in e4m3."
FP8_REMATS = FP8_DOTS_REMATS + FP8_INPUT_REMATS
"The remat policies model.remat_dtype='fp8' applies to (all that save something)."

# --- the planner's search (zeroflow.planner.search) ----------------------------------------------

MAX_FAILED_COMPILES = 3
"Failed compiles after which the planner ends a row (they do not count against max_compiles)."


def is_number(value: Any) -> bool:
    """A real number, not a bool."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


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
    elif not is_number(value):
        raise ValueError(
            f"loss_scale must be 'none', 'dynamic' or a positive number, got {value!r}"
        )
    if not (value > 0 and math.isfinite(value)):
        raise ValueError(f"a static loss_scale must be a positive finite number, got {value!r}")
    return value


def check_precision(
    params: str,
    master: str,
    loss_scale: Any,
    init_scale: float,
    growth_interval: int,
    min_scale: float,
    max_consecutive_skips: int,
    autocast: str,
    reduce: str,
    fp8_scaling: str = "tensor",
    fp8_select: str = "cost",
    fp8_history: int = FP8_HISTORY,
    fp8_margin: int = 0,
) -> str | float:
    """Raise ValueError (one line) for a precision that cannot run; return the parsed
    ``loss_scale``. ``Precision`` runs it when made, the config before jax starts; its
    arguments are ``Precision``'s fields, which the config's ``precision`` section repeats."""
    if not isinstance(params, str) or params not in DTYPE_NAMES:
        raise ValueError(f"unknown params dtype {params!r}; choose one of {sorted(DTYPE_NAMES)}")
    if master not in MASTER_DTYPES:
        raise ValueError(f"unknown master dtype {master!r}; master weights are 'fp32'")
    parsed = parse_loss_scale(loss_scale)
    _check_scaling(init_scale, growth_interval, min_scale, max_consecutive_skips)
    _check_autocast(autocast, params, scaled=parsed != "none")
    if autocast == "fp8":
        check_fp8(fp8_scaling, fp8_select, params)
    elif fp8_scaling == "delayed":
        raise ValueError(
            f"fp8_scaling='delayed' scales FP8 matmuls, and autocast={autocast!r} has none; "
            "set autocast='fp8' or drop fp8_scaling"
        )
    check_fp8_history(fp8_history, fp8_margin)
    if not isinstance(reduce, str) or reduce not in ("fp32", params):
        raise ValueError(
            f"unknown reduce dtype {reduce!r}; gradients are summed in 'fp32' "
            f"or the compute dtype (params={params!r})"
        )
    return parsed


def _check_scaling(init_scale, growth_interval, min_scale, max_consecutive_skips) -> None:
    for name, value in (("init_scale", init_scale), ("min_scale", min_scale)):
        if not is_number(value) or not (value > 0 and math.isfinite(value)):
            raise ValueError(f"{name} must be a positive finite number, got {value!r}")
    counts = (
        ("growth_interval", growth_interval),
        ("max_consecutive_skips", max_consecutive_skips),
    )
    for name, value in counts:
        if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    if min_scale > init_scale:
        raise ValueError(f"min_scale ({min_scale:g}) must not exceed init_scale ({init_scale:g})")


def _check_autocast(autocast: str, params: str, *, scaled: bool) -> None:
    if not isinstance(autocast, str) or autocast not in AUTOCAST:
        raise ValueError(f"unknown autocast {autocast!r}; choose one of {list(AUTOCAST)}")
    if autocast in ("none", "fp8"):
        return
    if params not in ("fp32", autocast):
        raise ValueError(
            f"autocast={autocast!r} with params={params!r} mixes two half "
            f"types; use params='fp32' or params={autocast!r}"
        )
    if autocast == "fp16" and not scaled:
        raise ValueError(
            "autocast='fp16' needs loss scaling (gradients below 6e-8 flush to zero "
            "in fp16); set loss_scale='dynamic' or a number"
        )


def check_fp8_scaling(scaling: Any, where: str = "fp8 scaling") -> str:
    """``scaling`` if it names an FP8 scaling recipe, else ValueError naming ``where``."""
    if scaling not in FP8_SCALINGS:
        raise ValueError(
            f"{where}: unknown scaling {scaling!r}; choose one of {list(FP8_SCALINGS)}"
        )
    return scaling


def check_fp8(fp8_scaling: Any, fp8_select: Any, params: str) -> None:
    """autocast='fp8''s own settings: a known scaling and selection, around fp32 or bf16."""
    check_fp8_scaling(fp8_scaling, "fp8_scaling")
    if fp8_select not in FP8_SELECT:
        raise ValueError(f"unknown fp8_select {fp8_select!r}; choose one of {list(FP8_SELECT)}")
    if params not in ("fp32", "bf16"):
        raise ValueError(
            f"autocast='fp8' runs around bf16, not params={params!r}; "
            "use params='fp32' or params='bf16'"
        )


def check_fp8_history(history: Any, margin: Any, where: str = "") -> None:
    """Delayed scaling's window (at least 1 step) and margin (a power of two, at least 0)."""
    for name, value, least in (("fp8_history", history, 1), ("fp8_margin", margin, 0)):
        if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < least:
            raise ValueError(f"{where}{name} must be an int >= {least}, got {value!r}")
