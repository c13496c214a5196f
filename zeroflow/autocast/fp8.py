"""FP8 matmuls: e4m3 operands in the forward pass, e5m2 gradients in the backward pass.

``scaled_dot(lhs, rhs, dimension_numbers, out_dtype, scaling)`` computes ``dot_general(lhs,
rhs)`` as XLA:GPU's FP8 GEMMs want it (cuBLASLt on Hopper/Ada, or XLA's GEMM fusion): each
operand divided by its scale, clipped to the format's largest finite value and cast to
``float8_e4m3fn``; the product accumulated in fp32 and multiplied by the two scales. A
``custom_vjp`` quantizes the incoming gradient to ``float8_e5m2`` (5 exponent bits: the range
gradients need) and runs both backward products as FP8 GEMMs on the saved e4m3 operands, so the
residuals the backward pass reads are the e4m3 operands and their scales, not bf16 copies.

Scaling ("current" scaling: the scale comes from the tensor being cast, no state):

- ``"tensor"``: one scale per tensor, ``amax(|x|) / max_finite``.
- ``"row"``: the forward pass scales every row of the operands separately (one scale per index
  of the dimensions the matmul keeps, the amax over the contracted ones), so that an outlier
  row does not crush the others; the scales factor out of the sum exactly. The backward
  products contract over other dimensions, so there the saved operands are dequantized and
  cast again with one scale per tensor.

A tensor of zeros gets scale 1. A non-finite element makes its amax non-finite and the result
NaN, so a step with an overflowing gradient is still detected and skipped by loss scaling.
The transposes are Flax's (``flax.linen.fp8_ops``); Flax's own FP8 dot keeps delayed-scaling
state in Flax variables, which an unmodified model does not have.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax.linen import fp8_ops
from jax import lax

from zeroflow.util.settings import check_fp8_scaling

E4M3 = jnp.float8_e4m3fn
E5M2 = jnp.float8_e5m2
check_scaling = check_fp8_scaling  # the scaling names scaled_dot accepts: util.settings


def largest(fmt) -> float:
    return float(jnp.finfo(fmt).max)


def scale_of(x, fmt, axes=None):
    """``amax(|x|) / max_finite(fmt)`` over ``axes`` (all of them: one scale), kept as
    broadcastable dims; 1 where the amax is 0."""
    amax = jnp.max(jnp.abs(x), axis=axes, keepdims=axes is not None).astype(jnp.float32)
    return jnp.where(amax > 0, amax / largest(fmt), jnp.float32(1.0))


def quantize(x, scale, fmt):
    """``x / scale`` clipped to ``fmt``'s finite range, cast to ``fmt`` (NaN stays NaN)."""
    top = largest(fmt)
    return jnp.clip(x.astype(jnp.float32) / scale, -top, top).astype(fmt)


def dequantize(q, scale, dtype):
    return (q.astype(jnp.float32) * scale).astype(dtype)


def _free_dims(ndim: int, contract, batch) -> list[int]:
    return [d for d in range(ndim) if d not in contract and d not in batch]


def _row_scale_in_out_layout(scale, contract, batch, other_free: int, lhs: bool):
    """A per-row scale (the operand's shape with size-1 contracted dims) laid out like
    ``dot_general``'s result: batch dims, the lhs's kept dims, the rhs's kept dims."""
    free = _free_dims(scale.ndim, contract, batch)
    moved = jnp.transpose(scale, [*batch, *free, *contract])
    kept = [scale.shape[d] for d in (*batch, *free)]
    nb = len(batch)
    ones = [1] * other_free
    shape = kept + ones if lhs else kept[:nb] + ones + kept[nb:]
    return moved.reshape(shape)


def _operand_scales(lhs, rhs, dims, scaling):
    (lc, rc), (lb, rb) = dims
    if scaling == "tensor":
        return scale_of(lhs, E4M3), scale_of(rhs, E4M3)
    return scale_of(lhs, E4M3, tuple(lc)), scale_of(rhs, E4M3, tuple(rc))


def _forward(lhs, rhs, dims, out_dtype, scaling):
    s_lhs, s_rhs = _operand_scales(lhs, rhs, dims, scaling)
    q_lhs, q_rhs = quantize(lhs, s_lhs, E4M3), quantize(rhs, s_rhs, E4M3)
    # A 16-bit result straight from the GEMM (which accumulates in fp32 either way): what a
    # remat policy saving matmul outputs keeps is then as wide as a bf16 matmul's, not fp32.
    narrow = jnp.dtype(out_dtype).itemsize == 2
    acc = lax.dot_general(
        q_lhs, q_rhs, dims, preferred_element_type=out_dtype if narrow else jnp.float32
    )
    if scaling == "tensor":
        out_scale = s_lhs * s_rhs
    else:
        (lc, rc), (lb, rb) = dims
        n_lhs_free = len(_free_dims(lhs.ndim, lc, lb))
        n_rhs_free = len(_free_dims(rhs.ndim, rc, rb))
        out_scale = _row_scale_in_out_layout(
            s_lhs, lc, lb, n_rhs_free, lhs=True
        ) * _row_scale_in_out_layout(s_rhs, rc, rb, n_lhs_free, lhs=False)
    return (acc.astype(jnp.float32) * out_scale).astype(out_dtype), (q_lhs, s_lhs, q_rhs, s_rhs)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4))
def scaled_dot(lhs, rhs, dims, out_dtype, scaling="tensor"):
    """``dot_general(lhs, rhs, dims)`` in FP8 (see the module docstring); result in
    ``out_dtype``. ``dims`` is ``dot_general``'s ``dimension_numbers`` as tuples."""
    return _forward(lhs, rhs, dims, out_dtype, scaling)[0]


def _scaled_dot_fwd(lhs, rhs, dims, out_dtype, scaling):
    out, (q_lhs, s_lhs, q_rhs, s_rhs) = _forward(lhs, rhs, dims, out_dtype, scaling)
    # dtypes ride along as zero-size arrays: the cotangents must come back in the inputs' dtypes
    tags = (jnp.zeros((0,), lhs.dtype), jnp.zeros((0,), rhs.dtype))
    return out, (_as_bytes(q_lhs), s_lhs, _as_bytes(q_rhs), s_rhs, tags)


def _as_bytes(q):
    """An e4m3 residual as its bytes. Saved under ``jax.checkpoint`` (a remat policy that saves
    it), a float residual passes through ``reduce_precision`` to its own format, which jax
    spells with e4m3's IEEE variant (largest finite 240, with infinities) rather than e4m3fn's
    (448, no infinities): every entry above 240 would come back as inf or NaN."""
    return lax.bitcast_convert_type(q, jnp.uint8)


def _from_bytes(b):
    return lax.bitcast_convert_type(b, E4M3)


def _per_tensor(q, scale):
    """A saved operand with one scale: as it is (tensor scaling) or dequantized and cast again
    (row scaling, whose scales lie along a dimension the backward product contracts)."""
    if scale.ndim == 0:
        return q, scale
    x = q.astype(jnp.float32) * scale
    s = scale_of(x, E4M3)
    return quantize(x, s, E4M3), s


def _scaled_dot_bwd(dims, out_dtype, scaling, res, g):
    q_lhs, s_lhs, q_rhs, s_rhs, (lhs_tag, rhs_tag) = res
    q_lhs, q_rhs = _from_bytes(q_lhs), _from_bytes(q_rhs)
    q_lhs, s_lhs = _per_tensor(q_lhs, s_lhs)
    q_rhs, s_rhs = _per_tensor(q_rhs, s_rhs)
    s_g = scale_of(g, E5M2)
    q_g = quantize(g, s_g, E5M2)
    d_lhs = fp8_ops.dot_general_transpose_lhs(
        q_g, q_lhs, q_rhs, **_transpose_args(dims, lhs_tag.dtype)
    )
    d_rhs = fp8_ops.dot_general_transpose_rhs(
        q_g, q_lhs, q_rhs, **_transpose_args(dims, rhs_tag.dtype)
    )
    return (
        (d_lhs.astype(jnp.float32) * (s_g * s_rhs)).astype(lhs_tag.dtype),
        (d_rhs.astype(jnp.float32) * (s_g * s_lhs)).astype(rhs_tag.dtype),
    )


def _transpose_args(dims, dtype) -> dict:
    """A backward product straight into a 16-bit gradient's dtype (the GEMM accumulates in fp32
    either way): no fp32 copy of a weight-sized gradient lives between GEMM and cast."""
    narrow = jnp.dtype(dtype).itemsize == 2
    return dict(
        dimension_numbers=dims,
        precision=None,
        preferred_element_type=dtype if narrow else jnp.float32,
    )


scaled_dot.defvjp(_scaled_dot_fwd, _scaled_dot_bwd)


def as_dims(dimension_numbers):
    """``dot_general``'s dimension numbers as nested tuples (hashable, for ``nondiff_argnums``)."""
    (lc, rc), (lb, rb) = dimension_numbers
    return ((tuple(lc), tuple(rc)), (tuple(lb), tuple(rb)))


FP8_COMPUTE_CAPABILITY = (8, 9)
"NVIDIA GPUs with FP8 tensor cores: Ada (sm_89: L4, RTX 40xx) and Hopper (sm_90: H100, H200)."


def device_problem(device) -> str | None:
    """Why ``device`` cannot run FP8 matmuls (a GPU older than Ada), else None. XLA:CPU
    computes with the float8 types (no speed-up: for numerics); other backends are left to XLA."""
    capability = getattr(device, "compute_capability", None)
    if getattr(device, "platform", "") != "gpu" or not capability:
        return None
    major, minor = (int(p) for p in str(capability).split(".")[:2])
    if (major, minor) >= FP8_COMPUTE_CAPABILITY:
        return None
    return (
        f"autocast='fp8' needs FP8 tensor cores (compute capability 8.9 or newer: L4, "
        f"RTX 40xx, H100, H200); {device.device_kind} is sm_{major}{minor}; use autocast='bf16'"
    )


def check_mesh(mesh) -> None:
    """One ``ValueError`` line if ``mesh``'s devices cannot run FP8 matmuls (an abstract mesh
    names no devices: nothing to check)."""
    devices = getattr(mesh, "devices", None)
    if devices is None or not hasattr(devices, "flat"):
        return
    problem = device_problem(devices.flat[0])
    if problem:
        raise ValueError(problem)
