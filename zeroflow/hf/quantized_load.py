"""A Hugging Face checkpoint read straight into 4-bit (or int8) frozen weights.

Each matrix is read one tensor at a time (a block parameter one layer at a time), quantized
(``zeroflow.engine.quantized.quantize``, the same function ``zf.quantize_frozen`` uses, so the
bytes are the ones quantizing the loaded bf16 model would give) and its packed bytes kept on
the host until the leaf is placed: each device then receives its slice of the bytes
(``jax.make_array_from_callback``). The host holds one tensor in the load dtype and the
packed bytes of one leaf at a time; the bf16 model is never whole anywhere. Vectors (norm
scales, biases) load as they are, as ``zf.quantize_frozen`` leaves them.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from zeroflow.engine.quantized import (
    Parts,
    QuantizedArray,
    check_kind,
    nf4,
    pack,
    quantize,
    quantize_shape,
)
from zeroflow.hf.tensors import TensorMap, read_region
from zeroflow.util.tree import path_str

LAYER_AXES = 1
"A stacked block parameter's leading axis of layers, each layer quantized on its own."


def quantizes(m: TensorMap, shape: tuple[int, ...]) -> bool:
    """What ``zf.quantize_frozen`` quantizes in a frozen base: tensors of two or more axes
    (past a block parameter's layer axis)."""
    return len(shape) - (LAYER_AXES if m.stacked else 0) >= 2


def quantized_shape(m: TensorMap, shape, dtype, kind: str) -> QuantizedArray:
    """The abstract ``QuantizedArray`` a leaf of ``shape`` loads as."""
    weight = jax.ShapeDtypeStruct(tuple(shape), dtype)
    return quantize_shape(weight, kind, LAYER_AXES if m.stacked else 0)


CHUNK = 1 << 22
"Entries an NF4 tensor is read and coded in at a time (its blocks of 64 are independent)."


@functools.partial(jax.jit, static_argnums=(1, 2))
def _quantized_data(x, kind: str, stack_axes: int):
    """One tensor's (or layer's) packed bytes; compiled once per shape, kind and dtype."""
    return quantize(x, kind, stack_axes).data


_nf4_codes = jax.jit(lambda chunk: nf4.quantize(chunk.reshape(1, -1)))


@functools.partial(jax.jit, static_argnums=(2, 3))
def _nf4_packed(words, scales, shape: tuple, dtype: str):
    """The bytes of one tensor from its words and block scales (coded chunk by chunk): the
    scales' double quantization needs them all (their mean is its offset)."""
    return pack(Parts(words, *nf4.quantize_scales(scales)), shape, dtype, "nf4").data


def _nf4_in_chunks(read_rows, shape: tuple, dtype) -> np.ndarray:
    """One NF4 tensor of ``shape`` coded ``CHUNK`` entries at a time, rows read by
    ``read_rows(start, stop)``: the coding's temporaries are a chunk's, not the tensor's.
    Chunks hold whole rows, a multiple of 64 of them, so each ends on a block boundary."""
    row = math.prod(shape[1:])
    step = max(1, CHUNK // row // nf4.BLOCK) * nf4.BLOCK
    words, scales = [], []
    for start in range(0, shape[0], step):
        chunk = read_rows(start, min(start + step, shape[0])).astype(dtype, copy=False)
        w, sc = _nf4_codes(chunk)
        words.append(np.asarray(w[0]))
        scales.append(np.asarray(sc[0]))
    whole = _nf4_packed(np.concatenate(words), np.concatenate(scales), shape, np.dtype(dtype).name)
    return np.asarray(whole)


def _quantized_bytes(
    m: TensorMap, shape, dtype, kind: str, read: Callable[[str, tuple], np.ndarray]
) -> np.ndarray:
    """The packed bytes of one leaf on the host, quantized tensor by tensor."""
    like = quantized_shape(m, shape, dtype, kind)
    out = np.empty(like.data.shape, np.uint8)
    stack_axes = LAYER_AXES if m.stacked else 0

    def quantize_one(tensor):
        return _quantized_data(tensor.astype(dtype, copy=False), kind, stack_axes)

    # a block parameter one layer at a time, any other tensor whole
    rows = [slice(k, k + 1) for k in range(shape[0])] if m.stacked else [slice(None)]
    tensor = tuple(shape[stack_axes:])
    for part in rows:
        if kind == "nf4":  # NF4 tensors also in chunks of rows: see _nf4_in_chunks

            def read_rows(start, stop, part=part):
                index = (part,) * stack_axes + (slice(start, stop),)
                return read_region(m, shape, index + (slice(None),) * (len(tensor) - 1), read)

            out[part] = _nf4_in_chunks(read_rows, tensor, dtype).reshape(out[part].shape)
            continue
        index = (part, *(slice(None) for _ in shape[1:]))
        out[part] = np.asarray(quantize_one(read_region(m, shape, index, read)))
    return out


def place_quantized(
    m: TensorMap,
    shape: tuple[int, ...],
    sharding: Any,
    dtype: np.dtype,
    kind: str,
    read: Callable[[str, tuple], np.ndarray],
) -> QuantizedArray:
    """One leaf quantized as ``kind``, its bytes placed with ``sharding`` (a sharding of the
    packed bytes, e.g. the frozen weights' at ZeRO-3: split along the bytes axis)."""
    like = quantized_shape(m, shape, dtype, kind)
    host = _quantized_bytes(m, shape, dtype, kind, read)
    data = jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])
    return dataclasses.replace(like, data=data)


def quantized_abstract(maps: dict[str, TensorMap], abstract, dtype, kind: str):
    """``abstract`` (the model's parameter shapes) with each leaf that loads quantized as its
    abstract ``QuantizedArray``: the tree the loaded parameters have, to derive their
    shardings from (``ZeroPlan.compute_shardings``)."""
    check_kind(kind)

    def one(path, leaf):
        m = maps[path_str(path)]
        if not quantizes(m, leaf.shape):
            return jax.ShapeDtypeStruct(leaf.shape, dtype)
        return quantized_shape(m, leaf.shape, dtype, kind)

    return jax.tree_util.tree_map_with_path(one, abstract)
