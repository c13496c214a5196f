"""``QuantizedArray``: a frozen weight kept in 4 or 8 bits, as a pytree of its packed codes and
scales with its shape and dtype as static metadata (the structure of Qwix's ``QArray``: the
arrays are leaves, so the engine lays each one out, shards and moves it like any array).

A weight of shape ``[*stack, r, c]`` is a stack of ``r x c`` matrices, each quantized on its own
(one bitsandbytes tensor each); every array of the pytree keeps the stack axes in front, so a
scan over the stack slices it into one matrix's arrays per iteration. A vector is one tensor.

Two kinds:
- ``"nf4"`` (``nf4.py``): NF4 codes two to a byte, a scale per 64 entries, the scales double
  quantized (a uint8 code each, an fp32 maximum per 256 of them and an fp32 offset per
  matrix): about 0.516 bytes per entry;
- ``"int8"``: linear int8 in blocks of 64 entries (``zeroflow.engine.zeropp.quantize``: the
  nearest multiple of the block's largest magnitude over 127), one fp32 scale each: 1.0625
  bytes per entry.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
from flax import struct

from zeroflow.engine.quantized import nf4
from zeroflow.engine.zeropp import quantize as int8

KINDS = ("nf4", "int8")
INT8_BLOCK = 64
"Entries per int8 block (one fp32 scale each)."


@struct.dataclass
class QuantizedArray:
    """A quantized weight (see the module docstring). ``values``: NF4 bytes ``[*stack,
    ceil(n / 2)]`` or int8 blocks ``[*stack, blocks, 64]``; ``scales``: uint8 codes (NF4) or fp32
    scales (int8) ``[*stack, blocks]``; ``maxima`` and ``offset``: the fp32 double quantization
    of NF4's scales (``[*stack, ceil(blocks / 256)]``, ``[*stack]``), None for int8.
    ``shape``: one tensor's (the trailing axes), ``dtype``: the weight's own."""

    values: jax.Array
    scales: jax.Array
    maxima: jax.Array | None
    offset: jax.Array | None
    shape: tuple = struct.field(pytree_node=False)
    dtype: str = struct.field(pytree_node=False)
    kind: str = struct.field(pytree_node=False)

    @property
    def stack_shape(self) -> tuple[int, ...]:
        """The leading axes of matrices quantized one by one (read from the arrays, so a
        slice of the stack knows its own)."""
        return tuple(self.values.shape[: self.values.ndim - (2 if self.kind == "int8" else 1)])

    @property
    def full_shape(self) -> tuple[int, ...]:
        return self.stack_shape + tuple(self.shape)

    @property
    def nbytes(self) -> int:
        """Bytes of every array it keeps."""
        return sum(x.size * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(self))


def is_quantized(x) -> bool:
    return isinstance(x, QuantizedArray)


def check_kind(kind: Any) -> str:
    if kind not in KINDS:
        raise ValueError(f"quantize kind={kind!r}; expected one of {', '.join(KINDS)}")
    return kind


def quantize(x: jax.Array, kind: str = "nf4") -> QuantizedArray:
    """``x`` (float, any shape) quantized as ``kind``: its last two axes one matrix each, the
    axes before them a stack of matrices (a vector: one tensor)."""
    check_kind(kind)
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise ValueError(f"quantize needs a floating-point array, got {x.dtype}")
    split = max(x.ndim - 2, 0)
    stack, shape = tuple(x.shape[:split]), tuple(x.shape[split:])
    flat = x.reshape(*stack, math.prod(shape))
    dtype = jnp.dtype(x.dtype).name
    if kind == "int8":
        batch = flat.reshape(-1, flat.shape[-1])
        q = jax.vmap(lambda row: int8.quantize(row, INT8_BLOCK))(batch)
        values = q.values.reshape(*stack, *q.values.shape[1:])
        return QuantizedArray(values, q.scales.reshape(*stack, -1), None, None, shape, dtype, kind)
    words, scales = nf4.quantize(flat)
    double = nf4.quantize_scales(scales)
    return QuantizedArray(words, double.codes, double.maxima, double.offset, shape, dtype, kind)


def dequantize(q: QuantizedArray, dtype=None) -> jax.Array:
    """The weight ``q`` holds, ``[*stack, *shape]``, in ``dtype`` (default: its own). Computed
    in fp32; XLA fuses it into the operation that reads it where it can."""
    dtype = jnp.dtype(q.dtype if dtype is None else dtype)
    n = math.prod(q.shape)
    if q.kind == "int8":
        whole = int8.dequantize(int8.Quantized(q.values, q.scales), (n,), dtype)
    else:
        scales = nf4.dequantize_scales(nf4.Scales(q.scales, q.maxima, q.offset))
        whole = nf4.dequantize(q.values, scales, n, dtype)
    return whole.reshape(q.full_shape)
