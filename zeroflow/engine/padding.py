"""Padded storage for leaves whose shape does not divide by the ``data`` axis.

ZeRO splits a leaf along one dimension. When no dimension divides by N (a 50257 x 100 token
table on 8 devices), the plan picks the largest one anyway and the *stored* array gets zeros
appended along it up to a multiple of N (``LeafLayout.pad``), so that it can be split evenly.
Everything the user sees has the leaf's own shape: the loss (the step slices the padding off
after each gather), the optimizer (the update runs on the unpadded arrays, so even transforms
that reduce over a dimension, such as Adafactor's factored moments, see exactly what they would
see unsharded), ``TrainState.params`` / ``master_params`` and checkpoints (saved unpadded). The
padding holds zeros throughout: it is re-created after every update.

A ``TrainState`` records where its arrays are padded in ``StatePadding``, a static (hashable)
field, so that code holding only the state (checkpoints, ``state.params``) can undo it.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from zeroflow.engine.plan import is_layout

Entry = tuple[int, int] | None
"Per array leaf: ``(dim, logical size)`` when the stored array is padded along ``dim``."


def pad_to(x, dim: int, size: int):
    """``x`` with zeros appended along ``dim`` up to ``size`` entries."""
    extra = size - x.shape[dim]
    if extra == 0:
        return x
    widths = [(0, extra if d == dim else 0) for d in range(x.ndim)]
    return jnp.pad(x, widths)


def cut_to(x, dim: int, size: int):
    """The first ``size`` entries of ``x`` along ``dim`` (the padding sliced off)."""
    if x.shape[dim] == size:
        return x
    return jax.lax.slice_in_dim(x, 0, size, axis=dim)


def entries_of(layouts, with_zero: bool) -> tuple[Entry, ...]:
    """The padding entries of a tree of ``LeafLayout`` (flatten order)."""
    return tuple(lay.padding(with_zero) for lay in jax.tree.leaves(layouts, is_leaf=is_layout))


def unpad(tree, entries: tuple[Entry, ...]):
    """Every padded leaf of ``tree`` cut back to its own shape (a no-op without padding)."""
    if not any(entries):
        return tree
    leaves, treedef = jax.tree.flatten(tree)
    return jax.tree.unflatten(
        treedef, [x if e is None else cut_to(x, e[0], e[1]) for x, e in zip(leaves, entries)]
    )


def pad(tree, entries: tuple[Entry, ...], n: int):
    """Every leaf of ``tree`` with an entry padded with zeros to a multiple of ``n``."""
    if not any(entries):
        return tree
    leaves, treedef = jax.tree.flatten(tree)
    return jax.tree.unflatten(
        treedef,
        [x if e is None else pad_to(x, e[0], -(-e[1] // n) * n) for x, e in zip(leaves, entries)],
    )


def unpadded_shapes(tree, entries: tuple[Entry, ...]):
    """fp32 ``ShapeDtypeStruct``s of ``tree``'s leaves in their own shapes."""
    leaves, treedef = jax.tree.flatten(tree)
    entries = entries or (None,) * len(leaves)

    def one(x, e):
        shape = (
            tuple(x.shape)
            if e is None
            else tuple(e[1] if d == e[0] else s for d, s in enumerate(x.shape))
        )
        return jax.ShapeDtypeStruct(shape, jnp.float32)

    return jax.tree.unflatten(treedef, [one(x, e) for x, e in zip(leaves, entries)])


@dataclasses.dataclass(frozen=True)
class StatePadding:
    """Where the arrays of a ``TrainState`` are padded: one entry per array leaf of each field,
    in flatten order (empty: nothing padded). Static and hashable, so it can live in the state's
    tree structure."""

    master: tuple[Entry, ...] = ()
    compute: tuple[Entry, ...] = ()
    opt_state: tuple[Entry, ...] = ()
    data_size: int = 1
    frozen: tuple[Entry, ...] = ()
    compute_copies: int = 1
    "Copies of each split leaf the compute array holds along its ZeRO dimension (hpZ: hosts)."
    cast_on_use: str | None = None
    "The compute dtype the master is read in when the state keeps no compute copy (stage 3:"
    " each use casts its shard as it gathers it); None: the weights are used as stored."

    @property
    def any(self) -> bool:
        return any(self.master) or any(self.compute) or any(self.opt_state) or any(self.frozen)


NO_PADDING = StatePadding()
