"""qwZ: stage-3 weights all-gathered blockwise-quantized to int8 (values plus one fp32 scale
per block) and dequantized to the compute dtype after the gather, about half the bytes of a
bf16 gather. Only the forward use changes: the gradient is the same exact fp32
reduce-scatter as plain stage 3's, and the fp32 master never passes through the quantizer.

Each device quantizes its own shard (flattened, ``zeroflow.engine.zeropp.quantize``), the int8
values and scales of all shards are gathered along a new leading axis, and the shards are
dequantized and laid side by side along the weight's ZeRO dimension, as a tiled all-gather
would. ``zeroflow.engine.grads.sources.Stage3Collectives`` gathers this way when the plan
sets ``quantize_weights``. Inside a rematerialised layer (``save_all_but_fetched``) the
dequantized weight is not kept for the backward pass (the int8 gather and the dequantization
run again, as a plain gather does): an 8-layer GPT's step needs the same temporary memory as
plain stage 3's.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from zeroflow.backend.mesh import zero_axes
from zeroflow.engine.hosts import index_groups
from zeroflow.engine.padding import cut_to
from zeroflow.engine.zeropp.quantize import Quantized, dequantize, quantize


def quantized_all_gather(
    shard, dim: int, dtype, block_size: int, size: int | None = None, groups=None
):
    """The whole weight in ``dtype`` from this device's ``shard`` (split along ``dim``),
    moved as int8 blocks of ``block_size`` entries; cut to ``size`` along ``dim`` when the
    stored weight is padded. ``groups``: as for ``zeroflow.engine.grads.collectives.all_gather``."""
    q = quantize(shard, block_size)
    listed = index_groups(groups)
    gathered = Quantized(
        jax.lax.all_gather(q.values, zero_axes(), axis_index_groups=listed),
        jax.lax.all_gather(q.scales, zero_axes(), axis_index_groups=listed),
    )
    whole = _dequantized(gathered, shard.shape, jnp.dtype(dtype).name, dim)
    return whole if size is None else cut_to(whole, dim, size)


def _dequantized(gathered: Quantized, shard_shape, dtype: str, dim: int):
    parts = dequantize(gathered, shard_shape, dtype)  # [devices, *shard_shape]
    parts = jnp.moveaxis(parts, 0, dim)
    shape = list(shard_shape)
    shape[dim] *= parts.shape[dim]
    return parts.reshape(shape)
