"""Frozen weights in 4 bits (NF4, QLoRA's) or 8 (int8), dequantized on use inside the step.

    qparams, qtrainable = zf.quantize_frozen(params, trainable, kind="nf4", stacked="layers")
    state = zf.init_train_state(qparams, tx, plan, prec, trainable=qtrainable)
    step = zf.make_train_step(loss_fn, tx, plan, prec)      # loss_fn unchanged

- ``codes.py``: the NF4 values and the 8-bit dynamic map, as bitsandbytes has them;
- ``nf4.py``: NF4 with double-quantized block scales, bit for bit bitsandbytes' layout;
- ``arrays.py``: ``QuantizedArray``, the pytree a quantized leaf becomes (one packed byte
  array), and int8;
and, in ``zeroflow.engine.grads.dequantized``, the source the step's fetch-on-use replay
dequantizes a quantized leaf with, and the same for a loss called outside the step.

Why a function of the parameters rather than an ``init_train_state`` option: what it returns is
ordinary parameters (the quantized leaves are pytrees of arrays the engine stores, shards and
checkpoints like any frozen leaf, in their own dtypes), so it composes with everything that
takes parameters (an init function, ``zf.lora``'s ``{"base", "lora"}``, a restored checkpoint)
and the engine needs no second description of which leaves are quantized: the state's own
tree says it, and the step dequantizes what it finds.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from zeroflow.engine import frozen as frozen_weights
from zeroflow.engine.quantized.arrays import (
    KINDS,
    Parts,
    QuantizedArray,
    check_kind,
    dequantize,
    is_quantized,
    pack,
    quantize,
    row_bytes,
    unpack,
)
from zeroflow.util.tree import is_under, path_str

__all__ = [
    "KINDS",
    "Parts",
    "QuantizedArray",
    "any_quantized",
    "as_weights",
    "check_trainable",
    "dequantize",
    "dequantized",
    "is_quantized",
    "pack",
    "quantize",
    "quantize_frozen",
    "quantize_shape",
    "quantized_bytes",
    "unpack",
]


def _stack_axes(path, stacked: str | None) -> int:
    return 1 if is_under(path_str(path), stacked) else 0


def _quantizes(x, trains: bool, stack_axes: int) -> bool:
    """Which leaves ``quantize_frozen`` quantizes: frozen floating-point tensors of two or more
    axes (a stack's leaf: past its layer axis); vectors (biases, norm scales) are a small share
    of the bytes and stay as they are."""
    floating = jnp.issubdtype(jnp.result_type(x), jnp.floating)
    return not trains and floating and jnp.ndim(x) - stack_axes >= 2


def quantized_bytes(shape, kind: str, stack_axes: int = 0) -> int | None:
    """Bytes of the leaf ``quantize_frozen`` makes of a frozen floating-point weight of
    ``shape`` (its first ``stack_axes`` axes a stack), from the layout alone (nothing traced,
    for estimates of models too large to build); None where it leaves the weight as it is."""
    check_kind(kind)
    if len(shape) - stack_axes < 2:
        return None
    stack, tensor = shape[:stack_axes], shape[stack_axes:]
    return math.prod(stack) * row_bytes(kind, math.prod(tensor))


def quantize_frozen(params, trainable, kind: str = "nf4", *, stacked: str | None = None):
    """``(qparams, qtrainable)``: ``params`` with every frozen matrix (``trainable`` as for
    ``zf.init_train_state``: a pytree of bools or a callable ``(path, leaf) -> bool``) replaced
    by a ``QuantizedArray`` of ``kind`` (``"nf4"`` or ``"int8"``), and the trainable mask of
    that tree (a quantized leaf frozen). ``stacked``: the path (``path_str``, e.g. ``"layers"``)
    of a subtree whose leaves carry a leading axis of layers that the loss scans over: each
    layer's tensor is then quantized on its own, and the step dequantizes one layer at a
    time; any other leaf is one tensor. ``params`` may be a zero-argument function returning
    them (then so is ``qparams``: nothing is built before ``init_train_state`` builds it,
    sharded)."""
    check_kind(kind)
    lazy = frozen_weights.is_function(params)
    abstract = jax.eval_shape(params) if lazy else params
    mask = frozen_weights.trainable_mask(trainable, abstract)
    if all(jax.tree.leaves(mask)):  # a bool per leaf; a hole (None) has none
        raise ValueError("quantize_frozen: trainable freezes no parameter, so nothing to quantize")

    def quantized(tree):
        def one(path, x, t):
            axes = _stack_axes(path, stacked)
            return quantize(x, kind, axes) if _quantizes(x, t, axes) else x

        return jax.tree_util.tree_map_with_path(one, tree, mask)

    def masked(path, x, t):
        axes = _stack_axes(path, stacked)
        if not _quantizes(x, t, axes):
            return t
        return jax.tree.map(lambda _: False, quantize_shape(x, kind, axes))

    qmask = jax.tree_util.tree_map_with_path(masked, abstract, mask)
    if lazy:
        return (lambda: quantized(params())), qmask
    return jax.jit(quantized)(params), qmask


def any_quantized(tree) -> bool:
    return any(is_quantized(x) for x in jax.tree.leaves(tree, is_leaf=is_quantized))


def quantize_shape(x, kind: str, stack_axes: int = 0) -> QuantizedArray:
    """The ``QuantizedArray`` of ``x`` (an array or an abstract value), on shapes only."""
    return jax.eval_shape(
        lambda v: quantize(v, kind, stack_axes), jax.ShapeDtypeStruct(jnp.shape(x), x.dtype)
    )


def dequantized(tree, dtype=None):
    """``tree`` with every ``QuantizedArray`` dequantized (to ``dtype``, default its own):
    the weights whole, for what reads them outside the step (a merged export, sampling)."""
    return jax.tree.map(
        lambda x: dequantize(x, dtype) if is_quantized(x) else x, tree, is_leaf=is_quantized
    )


def as_weights(tree, fill=None):
    """``tree`` with every ``QuantizedArray`` replaced by ``fill``, or (None) by the abstract
    weight it encodes: the parameters' own structure, for counting them."""
    return jax.tree.map(
        lambda x: (
            (jax.ShapeDtypeStruct(x.full_shape, x.dtype) if fill is None else fill)
            if is_quantized(x)
            else x
        ),
        tree,
        is_leaf=is_quantized,
    )


def check_trainable(params, mask) -> None:
    """One readable line where a quantized leaf of ``params`` is marked trainable: a
    quantized weight has no master copy to update."""
    trained = []

    def visit(path, x, m):
        if is_quantized(x) and any(jax.tree.leaves(m)):
            trained.append(path_str(path))

    jax.tree_util.tree_map_with_path(visit, params, mask, is_leaf=is_quantized)
    if trained:
        raise ValueError(
            f"quantized weights are frozen, but trainable marks {', '.join(trained[:4])} "
            "trainable; use the mask quantize_frozen returns"
        )
