"""Which jax primitives start in half precision, which stay fp32, which follow their inputs.

The lists map PAI's allow list and the PyTorch / TensorFlow autocast lists onto jax primitives:

- ``ALLOW``: ops that gain from half precision (tensor cores). They start low, subject to the
  bytes cost model (``cost.py``).
- ``FP32``: ops whose result loses too much in half precision: exponentials and logarithms,
  powers and roots, and every accumulation (sums, products, cumulative sums, the all-reduce).
  Their inputs are cast up to fp32 and their results marked *sensitive*: downstream arithmetic
  that mixes a sensitive fp32 value with a half one runs in fp32 (softmax, normalisation).
- ``FOLLOW``: arithmetic that runs in whatever precision its inputs have; one half input
  makes the op half (PAI's propagation), unless a sensitive fp32 input is present, or unless
  every use of the result ends in an ``FP32`` op (then it runs fp32, e.g. ``x * x`` under a
  variance, which overflows fp16).
- ``NEUTRAL``: data movement and exact selections (reshape, gather, max, comparisons): never
  cast on their own, their result has their input's dtype.
- ``OPERAND_LED``: updates into an existing buffer (``dynamic_update_slice``, ``scatter``,
  ``pad``): the update is cast to the buffer's dtype, never the other way round.
- ``PASSTHROUGH``: several independent operands, each passed through in its own dtype.

Anything else keeps the dtypes the program declared (its inputs are cast back to them): random
numbers, linear algebra, FFTs, bit casts, ``custom_jvp``/``custom_vjp`` calls and
``pallas_call`` (unless a policy opts them in), and primitives we do not know.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

ALLOW = frozenset({"dot_general", "conv_general_dilated"})

FP32 = frozenset(
    {
        # exponentials, logarithms, powers, roots
        "exp",
        "exp2",
        "expm1",
        "log",
        "log1p",
        "pow",
        "sqrt",
        "rsqrt",
        "cbrt",
        # special functions with large dynamic range
        "erf_inv",
        "lgamma",
        "digamma",
        "polygamma",
        "zeta",
        "igamma",
        "igammac",
        "igamma_grad_a",
        "regularized_incomplete_beta",
        "bessel_i0e",
        "bessel_i1e",
        "tan",
        "sinh",
        "cosh",
        "asin",
        "acos",
        "asinh",
        "acosh",
        "atanh",
        # accumulations
        "reduce_sum",
        "reduce_prod",
        "cumsum",
        "cumprod",
        "cumlogsumexp",
        "reduce_window_sum",
        "scatter-add",
        "scatter-mul",
        "psum",
        "psum_invariant",
        "reduce_scatter",
    }
)

FOLLOW = frozenset(
    {
        "add",
        "add_any",
        "sub",
        "mul",
        "div",
        "neg",
        "abs",
        "sign",
        "max",
        "min",
        "rem",
        "integer_pow",
        "square",
        "tanh",
        "logistic",
        "erf",
        "erfc",
        "sin",
        "cos",
        "atan",
        "atan2",
        "round",
        "floor",
        "ceil",
        "clamp",
        "select_n",
        "concatenate",
    }
)

NEUTRAL = frozenset(
    {
        "reshape",
        "transpose",
        "broadcast_in_dim",
        "squeeze",
        "expand_dims",
        "slice",
        "dynamic_slice",
        "gather",
        "rev",
        "copy",
        "copy_p",
        "reduce_max",
        "reduce_min",
        "argmax",
        "argmin",
        "cummax",
        "cummin",
        "reduce_window_max",
        "reduce_window_min",
        "top_k",
        "stop_gradient",
        "sharding_constraint",
        "mesh_cast",
        "reshard",
        "pvary",
        "pcast",
        "all_gather",
        "all_gather_invariant",
        "all_to_all",
        "ppermute",
        "pmax",
        "pmin",
        "split",
        "is_finite",
        "eq",
        "ne",
        "lt",
        "le",
        "gt",
        "ge",
    }
)
COMPARISONS = frozenset({"eq", "ne", "lt", "le", "gt", "ge"})
"Neutral ops that compare two operands: mixed dtypes compare in the wider one (exactly)."

OPERAND_LED = frozenset({"dynamic_update_slice", "scatter", "pad", "scatter-max", "scatter-min"})

PASSTHROUGH = frozenset({"optimization_barrier", "device_put", "sort"})

UNSCALE_SCOPE = "zeroflow_unscale"
"Name scope marking gradient unscaling: it and everything computed from it stays fp32."

DTYPES = {"bf16": jnp.bfloat16, "fp16": jnp.float16}
FP8 = "fp8"
"The mode name for FP8 matmuls: the program runs as under bf16, large matmuls in FP8."
_ALIASES = {"bfloat16": "bf16", "float16": "fp16", "half": "fp16", "float8": FP8}


def parse_mode(dtype) -> tuple[np.dtype, bool]:
    """``(half dtype, fp8)``: ``"fp8"`` is bf16 with FP8 matmuls (``fp8.py``)."""
    if isinstance(dtype, str) and _ALIASES.get(dtype, dtype) == FP8:
        return np.dtype(jnp.bfloat16), True
    return parse_dtype(dtype), False


def parse_dtype(dtype) -> np.dtype:
    """``"bf16"`` / ``"fp16"`` (or the numpy dtypes) -> the half dtype; anything else fails."""
    name = dtype if isinstance(dtype, str) else None
    if name is None:
        try:
            name = np.dtype(dtype).name
        except TypeError:
            name = repr(dtype)
    name = _ALIASES.get(name, name)
    if name not in DTYPES:
        raise ValueError(f"autocast dtype must be one of {sorted([*DTYPES, FP8])}, got {dtype!r}")
    return np.dtype(DTYPES[name])


def known_primitive_names() -> frozenset[str]:
    """Names a policy may mention: our lists, jax's public primitives and the higher-order ones."""
    import jax.extend.core.primitives as prims

    public = {
        getattr(prims, a).name
        for a in dir(prims)
        if a.endswith("_p") and hasattr(getattr(prims, a), "name")
    }
    structural = {
        "scan",
        "while",
        "cond",
        "remat2",
        "checkpoint",
        "jit",
        "pjit",
        "closed_call",
        "core_call",
        "shard_map",
        "custom_jvp_call",
        "custom_vjp_call",
        "pallas_call",
    }
    return frozenset(
        public | structural | ALLOW | FP32 | FOLLOW | NEUTRAL | OPERAND_LED | PASSTHROUGH
    )
