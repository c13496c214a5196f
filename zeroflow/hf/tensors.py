"""One row of a conversion table: how a zeroflow parameter and a Hugging Face tensor relate.

A Hugging Face tensor (or one part of a fused one, GPT-2's ``c_attn``) is *viewed* with its
dimensions split into ours (``q_proj.weight [H*D, E]`` -> ``[H, D, E]``), then *transposed*
into our order (``[E, H, D]``). Block parameters are stored once per layer there (``{i}`` in
the key) and stacked on a leading layer axis here. Both directions are pure index arithmetic,
so a loader can read exactly the slice one device needs (``read_region``) and a saver can
rebuild each Hugging Face tensor one layer at a time (``to_hf``).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Callable, Sequence

import numpy as np

LAYER = "{i}"
"Placeholder for the layer index in a Hugging Face key of a block parameter."


@dataclasses.dataclass(frozen=True)
class TensorMap:
    ours: str
    "'/'-joined path in zeroflow's params tree, e.g. 'layers/attn/query/kernel'."
    hf: str
    "Hugging Face key; '{i}' marks a per-layer tensor, stacked on our leading layer axis."
    split: tuple[tuple[int, ...], ...]
    "For each dimension of the Hugging Face part, the sizes it splits into (the view)."
    perm: tuple[int, ...]
    "Our dimension j is view dimension perm[j]."
    hf_shape: tuple[int, ...]
    "Shape of the whole Hugging Face tensor (larger than the part when fused)."
    part: tuple[int, int] | None = None
    "(dimension, offset) of this part inside a fused Hugging Face tensor."

    @property
    def stacked(self) -> bool:
        return LAYER in self.hf

    @property
    def view_shape(self) -> tuple[int, ...]:
        return tuple(size for group in self.split for size in group)

    @property
    def part_shape(self) -> tuple[int, ...]:
        return tuple(math.prod(group) for group in self.split)

    def key(self, layer: int | None) -> str:
        return self.hf.replace(LAYER, str(layer)) if self.stacked else self.hf


def tensor_map(
    ours: str,
    hf: str,
    split: Sequence[Sequence[int]],
    perm: Sequence[int] | None = None,
    *,
    fused: tuple[int, int, int] | None = None,
) -> TensorMap:
    """A table row; ``fused=(dim, offset, whole_size)`` when the part is a slice of a bigger
    Hugging Face tensor along ``dim``."""
    groups = tuple(tuple(int(s) for s in group) for group in split)
    view_rank = sum(len(group) for group in groups)
    perm = tuple(range(view_rank)) if perm is None else tuple(perm)
    if sorted(perm) != list(range(view_rank)):
        raise ValueError(f"{ours}: perm {perm} is not a permutation of {view_rank} dimensions")
    hf_shape = [math.prod(group) for group in groups]
    part = None
    if fused is not None:
        dim, offset, whole = fused
        hf_shape[dim] = whole
        part = (dim, offset)
    return TensorMap(ours, hf, groups, perm, tuple(hf_shape), part)


def _normalize(index: Sequence[slice], shape: Sequence[int]) -> list[tuple[int, int]]:
    """jax's per-device index (slices, possibly open-ended) -> [(start, stop)] per dimension."""
    out = []
    for s, size in zip(index, shape):
        start, stop, step = s.indices(size)
        if step != 1:
            raise ValueError(f"strided shard index {s} is not supported")
        out.append((start, stop))
    return out


def _runs(sizes: tuple[int, ...], ranges: list[tuple[int, int]], offset: int):
    """Contiguous runs of one Hugging Face dimension that cover the view ranges of the
    dimensions it splits into: ``[(hf_slice, leading_view_indices)]``.

    The dimensions after the last partial one are whole, so each run spans that partial
    dimension's range times the whole inner block; the dimensions before it are stepped one
    index at a time (one run each).
    """
    last = max([j for j, (r, n) in enumerate(zip(ranges, sizes)) if r != (0, n)], default=0)
    strides = [math.prod(sizes[j + 1 :]) for j in range(len(sizes))]
    runs = []
    for lead in itertools.product(*(range(*ranges[j]) for j in range(last))):
        base = offset + sum(i * strides[j] for j, i in enumerate(lead))
        start, stop = ranges[last]
        runs.append(
            (
                slice(base + start * strides[last], base + stop * strides[last]),
                tuple(i - ranges[j][0] for j, i in enumerate(lead)),
            )
        )
    return runs


def read_region(
    m: TensorMap,
    shape: Sequence[int],
    index: Sequence[slice],
    read: Callable[[str, tuple], np.ndarray],
) -> np.ndarray:
    """Our ``leaf[index]`` (``leaf`` of ``shape``), reading exactly what it covers through
    ``read(hf_key, hf_slices)``, which gets one Hugging Face key and a tuple of slices of it.

    A slice along a whole-row dimension is one read; a slice that cuts an inner split
    dimension (say a bias [heads * head_dim] sharded along head_dim) becomes one read per row.
    """
    ranges = _normalize(index, shape)
    layers: Sequence[int | None] = [None]
    if m.stacked:
        layers, ranges = range(*ranges[0]), ranges[1:]
    view_ranges: list[tuple[int, int]] = [(0, 0)] * len(m.perm)
    for ours_dim, view_dim in enumerate(m.perm):
        view_ranges[view_dim] = ranges[ours_dim]
    per_dim, first = [], 0
    for dim, group in enumerate(m.split):
        offset = m.part[1] if m.part is not None and m.part[0] == dim else 0
        per_dim.append(_runs(group, view_ranges[first : first + len(group)], offset))
        first += len(group)
    view_shape = tuple(stop - start for start, stop in view_ranges)

    def one_layer(key: str) -> np.ndarray:
        out = None
        for combo in itertools.product(*per_dim):
            block = read(key, tuple(run for run, _ in combo))
            if out is None:
                out = np.empty(view_shape, block.dtype)
            where = []
            for (_, lead), group in zip(combo, m.split):
                where += [*lead, *([slice(None)] * (len(group) - len(lead)))]
            target = out[tuple(where)]
            target[...] = block.reshape(target.shape)
        if out is None:  # no run to read, so no dtype for an empty result
            raise ValueError(f"{m.ours}: the index {tuple(index)} selects no element")
        return out.transpose(m.perm)

    return np.stack([one_layer(m.key(i)) for i in layers]) if m.stacked else one_layer(m.key(None))


def to_hf(m: TensorMap, layer_value: np.ndarray) -> np.ndarray:
    """One layer of our leaf (or the whole unstacked leaf) -> its Hugging Face part."""
    inverse = np.argsort(m.perm)
    return np.ascontiguousarray(np.asarray(layer_value).transpose(inverse).reshape(m.part_shape))
