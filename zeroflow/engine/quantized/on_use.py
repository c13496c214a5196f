"""A loss whose parameters hold ``QuantizedArray`` leaves, each dequantized just before the
operation that reads it, forward and backward.

The loss is traced with each quantized leaf standing in as the whole weight it encodes, and
replayed by ``gather_on_use`` with a ``Dequantized`` source per quantized leaf: each operation
that meets data becomes a unit that dequantizes the weights it reads, applies the operation and
lets the dequantized copy die; its backward pass dequantizes them again. Its residuals are the
quantized arrays, so no dequantized weight lives from the forward pass to the backward pass,
and a scan over a stack of quantized matrices dequantizes one matrix per iteration. The whole
model is never dequantized at once, and the loss is any JAX function, unchanged.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax

from zeroflow.engine.frozen import is_function
from zeroflow.engine.grads import gather_on_use
from zeroflow.engine.quantized.arrays import dequantize, is_quantized

DEQUANTIZES = "_zeroflow_dequantizes_on_use"
"Set on a loss ``dequantized_on_use`` made, so that wrapping it again (the step does) is a no-op."


@dataclasses.dataclass(frozen=True)
class Dequantized:
    """The ``gather_on_use`` source of a quantized frozen weight: fetched by dequantizing it to
    ``dtype``; never differentiated. ``stacked``: how many of its leading axes are a stack of
    matrices (a scan over the first takes one slice of every array per iteration)."""

    dtype: Any
    stacked: int
    ordered = True
    frozen = True

    def fetch(self, stored):
        return dequantize(stored, self.dtype)

    def give_back(self, stored, grad):  # never called: nothing differentiates a frozen weight
        return None

    def fetch_for_grad(self, stored):  # a constant of the differentiated function
        return self.fetch(stored)

    def layer(self):
        return dataclasses.replace(self, stacked=self.stacked - 1) if self.stacked else None


def dequantized_on_use(loss_fn, dtype):
    """``loss_fn(params, *args, **kwargs)`` with every ``QuantizedArray`` of ``params``
    dequantized to ``dtype`` on use (see the module docstring). Positional arguments that
    are functions (a ``gather_layer``) are passed through as they are. A loss that already
    dequantizes on use is returned as it is."""
    if getattr(loss_fn, DEQUANTIZES, False):
        return loss_fn

    @functools.wraps(loss_fn)
    def loss(params, *args, **kwargs):
        leaves, treedef = jax.tree.flatten(params, is_leaf=is_quantized)
        sources = [
            Dequantized(dtype, len(x.stack_shape)) if is_quantized(x) else None for x in leaves
        ]
        if not any(sources):
            return loss_fn(params, *args, **kwargs)
        functions = {k: a for k, a in enumerate(args) if is_function(a)}
        data = [a for k, a in enumerate(args) if k not in functions]

        def replayed(weights, data, kwargs):
            given = iter(data)
            full = [functions[k] if k in functions else next(given) for k in range(len(args))]
            return loss_fn(jax.tree.unflatten(treedef, weights), *full, **kwargs)

        return gather_on_use.call(replayed, leaves, sources, data, kwargs)

    setattr(loss, DEQUANTIZES, True)
    return loss


def any_quantized(tree) -> bool:
    return any(is_quantized(x) for x in jax.tree.leaves(tree, is_leaf=is_quantized))
