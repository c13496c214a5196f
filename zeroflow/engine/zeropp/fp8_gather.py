"""Stage-3 weights all-gathered in FP8 (``ZeroPlan(quantize_weights="fp8")``): each device
casts its shard to ``float8_e4m3fn`` with the whole weight's scale before the all-gather, one
byte per entry on the wire (half of bf16's, and without qwZ's per-block scales).

The scale is the FP8 matmul's own (``zeroflow.autocast.fp8``: ``amax(|w|) / 448`` over the whole
weight): every device's shard amax is all-gathered (one float each) and the largest taken. The
weight comes back in the compute dtype as ``q * scale``; an FP8 matmul under
``zf.autocast(dtype="fp8")`` that reads it computes the same scale from it (its largest entry
is exactly ``448 * scale``) and so casts it back to exactly the gathered e4m3 values: the
weight is rounded to FP8 once, not twice. (XLA still runs that elementwise dequantize and
requantize on the gathered weight; the wire carries FP8.) Only the forward use changes: the
gradient is plain stage 3's exact reduce-scatter, and the fp32 master never passes through
the cast.

In a layer scan fetched on use (``zeroflow.engine.grads.gather_on_use``) an FP8 matmul of
autocast that reads such a weight gathers it itself instead (``fp8_dot``): the shard cast with
the matmul's own scale, the e4m3 bytes fed to the GEMM, no dequantize and requantize.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from zeroflow.autocast import fp8
from zeroflow.backend.mesh import zero_axes
from zeroflow.engine.hosts import index_groups
from zeroflow.engine.padding import cut_to


def whole_weight_scale(shard, groups=None):
    """``amax / 448`` of the whole weight whose ``shard`` this device holds (1 if all zero)."""
    local = jnp.max(jnp.abs(shard)).astype(jnp.float32)
    amax = jax.lax.all_gather(local, zero_axes(), axis_index_groups=index_groups(groups)).max()
    return jnp.where(amax > 0, amax / fp8.largest(fp8.E4M3), jnp.float32(1.0))


def fp8_all_gather(shard, dim: int, dtype, size=None, groups=None, *, sliced: bool = False):
    """The whole weight in ``dtype`` from this device's ``shard`` (split along ``dim``, cut to
    ``size``), moved as e4m3 with the whole weight's scale. The shards are gathered on a new
    leading axis and moved into place (as qwZ's are), which also suits a loop's slice
    (``sliced``: see ``zeroflow.engine.grads.collectives.all_gather``)."""
    del sliced  # always gathered on a new leading axis
    scale = whole_weight_scale(shard, groups)
    q = fp8.quantize(shard, scale, fp8.E4M3)
    parts = jax.lax.all_gather(
        q, zero_axes(), axis=0, tiled=False, axis_index_groups=index_groups(groups)
    )
    shape = list(shard.shape)
    shape[dim] *= parts.shape[0]
    whole = jnp.moveaxis(parts, 0, dim).reshape(shape)
    whole = (whole.astype(jnp.float32) * scale).astype(dtype)
    return whole if size is None else cut_to(whole, dim, size)
