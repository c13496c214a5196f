"""Quantized frozen weights dequantized just before the operation that reads them, forward and
backward, by ``gather_on_use``'s replay: the loss is traced with each quantized leaf standing in
as the whole weight it encodes, and each operation that meets data becomes a unit that fetches
the weight's bytes (gathered at stage 3), dequantizes them, applies the operation and lets the
dequantized copy die; its backward pass does it again. The residuals are the bytes, so no
dequantized weight lives from the forward pass to the backward pass, and a scan over a stack of
quantized matrices dequantizes one matrix per iteration: the whole model is never dequantized
at once, and the loss is any JAX function, unchanged.

The train step builds a ``Dequantized`` source per quantized leaf inside its own replay
(``local._call_gathering``); ``dequantized_on_use`` does the same for a loss called outside the
step (evaluation).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax

from zeroflow.engine.frozen import is_function
from zeroflow.engine.grads import gather_on_use
from zeroflow.engine.quantized import QuantizedArray, dequantize, is_quantized


@dataclasses.dataclass(frozen=True)
class Dequantized:
    """The ``gather_on_use`` source of a quantized frozen weight: its bytes fetched by ``part``
    (a stage-3 shard's gather; None: stored whole), then dequantized to ``dtype``; never
    differentiated. ``stacked``: how many of its leading axes are a stack of tensors (a scan
    over the first takes one tensor's bytes per iteration)."""

    dtype: Any
    stacked: int
    part: Any = None
    ordered = True
    frozen = True

    def fetch(self, stored):
        data = stored.data if self.part is None else self.part.fetch(stored.data)
        return dequantize(stored.replace(data=data), self.dtype)

    def give_back(self, stored, grad):  # never called: nothing differentiates a frozen weight
        return None

    def fetch_for_grad(self, stored):  # a constant of the differentiated function
        return self.fetch(stored)

    def layer(self):
        """One tensor of the stack: the bytes' own source sliced alike, None where it cannot
        be (its bytes split along the stack axis, or no stack)."""
        if not self.stacked:
            return None
        part = None if self.part is None else self.part.layer()
        if self.part is not None and part is None:
            return None
        return dataclasses.replace(self, stacked=self.stacked - 1, part=part)


def source_of(q: QuantizedArray, dtype, part=None) -> Dequantized:
    """The source of the quantized weight stored as ``q`` (or this device's shard of it,
    ``part``: the ``sources.Frozen`` of its bytes, which gathers them as they are: they are
    4-bit already, so qwZ's int8 blocks would only add error and bytes)."""
    return Dequantized(dtype, len(q.stack_shape), None if part is None else part.as_bytes())


def dequantized_on_use(loss_fn, dtype):
    """``loss_fn(params, *args, **kwargs)`` with every ``QuantizedArray`` of ``params``
    dequantized to ``dtype`` on use (see the module docstring), for calls outside the train
    step (evaluation): the step does the same itself, in its own fetch-on-use replay.
    Positional arguments that are functions (a ``gather_layer``) are passed through."""

    @functools.wraps(loss_fn)
    def loss(params, *args, **kwargs):
        leaves, treedef = jax.tree.flatten(params, is_leaf=is_quantized)
        sources = [source_of(x, dtype) if is_quantized(x) else None for x in leaves]
        if not any(sources):
            return loss_fn(params, *args, **kwargs)
        functions = {k: a for k, a in enumerate(args) if is_function(a)}
        data = [a for k, a in enumerate(args) if k not in functions]

        def replayed(weights, data, kwargs):
            given = iter(data)
            full = [functions[k] if k in functions else next(given) for k in range(len(args))]
            return loss_fn(jax.tree.unflatten(treedef, weights), *full, **kwargs)

        return gather_on_use.call(replayed, leaves, sources, data, kwargs)

    return loss
