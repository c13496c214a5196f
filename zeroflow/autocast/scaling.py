"""Loss scaling for users outside the engine: ``zf.scaled_value_and_grad``.

The scale is applied to the loss and removed from the gradients inside the gradient
computation, as the engine does (not in an optimizer wrapper), so any optimizer can follow.
Unscaling runs inside the ``UNSCALE_SCOPE`` name scope: ``zf.autocast`` keeps it, and
everything computed from its result (the optimizer update, if the whole step is autocast), in
fp32.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from zeroflow.autocast.interpret import autocast
from zeroflow.autocast.lists import UNSCALE_SCOPE
from zeroflow.autocast.precision import LossScaleState, Precision


def unscale(grads, scale):
    """``(grads / scale in fp32, all finite)``, marked as the end of half precision."""
    with jax.named_scope(UNSCALE_SCOPE):

        def one(g):
            return g.astype(jnp.float32) / scale if jnp.issubdtype(g.dtype, jnp.floating) else g

        grads = jax.tree.map(one, grads)
        checks = [
            jnp.all(jnp.isfinite(g))
            for g in jax.tree.leaves(grads)
            if jnp.issubdtype(g.dtype, jnp.floating)
        ]
        finite = jnp.all(jnp.stack(checks)) if checks else jnp.asarray(True)
    return grads, finite


def scaled_value_and_grad(fn, prec: Precision, *, argnums=0, has_aux: bool = False):
    """``jax.value_and_grad`` with the loss scaling (and autocast) of ``prec``.

    Returns ``grad_fn(loss_scale, *args, **kwargs) -> ((value, grads), new_loss_scale,
    finite)`` where ``loss_scale`` is ``prec.init_loss_scale()`` on the first step (None
    without loss scaling) and the returned one afterwards. ``grads`` are fp32 and unscaled;
    ``finite`` is False when any gradient element is inf/NaN: skip that update (the dynamic
    scale has already been halved). With ``prec.autocast`` set, ``fn`` runs under
    ``zf.autocast``. ``value`` is ``loss`` or ``(loss, aux)`` as with ``has_aux``.
    """
    if not isinstance(prec, Precision):
        raise ValueError(f"prec must be a zf.Precision, got {type(prec).__name__}")
    forward = autocast(fn, dtype=prec.autocast) if prec.autocast != "none" else fn

    def grad_fn(loss_scale: LossScaleState | None, *args, **kwargs):
        if not prec.scaled:
            scale = jnp.ones((), jnp.float32)
        elif isinstance(loss_scale, LossScaleState):
            scale = loss_scale.scale
        else:
            raise ValueError(
                "loss_scale must be the LossScaleState from prec.init_loss_scale() "
                f"(or the one the last call returned), got {type(loss_scale).__name__}"
            )

        def scaled(*a, **k):
            out = forward(*a, **k)
            loss, aux = out if has_aux else (out, None)
            return jnp.asarray(loss, jnp.float32) * scale, (loss, aux)

        (_, (loss, aux)), grads = jax.value_and_grad(scaled, argnums, has_aux=True)(*args, **kwargs)
        grads, finite = unscale(grads, scale)
        value = (loss, aux) if has_aux else loss
        return (value, grads), prec.next_loss_scale(loss_scale, finite), finite

    return grad_fn
