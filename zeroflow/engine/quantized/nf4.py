"""NF4 with blockwise scales and their double quantization, in bitsandbytes' layout (QLoRA).

Every function takes a batch of tensors: arrays of shape ``[*stack, n]``, each row of the last
axis one tensor flattened in row-major order, quantized on its own as bitsandbytes quantizes one
``torch.Tensor`` (``quantize_4bit(x, blocksize=64, quant_type="nf4", compress_statistics=True)``):

- the entries are cut into blocks of ``BLOCK`` (64) consecutive ones, the last one shorter when
  64 does not divide ``n``; each block keeps its largest magnitude, its *scale* (fp32);
- each entry, divided by its block's scale and clipped to [-1, 1], becomes the code of the
  nearest ``NF4`` value (``codes.nearest``); two codes share a byte, the first in the high
  nibble, and an odd ``n`` pads one code of 0;
- double quantization: the scales less their mean (the tensor's fp32 *offset*) are cut into
  blocks of ``SCALE_BLOCK`` (256), and each becomes the uint8 code of the nearest value of the
  signed dynamic map (``codes.dynamic_map``) times its block's largest magnitude (fp32).

Dequantizing takes the same steps back, in the same fp32 operations as bitsandbytes: the scale
is ``map[code] * block max + offset``, the entry ``NF4[code] * scale``, then cast to the dtype
asked for. The codes' nearest value is the exact one; bitsandbytes' CPU build codes the scales
through a 65,536-bin table and so, for about 0.2% of them, picks the other neighbour (its CUDA
kernel and its reference implementation pick the nearest).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

from zeroflow.engine.quantized import codes

BLOCK = 64
"Entries per NF4 block (one scale each): bitsandbytes' and QLoRA's block size."
SCALE_BLOCK = 256
"Scales per block of the double quantization (one fp32 maximum each), as bitsandbytes."


class Scales(NamedTuple):
    """Double-quantized block scales of a batch of tensors: uint8 ``codes`` ``[*stack, blocks]``,
    fp32 ``maxima`` ``[*stack, ceil(blocks / 256)]`` and fp32 ``offset`` ``[*stack]``."""

    codes: jax.Array
    maxima: jax.Array
    offset: jax.Array


def _blocks(flat: jax.Array, block: int) -> jax.Array:
    """``flat`` ``[*stack, n]`` as fp32 ``[*stack, ceil(n / block), block]``, zero-padded."""
    n = flat.shape[-1]
    count = max(1, math.ceil(n / block))
    pad = [(0, 0)] * (flat.ndim - 1) + [(0, count * block - n)]
    return jnp.pad(flat.astype(jnp.float32), pad).reshape(*flat.shape[:-1], count, block)


def _scaled(blocks: jax.Array, maxima: jax.Array, *, divide_last: bool) -> jax.Array:
    """Each block divided by its largest magnitude, clipped to [-1, 1]; an all-zero block stays
    zero. Multiplied by the reciprocal, as bitsandbytes does; ``divide_last``: the last block
    (a short one) divided instead, as its reference implementation does there."""
    inverse = jnp.where(maxima > 0, 1.0 / jnp.where(maxima > 0, maxima, 1.0), 0.0)
    scaled = blocks * inverse[..., None]
    if divide_last:
        last_max = maxima[..., -1:]
        last = jnp.where(
            last_max > 0, blocks[..., -1, :] / jnp.where(last_max > 0, last_max, 1.0), 0.0
        )
        scaled = scaled.at[..., -1, :].set(last)
    return jnp.clip(scaled, -1.0, 1.0)


def quantize(flat: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``(words, scales)`` of a batch of tensors ``[*stack, n]`` (any float dtype): packed uint8
    ``[*stack, ceil(n / 2)]`` and the fp32 block scales ``[*stack, ceil(n / 64)]``."""
    n = flat.shape[-1]
    blocks = _blocks(flat, BLOCK)
    maxima = jnp.max(jnp.abs(blocks), axis=-1)
    scaled = _scaled(blocks, maxima, divide_last=n % BLOCK != 0)
    nibbles = codes.nearest(scaled, codes.NF4).reshape(*flat.shape[:-1], -1)
    pairs = nibbles[..., : 2 * math.ceil(n / 2)].reshape(*flat.shape[:-1], -1, 2)
    return (pairs[..., 0] << 4) | pairs[..., 1], maxima


def dequantize(words: jax.Array, scales: jax.Array, n: int, dtype) -> jax.Array:
    """The ``[*stack, n]`` tensors of ``words`` and their fp32 block ``scales``, in ``dtype``."""
    nibbles = jnp.stack([words >> 4, words & 0xF], axis=-1).reshape(*words.shape[:-1], -1)
    count = scales.shape[-1]
    pad = [(0, 0)] * (nibbles.ndim - 1) + [(0, count * BLOCK - nibbles.shape[-1])]
    values = jnp.asarray(codes.NF4)[jnp.pad(nibbles, pad).astype(jnp.int32)]
    values = values.reshape(*words.shape[:-1], count, BLOCK) * scales[..., None]
    return values.reshape(*words.shape[:-1], -1)[..., :n].astype(dtype)


def quantize_scales(scales: jax.Array) -> Scales:
    """The double quantization of fp32 block ``scales`` ``[*stack, blocks]``."""
    offset = jnp.mean(scales, axis=-1)
    return Scales(*code_blockwise(scales - offset[..., None]), offset)


def code_blockwise(centred: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``(codes, maxima)``: ``centred`` ``[*stack, m]`` as uint8 codes of the dynamic map in
    blocks of ``SCALE_BLOCK``, each block with its fp32 largest magnitude."""
    blocks = _blocks(centred, SCALE_BLOCK)
    maxima = jnp.max(jnp.abs(blocks), axis=-1)
    scaled = _scaled(blocks, maxima, divide_last=False)
    found = codes.nearest(scaled, codes.dynamic_map()).reshape(*centred.shape[:-1], -1)
    return found[..., : centred.shape[-1]], maxima


def dequantize_scales(q: Scales) -> jax.Array:
    """The fp32 block scales ``[*stack, blocks]`` that ``q`` codes."""
    m = q.codes.shape[-1]
    count = q.maxima.shape[-1]
    values = jnp.asarray(codes.dynamic_map())[q.codes.astype(jnp.int32)]
    pad = [(0, 0)] * (values.ndim - 1) + [(0, count * SCALE_BLOCK - m)]
    values = jnp.pad(values, pad).reshape(*q.codes.shape[:-1], count, SCALE_BLOCK)
    values = (values * q.maxima[..., None]).reshape(*q.codes.shape[:-1], -1)[..., :m]
    return values + q.offset[..., None]
