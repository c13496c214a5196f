"""Order without barriers: values that can be computed only once others exist.

``lax.optimization_barrier`` does not order anything on every backend: XLA:CPU expands it to a
tuple before it schedules. Used where the compiler would otherwise start every transfer at
once: weights fetched on use (``grads/gather_on_use.py``) and optimizer state brought in one
parameter at a time (``update.py``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def after(values, anchors):
    """``values``, unchanged, but computable only once ``anchors`` exist.

    Each array goes through a select on a predicate read from one element of an anchor, always
    true at run time (``live``) but nothing the compiler can fold. It costs one pass over each
    array (a shard, at ZeRO-3).
    """
    readable = [
        a
        for a in jax.tree.leaves(anchors)
        if a.size
        and (
            jnp.issubdtype(a.dtype, jnp.integer)
            or jnp.issubdtype(a.dtype, jnp.floating)
            or a.dtype == jnp.bool_
        )
    ]
    if not readable:
        return values
    is_live = live(readable[0])
    return jax.tree.map(lambda v: jnp.where(is_live, v, jnp.zeros_like(v)), values)


def live(anchor):
    """True at run time, read from the first element of ``anchor`` (an integer with its low
    bit set is never zero), but nothing the compiler can fold."""
    first = jax.lax.slice(anchor, (0,) * anchor.ndim, (1,) * anchor.ndim).reshape(())
    first = first.astype(jnp.uint8) if first.dtype == jnp.bool_ else first
    bits = jax.lax.bitcast_convert_type(first, _UINT[jnp.dtype(first.dtype).itemsize])
    return (bits | 1) != 0


_UINT = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint64}
