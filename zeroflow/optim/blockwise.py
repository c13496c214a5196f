"""Blockwise 8-bit quantization of optimizer moments (Dettmers et al., "8-bit Optimizers via
Block-wise Quantization", 2022).

Each row of an array's last axis (length L) is cut into ``ceil(L / block_size)`` blocks of at
most ``block_size`` entries. Each block is divided by its largest magnitude (its *scale*, kept in
fp32) and every entry is replaced by the index of the nearest of 256 values of a *dynamic* map:
values spread over seven decades with a few significant digits in each, so that a block holding
both 1e-1 and 1e-6 keeps both to a few percent. The first moment uses the signed map, the second
moment (never negative) the unsigned one, which spends the sign bit on one more fraction bit.

The blocks of a row are *interleaved*: with ``n`` blocks, block ``b`` holds entries ``b, b + n,
b + 2n, ...``. ZeRO may split the last axis over devices in contiguous pieces; interleaved,
every device holds a slice of every block, so a block's scale is a max over devices (an
all-reduce of one number per block) and no moment ever moves between devices. Contiguous blocks
would straddle the pieces and make XLA gather whole moments onto every device. The layout
depends only on the array's shape, so a quantized state has the same shapes and values on any
mesh, and a checkpoint loads at another device count.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np


@functools.cache
def dynamic_map(signed: bool) -> np.ndarray:
    """The 256 sorted fp32 values of the dynamic map: for each decade ``10**(e-6)``,
    ``e = 0..6``, the midpoints of ``2**k`` equal steps of [0.1, 1] scaled by it (``k = e`` signed,
    with both signs, ``k = e + 1`` unsigned), and 0 and 1."""
    values = [0.0, 1.0]
    for exponent in range(7):
        steps = 2 ** (exponent + (0 if signed else 1))
        edges = np.linspace(0.1, 1.0, steps + 1)
        mids = (edges[:-1] + edges[1:]) / 2 * 10.0 ** (exponent - 6)
        values += list(mids) + (list(-mids) if signed else [])
    assert len(values) == 256
    return np.sort(np.asarray(values, np.float32))


def num_blocks(length: int, block_size: int) -> int:
    return max(1, math.ceil(length / block_size))


def scales_shape(shape: tuple[int, ...], block_size: int) -> tuple[int, ...]:
    """One scale per block: the leading dimensions, then the number of blocks of the last."""
    if not shape:
        return (1,)
    return tuple(shape[:-1]) + (num_blocks(shape[-1], block_size),)


def _blocked(x: jax.Array, block_size: int) -> jax.Array:
    """``x`` as ``[..., entries per block, blocks]`` (block ``b`` is entries ``b::blocks`` of the
    last axis), the last axis zero-padded to whole blocks where the blocks do not divide it."""
    x = x.reshape(1) if x.ndim == 0 else x
    length = x.shape[-1]
    blocks = num_blocks(length, block_size)
    per_block = -(-length // blocks)
    x = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, blocks * per_block - length)])
    return x.reshape(*x.shape[:-1], per_block, blocks)


def _unblocked(x: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    length = shape[-1] if shape else 1
    return x.reshape(*x.shape[:-2], -1)[..., :length].reshape(shape)


def quantize(x: jax.Array, block_size: int, signed: bool) -> tuple[jax.Array, jax.Array]:
    """``(codes, scales)``: uint8 indices into ``dynamic_map(signed)`` of ``x``'s shape, and the
    fp32 absolute maximum of each block (``scales_shape``)."""
    table = jnp.asarray(dynamic_map(signed))
    blocked = _blocked(x.astype(jnp.float32), block_size)
    scales = jnp.max(jnp.abs(blocked), axis=-2)
    normed = blocked / jnp.where(scales == 0, 1.0, scales)[..., None, :]
    # Nearest value: count the midpoints below; a value on a midpoint takes the lower one.
    # Counted by comparing with all 255 midpoints: one elementwise reduction that XLA fuses
    # with the moment's own arithmetic. The default binary search is a loop whose carries are
    # whole index arrays of x's shape, kept for every parameter at once.
    midpoints = (table[:-1] + table[1:]) / 2
    codes = jnp.searchsorted(midpoints, normed, side="left", method="compare_all").astype(jnp.uint8)
    return _unblocked(codes, x.shape), scales


def dequantize(codes: jax.Array, scales: jax.Array, block_size: int, signed: bool) -> jax.Array:
    """The fp32 array ``quantize`` encoded: each code's map value times its block's scale."""
    table = jnp.asarray(dynamic_map(signed))
    values = _blocked(table[codes.astype(jnp.int32)], block_size) * scales[..., None, :]
    return _unblocked(values, codes.shape)


def zero_code(signed: bool) -> int:
    """The code of 0 (what a fresh state holds)."""
    return int(np.flatnonzero(dynamic_map(signed) == 0)[0])
