"""Delayed FP8 scaling in the train step: the amax histories of ``zf.autocast``'s FP8 matmuls
(``zeroflow.autocast.fp8_delayed``) carried in ``TrainState.fp8`` from step to step.

The state is a dict of ``SiteMeta`` by matmul site, fp32 and replicated on every device. The
step hands it to the loss as the keyword ``fp8_state`` and differentiates the loss with respect
to it; the autocast op's backward rule returns each site's next state as that "gradient"
(Flax's overwrite-with-gradient). Every micro-batch on every device starts from the same old
state, so their new states differ only in the amax just recorded (the histories' rolled rest
and the scales are the same): the elementwise max over micro-batches and then over the data
devices (``pmax``) is the state of the whole global batch. It is never divided by the loss
scale (the recorded gradient amax is the scaled gradient's: the tensor the next step casts is
scaled too) and never reaches the optimizer; a skipped step keeps the old one.

Its sites are keyed by their position in the program the step traces, which at stage 3 holds
the step's own gathers: ``fresh_state`` finds them by tracing the step's gradient part once
(abstractly) with a ``SiteShapes`` in place of the state.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from zeroflow.autocast import fp8_delayed
from zeroflow.backend.mesh import zero_axes


class SiteShapes:
    """Stands in for the state while the step is traced to find its matmul sites: a pytree
    without leaves (it crosses ``shard_map`` and ``jax.grad`` as structure: itself is the
    node's static data), which the loss fills with ``{site key: loops' lengths}``."""

    def __init__(self):
        self.found: dict[str, tuple[int, ...]] = {}


jax.tree_util.register_pytree_node(SiteShapes, lambda s: ((), s), lambda s, _: s)


def loss_with_state(cast):
    """The step's loss for ``cast`` (a delayed ``zf.autocast`` function, ``cast(fp8_state,
    *args, **kwargs)``): the state comes as the keyword ``fp8_state``, as the model state
    does; a ``SiteShapes`` there records the sites instead."""

    @functools.wraps(cast)
    def loss(*args, fp8_state, **kwargs):
        if isinstance(fp8_state, SiteShapes):
            out, found = cast.traced_init(*args, **kwargs)
            fp8_state.found.update(found)
            return out
        return cast(fp8_state, *args, **kwargs)

    return loss


def fresh_state(found: dict, history: int, sharding, abstract: bool = False) -> dict:
    """The first step's state for the sites ``found`` (scale 1, empty histories), placed;
    ``abstract``: as ``ShapeDtypeStruct``s in ``sharding`` (an abstract state's step, e.g.
    compiled for a ``zf.target_mesh``, whose devices cannot hold arrays)."""
    metas = {key: fp8_delayed.fresh_meta(shape, history) for key, shape in found.items()}
    if abstract:
        return jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding), metas
        )
    return jax.device_put(metas, sharding)


def fresh_like(like) -> dict:
    """A first step's state shaped and placed like ``like`` (arrays or abstract values): what
    a checkpoint saved without one (current scaling) resumes with."""

    def one(meta: fp8_delayed.ScaleMeta):
        return fp8_delayed.ScaleMeta(
            _placed(jnp.ones(meta.scale.shape, jnp.float32), meta.scale),
            _placed(jnp.zeros(meta.history.shape, jnp.float32), meta.history),
        )

    return jax.tree.map(one, like, is_leaf=lambda x: isinstance(x, fp8_delayed.ScaleMeta))


def _placed(x, like):
    sharding = getattr(like, "sharding", None)
    return x if sharding is None else jax.device_put(x, sharding)


def max_over_micro_batches(acc, new):
    """Each micro-batch's new state folded into the running elementwise max."""
    return jax.tree.map(jnp.maximum, acc, new)


def max_over_devices(new):
    """The global batch's state from each device's (inside ``shard_map``)."""
    return jax.tree.map(lambda x: jax.lax.pmax(x, zero_axes()), new)


def kept_if_skipped(finite, new, old):
    """The new state after a finite step; the old one after a skipped step (its amaxes may be
    inf or NaN, which would set every scale of the window)."""
    if old is None:
        return None
    return jax.tree.map(lambda n, o: jnp.where(finite, n, o), new, old)
