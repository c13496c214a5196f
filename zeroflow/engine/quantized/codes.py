"""The code books of the quantized frozen weights, value for value those of bitsandbytes, so that
its 4-bit checkpoints dequantize here bit for bit and ours there.

- ``NF4``: 4-bit NormalFloat (Dettmers et al., "QLoRA", 2023): 16 values at quantiles of the
  standard normal distribution, scaled to [-1, 1], with an exact zero. The values are the
  format's definition (the paper's appendix lists them), written out as float32 decimals.
- ``dynamic_map()``: the signed 8-bit dynamic map that double quantization codes the NF4 block
  scales with (Dettmers et al., "8-bit Optimizers via Block-wise Quantization", 2022): for each
  decade ``10**(e-6)``, ``e = 0..6``, the midpoints of ``2**e`` equal steps of [0.1, 1] with both
  signs, and 0 and 1. Built in float32 step by step as bitsandbytes builds it (its steps come
  from ``torch.linspace``, whose entries are ``start + step * i`` rounded once), which lands on
  float32 values that the same map computed in float64 misses by one unit in the last place
  in 72 of 256 entries. ``zeroflow.optim.blockwise.dynamic_map`` is that float64 one: the
  8-bit optimizer needs no bit-compatibility, the scales do.

``nearest`` picks a code by counting the midpoints below a value, so a value exactly on a
midpoint takes the lower code, as bitsandbytes' reference (``torch.bucketize``) does.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

NF4 = np.array(
    [
        -1.0,
        -0.6961928009986877,
        -0.5250730514526367,
        -0.39491748809814453,
        -0.28444138169288635,
        -0.18477343022823334,
        -0.09105003625154495,
        0.0,
        0.07958029955625534,
        0.16093020141124725,
        0.24611230194568634,
        0.33791524171829224,
        0.44070982933044434,
        0.5626170039176941,
        0.7229568362236023,
        1.0,
    ],
    np.float32,
)
"The 16 NF4 values, sorted; code ``i`` stands for ``NF4[i]`` times its block's scale."


def _linspace_f32(start: float, stop: float, num: int) -> np.ndarray:
    """``num`` float32 steps from ``start`` to ``stop``: the first half counted up from ``start``,
    the second down from ``stop``, each entry ``start + step * i`` taken in float64 (where the
    product of two float32 numbers is exact) and rounded to float32, as a fused multiply-add
    rounds it; tests/test_nf4.py checks the map against bitsandbytes' own."""
    lo, hi = np.float32(start), np.float32(stop)
    step = (hi - lo) / np.float32(num - 1)
    out = [
        lo + np.float64(step) * i if i < num // 2 else hi - np.float64(step) * (num - 1 - i)
        for i in range(num)
    ]
    return np.asarray(out, np.float64).astype(np.float32)


@functools.cache
def dynamic_map() -> np.ndarray:
    """The 256 sorted float32 values of the signed dynamic map (see the module docstring)."""
    values = [np.float32(0.0), np.float32(1.0)]
    for exponent in range(7):
        edges = _linspace_f32(0.1, 1.0, 2**exponent + 1)
        mids = (edges[:-1] + edges[1:]) / np.float32(2)
        scaled = np.float32(10.0 ** (exponent - 6)) * mids
        values += list(scaled) + list(-scaled)
    assert len(values) == 256
    return np.sort(np.asarray(values, np.float32))


def nearest(values: jax.Array, book: np.ndarray) -> jax.Array:
    """uint8 index of the entry of ``book`` (sorted) nearest to each of ``values``: the number
    of midpoints strictly below it. Counted by comparing with every midpoint, one elementwise
    reduction that XLA fuses with the scaling before it."""
    midpoints = (book[:-1] + book[1:]) / np.float32(2)
    return jnp.searchsorted(
        jnp.asarray(midpoints), values, side="left", method="compare_all"
    ).astype(jnp.uint8)
