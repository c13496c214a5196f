"""An FP8 matmul whose weight is a stage-3 shard gathered in FP8, as one operation: the shard is
cast to e4m3 with the matmul's own scale, the e4m3 bytes are all-gathered and fed to the FP8
GEMM as they arrive. The weight is rounded to e4m3 once, and no whole-weight elementwise pass
runs on the device (``fp8_gather`` returns the weight dequantized, and the matmul then casts
the whole gathered weight again: a pass over it in the forward pass and another, with its
amax, in the backward pass).

``gathered_dot(lhs, shard, stand_in, meta, source, spec)`` is ``zf.autocast``'s FP8 matmul
``spec`` (``zeroflow.autocast.fp8_marks``) of ``lhs`` and the weight ``source`` gathers from
``shard``, with the same numerics as that matmul on the gathered weight:

- per-tensor current scaling (``"tensor"``): the weight's scale is ``amax / 448`` of the whole
  weight (every device's shard amax, all-gathered), the scale ``fp8_gather`` casts with, and
  ``scaled_dot`` would find again in the gathered weight;
- delayed scaling (``"delayed"``): the scales come from ``meta``'s amax histories
  (``fp8_delayed``); the shard is cast with the weight's delayed scale before the gather
  (``fp8_gather`` then ``scaled_dot_delayed`` would round it twice, to two grids). The weight's
  amax enters its history from this device's shard: the step takes the max over devices of
  every recorded amax (``zeroflow.engine.fp8_state.max_over_devices``), which is the whole
  weight's.

The backward pass gathers the e4m3 shards again (nothing of the gathered weight is a residual),
runs both products as FP8 GEMMs and hands the weight's gradient to ``source.reduced`` (the
reduce-scatter into ``stand_in``'s slice). With delayed scaling the gradient's scale
``s_grad * s_lhs`` is the same on every device, so the GEMM's result is reduce-scattered as it
comes and the 1/N slice is scaled afterwards (the sum is linear): no pass over the whole
gradient between GEMM and reduce-scatter.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax.linen import fp8_ops

from zeroflow.autocast import fp8, fp8_delayed
from zeroflow.autocast.fp8 import E4M3, E5M2
from zeroflow.backend.mesh import zero_axes
from zeroflow.engine.hosts import index_groups
from zeroflow.engine.padding import cut_to
from zeroflow.engine.zeropp.fp8_gather import whole_weight_scale

FUSED_SCALINGS = ("tensor", "delayed")
"The scalings ``gathered_dot`` computes (row scaling scales the weight per column: unfused)."


def gathered_e4m3(shard, scale, source):
    """The whole weight as e4m3 (``shard / scale`` cast on each device, then all-gathered on a
    new leading axis and moved into place, as ``fp8_all_gather`` does), cut to its size."""
    groups = source.collectives.groups
    q = fp8.quantize(shard, scale, E4M3)
    parts = jax.lax.all_gather(
        q, zero_axes(), axis=0, tiled=False, axis_index_groups=index_groups(groups)
    )
    shape = list(shard.shape)
    shape[source.dim] *= parts.shape[0]
    whole = jnp.moveaxis(parts, 0, source.dim).reshape(shape)
    return whole if source.size is None else cut_to(whole, source.dim, source.size)


def _scales(lhs, shard, meta, source, spec):
    if spec.scaling == "delayed":
        return (
            fp8_delayed.next_scale(meta.lhs, E4M3, spec.margin),
            fp8_delayed.next_scale(meta.rhs, E4M3, spec.margin),
        )
    return fp8.scale_of(lhs, E4M3), whole_weight_scale(shard, source.collectives.groups)


def _product(q_lhs, q_rhs, dims, out_dtype, scale):
    narrow = jnp.dtype(out_dtype).itemsize == 2
    acc = jax.lax.dot_general(
        q_lhs, q_rhs, dims, preferred_element_type=out_dtype if narrow else jnp.float32
    )
    return (acc.astype(jnp.float32) * scale).astype(out_dtype)


def _forward(lhs, shard, meta, source, spec):
    s_lhs, s_rhs = _scales(lhs, shard, meta, source, spec)
    q_lhs = fp8.quantize(lhs, s_lhs, E4M3)
    q_rhs = gathered_e4m3(shard, s_rhs, source)
    out = _product(q_lhs, q_rhs, spec.dims, jnp.dtype(spec.out_dtype), s_lhs * s_rhs)
    seen = ()
    if spec.scaling == "delayed":
        seen = (
            fp8_delayed.record(meta.lhs, lhs, s_lhs),
            fp8_delayed.record(meta.rhs, shard, s_rhs),
        )
    return out, (q_lhs, s_lhs, s_rhs, seen)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def gathered_dot(lhs, shard, stand_in, meta, source, spec):
    """``spec``'s FP8 matmul of ``lhs`` and the weight ``source`` gathers from ``shard`` (see
    the module docstring). ``meta``: the site's ``SiteMeta`` (delayed scaling; its cotangent
    is the next step's) or ``()``. The weight's gradient goes to ``stand_in``."""
    del stand_in
    return _forward(lhs, shard, meta, source, spec)[0]


def _fwd(lhs, shard, stand_in, meta, source, spec):
    del stand_in
    out, (q_lhs, s_lhs, s_rhs, seen) = _forward(lhs, shard, meta, source, spec)
    grad_meta = meta.grad if spec.scaling == "delayed" else ()
    tag = jnp.zeros((0,), lhs.dtype)  # the cotangent comes back in lhs's dtype
    return out, (fp8._as_bytes(q_lhs), s_lhs, shard, s_rhs, seen, grad_meta, tag)


def _bwd(source, spec, res, g):
    b_lhs, s_lhs, shard, s_rhs, seen, grad_meta, tag = res
    q_lhs = fp8._from_bytes(b_lhs)
    q_rhs = gathered_e4m3(shard, s_rhs, source)
    if spec.scaling == "delayed":
        s_g = fp8_delayed.next_scale(grad_meta, E5M2, spec.margin)
    else:
        s_g = fp8.scale_of(g, E5M2)
    q_g = fp8.quantize(g, s_g, E5M2)
    d_lhs = fp8_ops.dot_general_transpose_lhs(
        q_g, q_lhs, q_rhs, **fp8._transpose_args(spec.dims, tag.dtype)
    )
    d_rhs = fp8_ops.dot_general_transpose_rhs(
        q_g, q_lhs, q_rhs, **fp8._transpose_args(spec.dims, source.dtype)
    )
    d_lhs = (d_lhs.astype(jnp.float32) * (s_g * s_rhs)).astype(tag.dtype)
    weight_scale = s_g * s_lhs
    if spec.scaling == "delayed":  # one scale on every device: scale the reduced slice
        d_stand_in = source.reduced(d_rhs) * weight_scale
        new_meta = fp8_delayed.SiteMeta(*seen, fp8_delayed.record(grad_meta, g, s_g))
    else:  # each device's own scales: scaled before the sum
        d_stand_in = source.reduced((d_rhs.astype(jnp.float32) * weight_scale).astype(d_rhs.dtype))
        new_meta = ()
    return d_lhs, None, d_stand_in, new_meta


gathered_dot.defvjp(_fwd, _bwd)


def fuses(source) -> bool:
    """Whether ``source`` is a stage-3 weight gathered in FP8, which ``gathered_dot`` can
    gather itself."""
    collectives = getattr(source, "collectives", None)
    return (
        not getattr(source, "frozen", True)
        and hasattr(source, "reduced")  # a trained stage-3 weight (``sources.Sharded``)
        and collectives is not None
        and collectives.weight_block is not None
        and collectives.weight_format == "fp8"
    )
