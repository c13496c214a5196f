"""The sequence split over the ``context`` mesh axis, as the model sees it.

Inside the train step (``shard_map`` over ``data`` x ``context``) each context device holds
``seq / C`` tokens of every row. Which tokens depends on how attention crosses the split
(``model.context_attention``):

- ``allgather``: device ``i`` holds the ``i``-th contiguous part. Keys and values are gathered
  from every device and each device's queries attend to all of them, so causal work is uneven
  (the last device's queries see the whole row, the first's only their own part).
- ``ring``: the row is cut into ``2C`` chunks and device ``i`` holds chunks ``i`` and
  ``2C - 1 - i`` (the load-balanced causal layout): every device then has the same causal
  work at every step of the ring. The batch is permuted into that order on the way in
  (``context_batch``), its positions with it, so the model reads each token's own position.

The loss is a mean over all of a row's tokens, and a device holds only some of them:
``masked_mean`` sums over the context devices, so that averaging the devices' losses (as the
engine does over ``data`` x ``context``) gives the mean of the whole rows.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from zeroflow.backend.mesh import CONTEXT


def context_size() -> int:
    """Devices the sequence is split over where this code is traced: the ``context`` axis's
    size inside a ``shard_map`` that splits it by hand, else 1 (initialisation, evaluation,
    any plain ``jit``)."""
    mesh = jax.sharding.get_abstract_mesh()
    if CONTEXT not in mesh.axis_names or CONTEXT not in getattr(mesh, "manual_axes", ()):
        return 1
    return mesh.shape[CONTEXT]


def balanced_order(length: int, context: int) -> np.ndarray:
    """Token indices in the ring's load-balanced order: for each device ``i`` in turn, chunk
    ``i`` then chunk ``2C - 1 - i`` of ``2C`` equal chunks of a row of ``length`` tokens."""
    if length % (2 * context):
        raise ValueError(
            f"a row of {length} tokens does not split into 2 x context={context} equal chunks "
            "(context_attention='ring')"
        )
    chunks = np.arange(length).reshape(2 * context, -1)
    return np.concatenate([np.concatenate([chunks[i], chunks[-1 - i]]) for i in range(context)])


def token_index(length: int, strategy: str) -> jax.Array:
    """Where in its row each of this device's ``length`` tokens is ([length] int32)."""
    size = context_size()
    rank = jax.lax.axis_index(CONTEXT) if size > 1 else 0
    if strategy == "ring" and size > 1:
        half = length // 2
        local = jnp.arange(half)
        return jnp.concatenate([rank * half + local, (2 * size - 1 - rank) * half + local])
    return rank * length + jnp.arange(length)


def context_batch(batch, context: int, strategy: str, *, balanced: bool = True) -> dict:
    """A batch as the step splits it over ``context`` devices: token windows ``{"tokens":
    [B, S + 1]}`` become ``tokens`` and ``targets`` ``[B, S]`` with ``loss_mask``,
    ``segment_ids`` and ``positions`` (the sequence cannot be shifted across devices inside
    the step); packed batches keep their fields. For ``strategy='ring'`` (and ``balanced``)
    every field's sequence is then put in ``balanced_order``. Arrays in, arrays of the same
    kind out (numpy on the host)."""
    batch = dict(batch)
    if "targets" not in batch:
        tokens = batch.pop("tokens")
        inputs, targets = tokens[:, :-1], tokens[:, 1:]
        rows, length = inputs.shape
        ones = np.ones((rows, length), np.int32)
        positions = np.broadcast_to(np.arange(length, dtype=np.int32), (rows, length))
        batch = {
            **batch,
            "tokens": inputs,
            "targets": targets,
            "loss_mask": ones,
            "segment_ids": ones,
            "positions": np.array(positions),
        }
    if strategy != "ring" or not balanced or context == 1:
        return batch
    order = balanced_order(batch["tokens"].shape[1], context)
    return {k: v[:, order] if np.ndim(v) >= 2 else v for k, v in batch.items()}


def masked_mean(values: jax.Array, mask: jax.Array) -> jax.Array:
    """The mean of ``values`` where ``mask`` (fp32 weights, same shape) over whole rows.

    On a context device it is ``C`` times this device's share of the rows' mean (the sum of
    its terms over the count of all the rows' terms): the mean over the ``C`` devices is the
    rows' mean, and so is the gradient summed over them."""
    total, count = jnp.sum(values * mask), jnp.sum(mask)
    size = context_size()
    if size > 1:
        count = jax.lax.psum(count, CONTEXT)
        total = total * size
    return total / jnp.maximum(count, 1.0)


def row_count(mask: jax.Array) -> jax.Array:
    """``mask.sum()`` over whole rows: summed over the context devices."""
    count = jnp.sum(mask)
    return jax.lax.psum(count, CONTEXT) if context_size() > 1 else count
