"""ZeRO++ pieces: blockwise int8 quantization against a numpy reference, cross-host bytes of
collectives, and stage 3 with quantized weight gathers trained against plain stage 3."""
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from zeroflow import zeropp


def numpy_quantize(x, block_size):
    """The reference: absmax per block of the flattened array, scale = absmax / 127, codes
    rounded half to even and clipped to [-127, 127]."""
    flat = np.asarray(x, np.float32).reshape(-1)
    blocks = max(1, math.ceil(flat.size / block_size))
    padded = np.zeros(blocks * block_size, np.float32)
    padded[:flat.size] = flat
    padded = padded.reshape(blocks, block_size)
    absmax = np.abs(padded).max(axis=1)
    scales = (absmax / np.float32(127)).astype(np.float32)
    safe = np.where(scales > 0, scales, np.float32(1))
    codes = np.clip(np.round(padded / safe[:, None]), -127, 127).astype(np.int8)
    return codes, scales, absmax


@pytest.mark.parametrize("shape, block", [((37, 5), 16), ((64,), 64), ((3, 4, 10), 7), ((5,), 256)])
def test_quantize_matches_numpy_and_round_trips_within_half_a_step(shape, block):
    x = np.random.default_rng(0).normal(size=shape).astype(np.float32) * np.float32(3)
    zero_block = x.size > block  # then the first block is all zeros: scale 0, codes 0
    if zero_block:
        x.reshape(-1)[:block] = 0.0
    q = zeropp.quantize(jnp.asarray(x), block)
    codes, scales, absmax = numpy_quantize(x, block)
    assert q.values.dtype == jnp.int8 and q.scales.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(q.values), codes)
    np.testing.assert_array_equal(np.asarray(q.scales), scales)
    back = np.asarray(zeropp.dequantize(q, shape))
    assert back.shape == shape
    err = np.zeros(codes.size, np.float32)
    err[:x.size] = np.abs(back - x).reshape(-1)
    bound = absmax / 254 * (1 + 1e-6) + 1e-30
    assert (err.reshape(codes.shape) <= bound[:, None]).all()
    if zero_block:
        np.testing.assert_array_equal(back.reshape(-1)[:block], 0.0)


def test_dequantize_keeps_leading_axes_and_casts():
    x = np.random.default_rng(1).normal(size=(4, 6, 3)).astype(np.float32)
    stacked = [zeropp.quantize(jnp.asarray(x[i]), 5) for i in range(4)]
    q = zeropp.Quantized(jnp.stack([s.values for s in stacked]), jnp.stack([s.scales for s in stacked]))
    back = zeropp.dequantize(q, (6, 3), jnp.bfloat16)
    assert back.shape == (4, 6, 3) and back.dtype == jnp.bfloat16
    for i in range(4):
        np.testing.assert_allclose(np.asarray(back[i], np.float32),
                                   np.asarray(zeropp.dequantize(stacked[i], (6, 3))), rtol=1e-2)


def test_transit_bytes_counts_padding_and_scales():
    assert zeropp.transit_bytes((37, 5), 16) == 12 * 16 + 4 * 12
    codes, _, _ = numpy_quantize(np.ones((37, 5)), 16)
    q = zeropp.quantize(jnp.ones((37, 5)), 16)
    assert zeropp.transit_bytes((37, 5), 16) == q.values.nbytes + q.scales.nbytes == codes.nbytes + 4 * len(codes)
