"""Readable errors for what a loss asks of jax that jax cannot do inside the step's
``shard_map`` over ``data`` (the same loss runs under a plain ``jax.jit``).

Two constructs are known, both reproduced with a bare ``jax.shard_map`` and no zeroflow:

- a collective over a ``jax.vmap`` axis name (``lax.pmean(x, "batch")`` inside
  ``jax.vmap(f, axis_name="batch")``), which is how ``eqx.nn.BatchNorm`` computes its batch
  statistics in either mode: jax's varying-axes bookkeeping asserts that every collective axis
  is a mesh axis (a bare ``AssertionError``);
- ``eqx.nn.State.set`` comparing the old value's ``jax.eval_shape`` (which inside
  ``shard_map`` carries the manual mesh) with a new value that is a constant (which carries
  none): BatchNorm's ``mode="ema"`` flag, ``"Old and new values have different
  structures/shapes/dtypes. The old value is bool[] and the new value is bool[]"``.
"""

from __future__ import annotations

import functools
import traceback

_VMAP_COLLECTIVE = (
    "the loss runs a collective over a jax.vmap axis name (lax.pmean/psum over the axis_name of "
    "jax.vmap(f, axis_name=...); eqx.nn.BatchNorm does this for its batch statistics) inside "
    "the train step's shard_map over 'data', which jax cannot trace (a bare jax.shard_map "
    "fails the same way). Way around: compute the statistics on the batched array instead "
    "(jnp.mean over the batch dimension: flax.nnx.BatchNorm or flax.linen.BatchNorm, or a "
    "normalisation layer called on the whole batch), or use a normalisation without batch "
    "statistics (eqx.nn.LayerNorm, eqx.nn.GroupNorm)"
)

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


def _raised_in_varying_cast(err: BaseException | None) -> bool:
    """Whether ``err`` (or what it wraps) was raised by jax's ``pvary`` / ``preduced``."""
    while err is not None:
        frames = traceback.extract_tb(err.__traceback__)
        if frames and frames[-1].name in ("pvary", "preduced"):
            return True
        err = err.__cause__ or err.__context__
    return False


def explained(loss_fn):
    """``loss_fn`` raising one readable error for the constructs above, the original chained."""

    @functools.wraps(loss_fn)
    def call(*args, **kwargs):
        try:
            return loss_fn(*args, **kwargs)
        except AssertionError as err:
            if _raised_in_varying_cast(err):
                raise NotImplementedError(_VMAP_COLLECTIVE) from err
            raise
        except ValueError as err:
            if str(err).startswith("Old and new values have different structures/shapes/dtypes"):
                raise ValueError(_EQX_STATE) from err
            raise

    return call
