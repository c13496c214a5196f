"""NF4 by the format's definition, written out in numpy: the tests' reference for a weight's
NF4 round trip, independent of zeroflow's code and of bitsandbytes' kernels (whose CPU
dequantization has changed from release to release: bitsandbytes 0.50's native CPU kernel
dequantizes a tensor whose last axis is shorter than a block, such as the (64, 4, 16) layout
of a query kernel, with the wrong scales).

The format (QLoRA, Dettmers et al. 2023; bitsandbytes' ``quantize_4bit(x, blocksize=64,
quant_type="nf4", compress_statistics=True)``):

- the tensor is flattened in row-major order and cut into blocks of 64 consecutive entries
  (the last one shorter where 64 does not divide the size); each block's scale is its largest
  magnitude;
- each entry, times the reciprocal of its block's scale (the last, short block: divided by it)
  and clipped to [-1, 1], becomes the nearest of the 16 NF4 values (the lower one on a tie);
- double quantization: the scales less their mean (the tensor's offset) are cut into groups
  of 256, each group scaled by its largest magnitude, and each scale becomes the nearest value
  of the signed 8-bit dynamic map;
- dequantized, an entry is its NF4 value times its scale, the scale being its map value times
  its group's maximum plus the offset, all in float32.
"""
import numpy as np

NF4_VALUES = np.array([
    -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
    -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
    0.07958029955625534, 0.16093020141124725, 0.24611230194568634, 0.33791524171829224,
    0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0], np.float32)
"The 16 NF4 values as QLoRA's appendix lists them (quantiles of the standard normal, scaled to "
"[-1, 1], with an exact zero)."

BLOCK, SCALE_BLOCK = 64, 256


def dynamic_map() -> np.ndarray:
    """The signed 8-bit dynamic map (Dettmers et al. 2022), from its definition in float64: for
    each e in 0..6, the midpoints of 2**e equal steps of [0.1, 1] times 10**(e - 6), with both
    signs, and 0 and 1 (256 values, sorted)."""
    values = [0.0, 1.0]
    for e in range(7):
        edges = np.linspace(0.1, 1.0, 2**e + 1)
        mids = (edges[:-1] + edges[1:]) / 2 * 10.0 ** (e - 6)
        values += [*mids, *-mids]
    assert len(values) == 256
    return np.sort(np.asarray(values)).astype(np.float32)


def _nearest(normed: np.ndarray, book: np.ndarray) -> np.ndarray:
    """Index of the value of ``book`` nearest to each of ``normed`` (the first on a tie)."""
    return np.argmin(np.abs(normed[:, None].astype(np.float64) - book[None, :]), axis=1)


def _blockwise(flat: np.ndarray, block: int, divide_last: bool):
    """``(normed, maxima, index)``: ``flat`` (float32) in blocks of ``block``, each normalized by
    its largest magnitude (an all-zero block stays zero) and clipped; ``index``: each entry's
    block."""
    index = np.arange(flat.size) // block
    maxima = np.zeros(index[-1] + 1, np.float32)
    np.maximum.at(maxima, index, np.abs(flat))
    safe = np.where(maxima > 0, maxima, np.float32(1))
    normed = flat * np.where(maxima > 0, np.float32(1) / safe, np.float32(0))[index]
    if divide_last and flat.size % block:
        last = index == index[-1]
        normed[last] = flat[last] / safe[-1] if maxima[-1] > 0 else 0
    return np.clip(normed, -1, 1).astype(np.float32), maxima, index


def round_trip(x: np.ndarray) -> np.ndarray:
    """``x`` (one tensor, any shape) quantized to NF4 with double-quantized scales and
    dequantized back, as float32 of the same shape."""
    flat = np.asarray(x, np.float32).reshape(-1)
    normed, scales, index = _blockwise(flat, BLOCK, divide_last=True)
    nibbles = _nearest(normed, NF4_VALUES)
    offset = np.float32(np.mean(scales, dtype=np.float64))
    centred = (scales - offset).astype(np.float32)
    table = dynamic_map()
    normed_scales, group_max, group = _blockwise(centred, SCALE_BLOCK, divide_last=False)
    scale_codes = _nearest(normed_scales, table)
    decoded = (table[scale_codes] * group_max[group] + offset).astype(np.float32)
    return (NF4_VALUES[nibbles] * decoded[index]).reshape(np.shape(x))


def error_bound(x: np.ndarray) -> np.ndarray:
    """The most NF4 with double-quantized scales can move each entry of ``x``: half the widest
    gap between NF4 values times its block's scale, plus the most the scale itself can move
    (half the widest gap of the dynamic map times its group's maximum; an NF4 value is at most
    1 in magnitude), with float32 slack."""
    flat = np.asarray(x, np.float32).reshape(-1)
    _, scales, index = _blockwise(flat, BLOCK, divide_last=True)
    centred = scales - np.float32(np.mean(scales, dtype=np.float64))
    _, group_max, group = _blockwise(centred, SCALE_BLOCK, divide_last=False)
    nf4_half_gap = np.diff(NF4_VALUES).max() / 2
    map_half_gap = np.diff(dynamic_map()).max() / 2
    bound = nf4_half_gap * scales + map_half_gap * group_max[group]
    return (bound[index] * (1 + 1e-5) + 1e-7).reshape(np.shape(x))
