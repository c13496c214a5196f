"""One *unit* of ``gather_on_use``: an operation whose weights are fetched just before it runs
and fetched again for its backward pass, a ``custom_vjp`` whose residuals are what is stored
(shards, stand-ins) and data, never a fetched weight.

Order: a fetch waits (``wait``, ``zeroflow.engine.ordering.after``) for the unit's data inputs
in the forward pass and for its output cotangent in the backward pass, so that the compiler
cannot issue every fetch at the start of the step. With prefetching, *tokens* (fp32 scalars
made from values as they come to exist) pass from unit to unit, so that a fetch waits for an
earlier unit instead and overlaps its compute (``FetchUnit``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp

from zeroflow.engine.grads.collectives import varying
from zeroflow.engine.grads.sources import Source
from zeroflow.engine.ordering import live

NO_TOKENS = object()
"``tokens`` of a unit that takes no part in prefetching."


def run_unit(
    compute: Callable,
    sources: Sequence[Source],
    stored,
    side,
    data,
    *,
    anchors: Sequence[int] = (),
    wait: Callable | None = None,
    tokens=NO_TOKENS,
):
    """``compute(fetched weights, side, data)`` with the weights fetched from ``stored`` (one
    entry per source) after ``data[anchors]`` exist (forward) and again after the cotangent
    exists (backward); ``wait=None``: the compiler places the fetches. ``side``: constant
    arrays the weight-only operands are built from.

    With ``tokens`` (prefetching), a pair ``(fetch, grads)`` of tokens from earlier units
    (None for the first units), returns ``(outputs, (fetch, grads))`` instead, this unit's
    tokens for later units (see ``FetchUnit``)."""
    unit = FetchUnit(compute, tuple(sources), tuple(anchors), wait)
    if tokens is NO_TOKENS:
        return unit.call(stored, side, data, None)[0]
    return unit.call(stored, side, data, tokens)


@dataclasses.dataclass(frozen=True)
class FetchUnit:
    """The unit's two passes. The forward fetch waits for the fetch token, which an earlier
    unit made from its own inputs as it started, so this unit's gather overlaps that unit's
    compute.

    In the backward pass the roles turn round through the tokens' cotangents, and the
    reductions join the order. Unit ``i`` widens its weight gradient to fp32 and reduce-
    scatters it only once the reduction of unit ``i+1`` (the one differentiated just before)
    is done, so one whole fp32 gradient is alive at a time; the token of that finished
    reduction, together with unit ``i``'s output cotangent, is also what lets the next fetch
    (unit ``i-1``'s weights) start. Each unit's backward then runs with one collective at a
    time beside it, the previous reduction first and then the next gather, which is all
    XLA:GPU's scheduler keeps in flight by default (a 16-layer model: every other reduce-
    scatter had nothing to overlap when the gather could start first). The unit whose fetch
    token nothing uses (the last) fetches again as soon as its forward output exists, so that
    gather overlaps the loss instead of stalling the turn from forward to backward."""

    compute: Callable
    sources: tuple
    anchors: tuple
    wait: Callable | None

    def call(self, stored, side, data, tokens):
        @jax.custom_vjp
        def unit(stored, side, data, tokens):
            return self.forward(stored, side, data, tokens)

        unit.defvjp(self.forward_saving, self.backward, symbolic_zeros=True)
        return unit(stored, side, data, tokens)

    def fetched(self, stored, tie):
        return [
            src.fetch(self.wait(x, tie) if self.wait is not None and src.ordered else x)
            for src, x in zip(self.sources, stored)
        ]

    def forward(self, stored, side, data, tokens):
        own = [data[j] for j in self.anchors]
        ahead = None if tokens is None else tokens[0]
        out = self.compute(self.fetched(stored, own if ahead is None else [ahead]), side, data)
        started = token(own)  # both tokens: only their cotangents differ
        return out, (started, started)

    def forward_saving(self, *primals):
        """The forward pass, saving what is stored (not what is fetched) for the backward."""
        # symbolic_zeros: the primals come wrapped, and an unused output's cotangent comes as
        # a SymbolicZero (the last unit's token), which must not stand in for a dependency.
        stored, side, data, tokens = jax.tree.map(lambda p: p.value, primals, is_leaf=_is_primal)
        out, next_tokens = self.forward(stored, side, data, tokens)
        done = token(out) if tokens is not None else None  # the forward output exists
        return (out, next_tokens), (stored, side, data, tokens, done)

    def backward(self, residuals, cotangents):
        stored, side, data, tokens, done = residuals
        cotangent, (d_fetch, d_grads) = cotangents
        if not _is_zero(d_fetch):
            tie = [d_fetch]
        else:
            given = [c for c in jax.tree.leaves(cotangent, is_leaf=_is_zero) if not _is_zero(c)]
            tie = given if done is None else [done]
        full = self.fetched(stored, tie)
        trains = [not src.frozen for src in self.sources]

        def of_trained(trained, side, data):  # frozen weights enter as constants
            given = iter(trained)
            return self.compute([next(given) if t else x for t, x in zip(trains, full)], side, data)

        out, vjp = jax.vjp(of_trained, [x for t, x in zip(trains, full) if t], side, data)
        cotangent = jax.tree.map(_instantiate, cotangent, out, is_leaf=_is_zero)
        d_trained, d_side, d_data = vjp(cotangent)
        if not _is_zero(d_grads) and self.wait is not None:
            d_trained = self.wait(d_trained, [d_grads])
        d_trained = iter(d_trained)
        # None: a zero cotangent for a frozen weight, which nothing differentiates anyway.
        given = [
            src.give_back(x, next(d_trained)) if t else None
            for src, x, t in zip(self.sources, stored, trains)
        ]
        if tokens is None:
            return given, d_side, d_data, None
        return given, d_side, d_data, _tokens_back(tokens, cotangent, d_grads, given)


def _tokens_back(tokens, cotangent, d_grads, given):
    """The cotangents of a unit's incoming tokens: for the fetch token, this unit's output
    cotangent and the later unit's finished reduction (the next fetch may start); for the
    reduction token, this unit's reductions (of a ``(weight, stand_in)`` pair: the stand-in's)
    or, for a unit of frozen weights, the later one's handed on."""
    ahead, previous = tokens
    finished = None if _is_zero(d_grads) else [d_grads]  # the later unit's reduction
    reduced = [jax.tree.leaves(g)[-1] for g in given if g is not None] or finished
    return (
        None if ahead is None else token(cotangent) * (token(finished) if finished else 1.0),
        None if previous is None or not reduced else token(reduced),
    )


def token(anchors):
    """An fp32 scalar (1.0) computed from one element of ``anchors``: whatever waits for it
    waits for them. Not a constant the compiler could fold (a select between equal branches
    would be). Always typed as varying over ``data``: the token's cotangent is made from a
    unit's output cotangent, which varies, and a custom_vjp's cotangent must have its input's
    type (anchors that are the same on every device, such as LoRA's replicated adapters,
    would otherwise give an invariant token)."""
    readable = [a for a in jax.tree.leaves(anchors) if getattr(a, "size", 0)]
    if not readable:
        return varying(jnp.ones((), jnp.float32))
    return varying(live(readable[0]).astype(jnp.float32))


def _is_primal(x) -> bool:
    return isinstance(x, jax.custom_derivatives.CustomVJPPrimal)


def _is_zero(x) -> bool:
    return isinstance(x, jax.custom_derivatives.SymbolicZero)


def _instantiate(cotangent, output):
    """A symbolic-zero cotangent as zeros of ``output``'s cotangent type: its shape and, inside
    ``shard_map``, its manual-axis type, which jax's cotangent check compares too (float0 for an
    integer output, such as a loss's predictions that nothing differentiates)."""
    if not _is_zero(cotangent):
        return cotangent
    return jnp.zeros_like(output, dtype=cotangent.aval.dtype)
