"""Frozen weights: which parameters train, and the two halves of a parameter tree.

A frozen leaf is stored once, in the compute dtype, with no fp32 master copy, no optimizer
state and no gradient. ``trainable`` (``zf.init_train_state(..., trainable=...)``) is either a
pytree of bools with the structure of the parameters, or a callable ``(path, leaf) -> bool``
on each leaf's ``path_str`` (``"layers/attn/kernel"``); None trains everything.
``trainable_mask`` reads it once, into each leaf's layout (``LeafLayout.trains``, through
``ZeroPlan.layouts``): from there on, whether a leaf trains is a fact of its layout, as where
it is split is.

The state keeps the two halves as trees of the parameters' own structure with holes (None)
where the other half's leaves are: the master weights, optimizer state and gradients hold the
trainable leaves only (so any optax transform sees just those), ``TrainState.frozen`` the
others. ``split`` makes them as the layouts say, ``merge`` puts the two back together.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp

from zeroflow.engine.plan import is_layout
from zeroflow.util.tree import path_str


def _is_hole(x) -> bool:
    return x is None


def is_function(x) -> bool:
    """Whether ``x`` is a function to call rather than a pytree to read: callable and a leaf of
    jax's pytrees (or a ``jax.tree_util.Partial``). Being callable alone decides nothing: an
    Equinox module is callable and is also the pytree of its weights."""
    if not callable(x):
        return False
    return isinstance(x, jax.tree_util.Partial) or jax.tree_util.treedef_is_leaf(
        jax.tree.structure(x)
    )


def trainable_mask(trainable, params) -> Any:
    """A tree of Python bools with the structure of ``params`` (arrays or abstract values), from
    the ``trainable`` argument; one readable ValueError for a tree of another structure, a
    non-bool answer or nothing left to train."""
    if trainable is None:
        return jax.tree.map(lambda _: True, params)
    if is_function(trainable):

        def ask(path, x):
            answer = trainable(path_str(path), x)
            if not isinstance(answer, bool):
                raise ValueError(
                    f"trainable({path_str(path)!r}, leaf) must return a bool, got "
                    f"{type(answer).__name__}"
                )
            return answer

        mask = jax.tree_util.tree_map_with_path(ask, params)
    else:
        want = jax.tree.structure(params)
        got = jax.tree.structure(trainable)
        if got != want:  # type: ignore[operator]  # jaxlib's PyTreeDef has no stub
            raise ValueError(
                f"trainable must be a pytree of bools matching params (or a "
                f"callable (path, leaf) -> bool); its structure {_short(got)} differs "
                f"from params' {_short(want)}"
            )
        bad = [
            path_str(p)
            for p, b in jax.tree_util.tree_leaves_with_path(trainable)
            if not isinstance(b, bool)
        ]
        if bad:
            raise ValueError(
                f"trainable's leaves must be Python bools; not bools at: "
                f"{', '.join(bad[:4])}" + (" ..." if len(bad) > 4 else "")
            )
        mask = trainable
    if not any(jax.tree.leaves(mask)):
        raise ValueError(
            "trainable freezes every parameter: nothing would train; leave at least "
            "one leaf trainable"
        )
    return mask


def _short(treedef) -> str:
    text = str(treedef)
    return text if len(text) <= 120 else text[:117] + "..."


def split(tree, layouts):
    """``(trainable, frozen)``: ``tree`` with holes (None) at the leaves whose layout (in
    ``layouts``, of ``tree``'s structure; ``tree`` itself when it is one) is frozen, and with
    holes at the trained ones."""
    lays, treedef = jax.tree.flatten(layouts, is_leaf=is_layout)
    leaves = treedef.flatten_up_to(tree)
    keep = [x if lay.trains else None for lay, x in zip(lays, leaves)]
    freeze = [None if lay.trains else x for lay, x in zip(lays, leaves)]
    return treedef.unflatten(keep), treedef.unflatten(freeze)


def merge(trainable, frozen):
    """The whole tree from its two halves (``frozen`` None: nothing is frozen)."""
    if frozen is None:
        return trainable
    return jax.tree.map(lambda t, f: f if t is None else t, trainable, frozen, is_leaf=_is_hole)


def mask_of(trainable, frozen):
    """The trainable mask (bools, the whole tree's structure) of the two halves ``split``
    made; ``frozen`` None: every leaf of ``trainable`` trains."""
    if frozen is None:
        return jax.tree.map(lambda _: True, trainable)
    # Both halves None: a hole of the caller's own tree (eqx.partition's), kept a hole.
    return jax.tree.map(
        lambda t, f: None if t is None and f is None else f is None,
        trainable,
        frozen,
        is_leaf=_is_hole,
    )


def any_frozen(layouts) -> bool:
    """Whether a leaf of ``layouts`` (a tree of ``LeafLayout``) is frozen."""
    return not all(lay.trains for lay in jax.tree.leaves(layouts, is_leaf=is_layout))


def count(mask, params) -> tuple[int, int]:
    """``(trainable, frozen)`` numbers of parameters."""
    sizes = [
        (t, math.prod(jnp.shape(x))) for t, x in zip(jax.tree.leaves(mask), jax.tree.leaves(params))
    ]
    train = sum(s for t, s in sizes if t)
    return train, sum(s for _, s in sizes) - train
