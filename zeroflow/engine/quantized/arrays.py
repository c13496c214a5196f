"""``QuantizedArray``: a frozen weight kept in 4 or 8 bits, as a pytree of one packed byte array
with the weight's shape, dtype and kind as static metadata (the structure of Qwix's ``QArray``:
the bytes are the leaf, so the engine lays them out, shards, gathers and checkpoints them as it
does any array).

A weight is one tensor (one bitsandbytes tensor: its entries flattened in row-major order), or,
with ``stack_axes`` leading axes (a scan's stack of layers), a stack of tensors each quantized on
its own. Each tensor's codes and scales are packed into one row of bytes (``Parts``, in this
order, zero-padded to a multiple of ``ALIGN``); a stack keeps its axes in front with a unit
axis after them: ``[*stack, 1, bytes]`` (one tensor: ``[bytes]``). So a scan over the stack takes
one tensor's row per iteration, and ZeRO splits the bytes axis, not the stack's (a leaf of three
or more dimensions is split along its largest axis, which the padding makes divide by any
device count that divides ``ALIGN``).

Two kinds:
- ``"nf4"`` (``nf4.py``): NF4 codes two to a byte, a scale per 64 entries, the scales double
  quantized (a uint8 code each, an fp32 maximum per 256 of them and an fp32 offset per
  tensor): about 0.516 bytes per entry;
- ``"int8"``: linear int8 in blocks of 64 entries (``zeroflow.engine.zeropp.quantize``: the
  nearest multiple of the block's largest magnitude over 127), one fp32 scale each: 1.0625
  bytes per entry.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import struct

from zeroflow.engine.quantized import nf4
from zeroflow.engine.zeropp.quantize import Quantized as Int8
from zeroflow.engine.zeropp.quantize import dequantize as int8_dequantize
from zeroflow.engine.zeropp.quantize import quantize as int8_quantize
from zeroflow.util.settings import QUANTIZE_KINDS as KINDS

INT8_BLOCK = 64
"Entries per int8 block (one fp32 scale each)."
ALIGN = 512
"Each tensor's bytes are padded to a multiple of this, so that ZeRO can split them evenly."


class Parts(NamedTuple):
    """One batch of tensors' arrays, ``[*stack, ...]``. NF4: packed ``codes`` (uint8, two per
    byte), the scales' uint8 ``scale_codes``, their fp32 block ``maxima`` and ``offset``. int8:
    int8 ``codes`` ``[blocks, 64]`` and fp32 ``scale_codes`` (the scales); no maxima or offset."""

    codes: jax.Array
    scale_codes: jax.Array
    maxima: jax.Array | None = None
    offset: jax.Array | None = None


@struct.dataclass
class QuantizedArray:
    """A quantized weight (see the module docstring). ``data``: the packed bytes; ``shape``:
    one tensor's (the weight's trailing axes), ``dtype``: the weight's own, ``kind``: "nf4" or
    "int8"."""

    data: jax.Array
    shape: tuple = struct.field(pytree_node=False)
    dtype: str = struct.field(pytree_node=False)
    kind: str = struct.field(pytree_node=False)

    @property
    def stack_shape(self) -> tuple[int, ...]:
        """The leading axes of tensors quantized one by one (read from the bytes, so a slice
        of the stack knows its own)."""
        return tuple(self.data.shape[:-2])

    @property
    def full_shape(self) -> tuple[int, ...]:
        return self.stack_shape + tuple(self.shape)

    @property
    def nbytes(self) -> int:
        return self.data.size


def is_quantized(x) -> bool:
    return isinstance(x, QuantizedArray)


def check_kind(kind: Any) -> str:
    if kind not in KINDS:
        raise ValueError(f"quantize kind={kind!r}; expected one of {', '.join(KINDS)}")
    return kind


def _sizes(kind: str, n: int) -> list[tuple[int, Any]]:
    """``(entries, dtype)`` of each of a tensor's parts, in their order in its bytes."""
    if kind == "int8":
        blocks = max(1, math.ceil(n / INT8_BLOCK))
        return [(blocks * INT8_BLOCK, jnp.int8), (blocks, jnp.float32)]
    blocks = max(1, math.ceil(n / nf4.BLOCK))
    groups = max(1, math.ceil(blocks / nf4.SCALE_BLOCK))
    return [
        (math.ceil(n / 2), jnp.uint8),
        (blocks, jnp.uint8),
        (groups, jnp.float32),
        (1, jnp.float32),
    ]


def row_bytes(kind: str, n: int) -> int:
    """Bytes of one tensor of ``n`` entries: its parts, padded to a multiple of ``ALIGN``."""
    raw = sum(count * jnp.dtype(dtype).itemsize for count, dtype in _sizes(kind, n))
    return -(-raw // ALIGN) * ALIGN


def pack(parts: Parts, shape, dtype, kind: str) -> QuantizedArray:
    """The ``QuantizedArray`` of ``parts`` (``[*stack, ...]``) for tensors of ``shape``."""
    n = math.prod(shape)
    arrays = [p for p in parts if p is not None]
    stack = arrays[-1].shape if kind == "nf4" else arrays[1].shape[:-1]
    pieces = []
    for array, (count, _) in zip(arrays, _sizes(kind, n)):
        flat = array.reshape(*stack, count)
        as_bytes = jax.lax.bitcast_convert_type(flat, jnp.uint8)
        pieces.append(as_bytes.reshape(*stack, -1))
    row = jnp.concatenate(pieces, axis=-1)
    row = jnp.pad(row, [(0, 0)] * len(stack) + [(0, row_bytes(kind, n) - row.shape[-1])])
    data = row.reshape(*stack, 1, -1) if stack else row
    return QuantizedArray(data, tuple(shape), jnp.dtype(dtype).name, kind)


def unpack(q: QuantizedArray) -> Parts:
    """The parts ``q``'s bytes hold, ``[*stack, ...]``."""
    stack = q.stack_shape
    row = q.data.reshape(*stack, -1)
    out, start = [], 0
    for count, dtype in _sizes(q.kind, math.prod(q.shape)):
        size = count * jnp.dtype(dtype).itemsize
        piece = row[..., start : start + size]
        start += size
        if jnp.dtype(dtype).itemsize > 1:
            piece = piece.reshape(*stack, count, jnp.dtype(dtype).itemsize)
        out.append(jax.lax.bitcast_convert_type(piece, dtype))
    if q.kind == "int8":
        return Parts(out[0].reshape(*stack, -1, INT8_BLOCK), out[1])
    return Parts(out[0], out[1], out[2], out[3].reshape(stack))


def quantize(x: jax.Array, kind: str = "nf4", stack_axes: int = 0) -> QuantizedArray:
    """``x`` (float, any shape) quantized as ``kind``: one tensor, or a stack of them along its
    first ``stack_axes`` axes."""
    check_kind(kind)
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise ValueError(f"quantize needs a floating-point array, got {x.dtype}")
    if not 0 <= stack_axes < max(x.ndim, 1):
        raise ValueError(f"stack_axes={stack_axes} leaves no tensor axes of shape {x.shape}")
    stack, shape = tuple(x.shape[:stack_axes]), tuple(x.shape[stack_axes:])
    flat = x.reshape(*stack, math.prod(shape))
    if kind == "int8":
        q = jax.vmap(lambda row: int8_quantize(row, INT8_BLOCK))(flat.reshape(-1, flat.shape[-1]))
        parts = Parts(q.values.reshape(*stack, *q.values.shape[1:]), q.scales.reshape(*stack, -1))
    else:
        words, scales = nf4.quantize(flat)
        parts = Parts(words, *nf4.quantize_scales(scales))
    return pack(parts, shape, x.dtype, kind)


def dequantize(q: QuantizedArray, dtype=None) -> jax.Array:
    """The weight ``q`` holds, ``[*stack, *shape]``, in ``dtype`` (default: its own). Computed
    in fp32; XLA fuses it into the operation that reads it where it can."""
    dtype = jnp.dtype(q.dtype if dtype is None else dtype)
    n = math.prod(q.shape)
    parts = unpack(q)
    if q.kind == "int8":
        whole = int8_dequantize(Int8(parts.codes, parts.scale_codes), (n,), dtype)
    else:
        # NF4 parts always carry maxima and offset (unpack fills them for this kind)
        assert parts.maxima is not None and parts.offset is not None
        scales = nf4.dequantize_scales(nf4.Scales(parts.scale_codes, parts.maxima, parts.offset))
        whole = nf4.dequantize(parts.codes, scales, n, dtype)
    return whole.reshape(q.full_shape)
