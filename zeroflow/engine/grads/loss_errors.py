"""Readable errors for what a loss asks of jax that jax cannot do inside the step's
``shard_map`` over ``data`` (the same loss runs under a plain ``jax.jit``).

One construct is known, reproduced with a bare ``jax.shard_map`` and no zeroflow:
``eqx.nn.State.set`` comparing the old value's ``jax.eval_shape`` (which inside ``shard_map``
carries the manual mesh) with a new value that is a constant (which carries none): BatchNorm's
``mode="ema"`` flag, ``"Old and new values have different structures/shapes/dtypes. The old
value is bool[] and the new value is bool[]"``.
"""

from __future__ import annotations

import functools

_EQX_STATE = (
    "eqx.nn.State.set refused a new value inside the train step's shard_map over 'data': "
    "Equinox compares the old value's jax.eval_shape, which inside shard_map carries the "
    "manual mesh, with a new constant (BatchNorm's mode='ema' first-time flag), which carries "
    "none, and reports them as different although shape and dtype agree (a bare "
    "jax.shard_map fails the same way). Way around: keep the model's mutable variables as "
    "arrays that the loss updates from computed values (model_state= of flax.linen "
    "batch_stats or flax.nnx.BatchStat), or a normalisation without state "
    "(eqx.nn.LayerNorm, eqx.nn.GroupNorm)"
)


def explained(loss_fn):
    """``loss_fn`` raising one readable error for the construct above, the original chained."""

    @functools.wraps(loss_fn)
    def call(*args, **kwargs):
        try:
            return loss_fn(*args, **kwargs)
        except ValueError as err:
            if str(err).startswith("Old and new values have different structures/shapes/dtypes"):
                raise ValueError(_EQX_STATE) from err
            raise

    return call
