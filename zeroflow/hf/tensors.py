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

    @property
    def layer_shape(self) -> tuple[int, ...]:
        """Our shape of one layer (the whole leaf when not stacked)."""
        view = self.view_shape
        return tuple(view[d] for d in self.perm)

    def key(self, layer: int | None) -> str:
        return self.hf.replace(LAYER, str(layer)) if self.stacked else self.hf


def tensor_map(ours: str, hf: str, split: Sequence[Sequence[int]], perm: Sequence[int] | None = None,
               *, fused: tuple[int, int, int] | None = None) -> TensorMap:
    """A table row; ``fused=(dim, offset, whole_size)`` when the part is a slice of a bigger
    Hugging Face tensor along ``dim``."""
    split = tuple(tuple(int(s) for s in group) for group in split)
    view_rank = sum(len(group) for group in split)
    perm = tuple(range(view_rank)) if perm is None else tuple(perm)
    if sorted(perm) != list(range(view_rank)):
        raise ValueError(f"{ours}: perm {perm} is not a permutation of {view_rank} dimensions")
    hf_shape = [math.prod(group) for group in split]
    part = None
    if fused is not None:
        dim, offset, whole = fused
        hf_shape[dim] = whole
        part = (dim, offset)
    return TensorMap(ours, hf, split, perm, tuple(hf_shape), part)


def _normalize(index: Sequence[slice], shape: Sequence[int]) -> list[tuple[int, int]]:
    """jax's per-device index (slices, possibly open-ended) -> [(start, stop)] per dimension."""
    out = []
    for s, size in zip(index, shape):
        start, stop, step = s.indices(size)
        if step != 1:
            raise ValueError(f"strided shard index {s} is not supported")
        out.append((start, stop))
    return out


def read_region(m: TensorMap, shape: Sequence[int], index: Sequence[slice],
                read: Callable[[str, tuple], np.ndarray]) -> np.ndarray:
    """Our ``leaf[index]`` (``leaf`` of ``shape``), reading only what it covers through
    ``read(hf_key, hf_slices)``.

    ``read`` gets one Hugging Face key and a tuple of slices of that tensor. Along a split
    dimension the read covers the outermost view dimension's range with the inner ones whole
    (a contiguous run of rows), and the inner ranges are cut here.
    """
    ranges = _normalize(index, shape)
    if m.stacked:
        layers, ranges = range(*ranges[0]), ranges[1:]
    view_ranges: list[tuple[int, int]] = [None] * len(m.perm)  # type: ignore[list-item]
    for ours_dim, view_dim in enumerate(m.perm):
        view_ranges[view_dim] = ranges[ours_dim]
    hf_slices, cut, grouped = [], [], []
    first = 0
    for dim, group in enumerate(m.split):
        (start, stop), inner = view_ranges[first], math.prod(group[1:])
        offset = m.part[1] if m.part is not None and m.part[0] == dim else 0
        hf_slices.append(slice(offset + start * inner, offset + stop * inner))
        grouped += [stop - start, *group[1:]]
        cut += [slice(None)] + [slice(*r) for r in view_ranges[first + 1:first + len(group)]]
        first += len(group)

    def one_layer(key: str) -> np.ndarray:
        block = read(key, tuple(hf_slices)).reshape(grouped)[tuple(cut)]
        return block.transpose(m.perm)

    if not m.stacked:
        return one_layer(m.key(None))
    return np.stack([one_layer(m.key(i)) for i in layers])


def to_hf(m: TensorMap, layer_value: np.ndarray) -> np.ndarray:
    """One layer of our leaf (or the whole unstacked leaf) -> its Hugging Face part."""
    inverse = np.argsort(m.perm)
    return np.ascontiguousarray(np.asarray(layer_value).transpose(inverse).reshape(m.part_shape))
