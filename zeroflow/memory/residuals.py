"""What the backward pass keeps from the forward pass, from the loss's jaxpr alone (nothing
compiled): ``jax.vjp``'s residuals on one device's micro-batch, which leaves a loss's scan reads
a layer at a time, and where a remat policy keeps each residual. ``estimate_step``'s
activation terms (``zeroflow.memory.peak``) are built from these."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import Literal

from zeroflow.autocast import autocast
from zeroflow.autocast.precision import Precision
from zeroflow.engine.step import check_batch
from zeroflow.memory import liveness
from zeroflow.memory.liveness import memory_of
from zeroflow.memory.trace_cache import remembered
from zeroflow.util import jaxprs
from zeroflow.util.compat import scan_split


def scanned_leaves(loss_fn, params, batch, extras: dict | None = None) -> list[bool]:
    """For each leaf of ``params``: whether a ``lax.scan`` in the loss takes one slice of it per
    iteration (a stack of layers), which the stage-3 step then fetches one slice at a time."""
    closed = jax.make_jaxpr(lambda p, b, e: loss_fn(p, b, **e))(params, batch, extras or {})
    count = len(jax.tree.leaves(params))
    found: set[int] = set()

    def visit(jaxpr, leaf_of):
        for eqn in jaxpr.eqns:
            invars = [
                (v, leaf_of.get(v)) if not isinstance(v, Literal) else (v, None) for v in eqn.invars
            ]
            if eqn.primitive.name == "scan":
                split = sum(scan_split(eqn.params))
                found.update(i for _, i in invars[split:] if i is not None)
            elif jaxprs.call_body(eqn) is not None:  # inlined by the fetch-on-use replay too
                inner, _ = jaxprs.open_jaxpr(jaxprs.call_body(eqn))
                visit(inner, {iv: i for (_, i), iv in zip(invars, inner.invars) if i is not None})

    visit(closed.jaxpr, {v: i for i, v in enumerate(closed.jaxpr.invars[:count])})
    return [i in found for i in range(count)]


def _differentiated(loss_fn, params, batch, extras, gather_per_layer, trainable):
    """``(loss of the trainable leaves, those leaves)``: ``loss_fn`` as the step differentiates
    it, the frozen leaves constants. Called inside a trace."""
    leaves, treedef = jax.tree.flatten(params)
    keep = trainable or (True,) * len(leaves)

    def loss(trained):
        given = iter(trained)
        p = treedef.unflatten([next(given) if t else x for t, x in zip(keep, leaves)])
        # Fresh model-state values, made inside this trace as the step hands them over:
        # Flax NNX refuses to mutate a variable made at another trace level.
        here = jax.tree.map(lambda x: x, extras)
        out = (
            loss_fn(p, batch, **here)
            if gather_per_layer is None
            else loss_fn(p, batch, lambda x: x, **here)
        )
        return out[0] if isinstance(out, tuple) else out

    return loss, [x for t, x in zip(keep, leaves) if t]


@remembered  # a plan traces the same loss for every stage and offload
def activation_residuals(
    loss_fn,
    params,
    batch,
    *,
    gather_per_layer: str | None = None,
    extras: dict | None = None,
    memory: str | None = None,
    trainable: tuple[bool, ...] | None = None,
) -> list:
    """``ShapeDtypeStruct``s of what ``jax.vjp`` of ``loss_fn(params, batch)`` keeps for the
    backward pass, the parameters themselves excluded (also as a scan keeps them: its slices
    stacked again). Traced abstractly: nothing runs. ``extras``: the keywords the step passes
    the loss (``model_state``, ``rng``). ``memory``: only those in ``"device"`` or in ``"host"``
    memory (a remat policy's offloaded residuals), default all. ``trainable``: one bool per
    leaf of ``params`` (flatten order); the frozen ones are constants of the vjp, as in the
    step (what only their gradient would need is not kept)."""
    found: list = []

    def probe(params, batch, extras):
        loss, trained = _differentiated(loss_fn, params, batch, extras, gather_per_layer, trainable)
        _, vjp = jax.vjp(loss, trained)
        inputs = jax.tree.leaves(params)
        weights = {(tuple(p.shape), p.dtype) for p in inputs}
        found.extend(
            jax.ShapeDtypeStruct(r.shape, r.dtype)
            for r in jax.tree.leaves(vjp)
            if not any(r is p for p in inputs)
            and (tuple(r.shape), r.dtype) not in weights
            and memory in (None, memory_of(r))
        )
        return 0

    jax.make_jaxpr(probe)(params, batch, extras or {})
    return found


@remembered
def _held_by_gradient(
    loss_fn,
    params,
    batch,
    *,
    gather_per_layer: str | None = None,
    extras: dict | None = None,
    trainable: tuple[bool, ...] | None = None,
) -> list:
    """``[bytes]``: ``liveness.peak_bytes`` of the gradient of ``loss_fn`` (as
    ``activation_residuals`` differentiates it), in a list for ``remembered``."""

    def gradient(params, batch, extras):
        loss, trained = _differentiated(loss_fn, params, batch, extras, gather_per_layer, trainable)
        return jax.grad(loss)(trained)

    closed = jax.make_jaxpr(gradient)(params, batch, extras or {})
    return [liveness.peak_bytes(closed)]


def micro_batch(batch, n: int, grad_accum: int, context: int = 1):
    """One device's micro-batch of the global ``batch``, abstract: rows split over ``n`` data
    devices and ``grad_accum``, sequences (second dimensions) over ``context`` devices."""
    check_batch(batch, n, grad_accum, context)

    def one(x):
        shape = list(np.shape(x))
        shape[0] //= n * grad_accum
        if len(shape) >= 2:
            shape[1] //= context
        return jax.ShapeDtypeStruct(tuple(shape), x.dtype)

    return jax.tree.map(one, batch)


def residual_bytes(
    loss_fn,
    params,
    micro,
    prec: Precision,
    gather_per_layer,
    extras: dict | None = None,
    memory: str | None = None,
    trainable: tuple[bool, ...] | None = None,
) -> float:
    """Bytes of the loss's residuals on one micro-batch, as the step runs it (autocast too);
    ``memory``: only those in device or in host memory (``activation_residuals``)."""
    compute_params = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(np.shape(x), prec.compute_dtype), params
    )
    fn = loss_fn
    if prec.autocast != "none":
        fn = autocast(loss_fn, dtype=prec.autocast)
    residuals = activation_residuals(
        fn,
        compute_params,
        micro,
        gather_per_layer=gather_per_layer,
        extras=extras,
        memory=memory,
        trainable=trainable,
    )
    return float(sum(math.prod(r.shape) * jnp.dtype(r.dtype).itemsize for r in residuals))


def held_bytes(
    loss_fn,
    params,
    micro,
    prec: Precision,
    gather_per_layer,
    extras: dict | None = None,
    trainable: tuple[bool, ...] | None = None,
) -> float:
    """The most bytes the forward and backward pass of one micro-batch hold in device memory at
    once, parameters and gradients aside (``zeroflow.memory.liveness``), as the step runs the
    loss (autocast too)."""
    compute_params = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(np.shape(x), prec.compute_dtype), params
    )
    fn = loss_fn
    if prec.autocast != "none":
        fn = autocast(loss_fn, dtype=prec.autocast)
    return _held_by_gradient(
        fn,
        compute_params,
        micro,
        gather_per_layer=gather_per_layer,
        extras=extras,
        trainable=trainable,
    )[0]


def largest_residual(loss_fn, params, micro, prec: Precision, gather_per_layer) -> float:
    compute_params = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(np.shape(x), prec.compute_dtype), params
    )
    residuals = activation_residuals(
        loss_fn, compute_params, micro, gather_per_layer=gather_per_layer
    )
    return float(
        max((math.prod(r.shape) * jnp.dtype(r.dtype).itemsize for r in residuals), default=0)
    )
