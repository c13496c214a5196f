"""Blockwise symmetric int8 quantization of weights and gradients in transit (ZeRO++'s qwZ
and qgZ, Wang et al. 2023).

An array is flattened and cut into blocks of ``block_size`` consecutive entries, the last one
padded with zeros. Each block keeps one fp32 scale, its largest magnitude over 127, and each
entry becomes the nearest integer multiple of that scale in [-127, 127]. Rounding to the
nearest multiple errs by at most half a step: ``absmax / 254`` per block. -128 is never used,
so the code is symmetric and a block's largest entry comes back exactly (up to fp32 rounding).

Blocks run along the flattened array rather than one axis, so that a shard of any shape
quantizes to the same two arrays (``values [blocks, block_size]``, ``scales [blocks]``),
which stack along a new leading axis when all-gathered. The codes are linear, not the dynamic
map of ``zeroflow.optim.blockwise``: weights and gradients in one block are of similar size,
and linear codes let quantized values be summed after scaling (qgZ).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

LEVELS = 127
"Largest code magnitude: int8 without -128, so the code is symmetric around zero."


class Quantized(NamedTuple):
    """An array in transit: int8 ``values`` of shape ``[blocks, block_size]`` and fp32
    ``scales`` of shape ``[blocks]`` (a block's entry is ``value * scale``)."""

    values: jax.Array
    scales: jax.Array


def num_blocks(size: int, block_size: int) -> int:
    """Blocks of ``block_size`` entries that hold ``size`` entries (at least one)."""
    return max(1, math.ceil(size / block_size))


def quantize(x: jax.Array, block_size: int) -> Quantized:
    """``x`` (any shape, any float dtype) as int8 values and one fp32 scale per block."""
    flat = x.reshape(-1).astype(jnp.float32)
    blocks = num_blocks(flat.size, block_size)
    blocked = jnp.pad(flat, (0, blocks * block_size - flat.size)).reshape(blocks, block_size)
    scales = jnp.max(jnp.abs(blocked), axis=1) / LEVELS
    safe = jnp.where(scales > 0, scales, 1.0)  # an all-zero block: codes 0, scale 0
    values = jnp.clip(jnp.round(blocked / safe[:, None]), -LEVELS, LEVELS).astype(jnp.int8)
    return Quantized(values, scales)


def dequantize(q: Quantized, shape, dtype=jnp.float32) -> jax.Array:
    """The array of ``shape`` that ``q`` encodes (its padding dropped), computed in fp32 and
    returned as ``dtype``. ``q`` may carry leading axes (one per gathered shard): then the
    result is ``[*leading, *shape]``."""
    lead = q.values.shape[:-2]
    whole = q.values.astype(jnp.float32) * q.scales[..., None]
    size = math.prod(shape)
    flat = whole.reshape(*lead, -1)[..., :size]
    return flat.reshape(*lead, *shape).astype(dtype)


def transit_bytes(shape, block_size: int) -> int:
    """Bytes ``quantize`` makes of an array of ``shape``: one per entry, padding included,
    and four per block."""
    blocks = num_blocks(math.prod(shape), block_size)
    return blocks * block_size + 4 * blocks
