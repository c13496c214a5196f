"""Rows of a table split over ``data`` by its rows, looked up without gathering the table.

An embedding lookup (``table[tokens]``) reads a few thousand rows of a table that can be a
large part of the model (a Llama-3 vocabulary: 128K rows, 1 GB in bf16 at 8B). Fetched on use
like any weight, the whole table is all-gathered before the step's first layer, with nothing
to overlap it, and its gradient is made whole (a table-sized buffer, scatter-added into)
before it is reduce-scattered. Split by rows, each device can instead serve every device's
lookups from its own rows: the tokens of all devices are all-gathered (a few KB), each device
takes the rows it holds (zeros elsewhere) and the results are reduce-scattered back to the
devices whose tokens they are, exactly one device contributing each row. The backward pass
all-gathers the rows' cotangents and each device scatter-adds the ones that fall in its rows
into its own shard's gradient, in fp32: no reduction, nothing table-sized. What moves is the
looked-up rows (tokens x width, both ways), not the table.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from zeroflow.backend.mesh import zero_axes


def is_row_lookup(eqn) -> bool:
    """``eqn`` is a ``gather`` of whole rows of a rank-2 operand by an index array whose last
    axis holds one row index (what ``table[tokens]`` and ``jnp.take(table, tokens, 0)`` trace
    to), with a leading axis to split."""
    if eqn.primitive.name != "gather" or len(eqn.invars) != 2:
        return False
    table, index = (v.aval for v in eqn.invars)
    dn = eqn.params["dimension_numbers"]
    return (
        len(table.shape) == 2
        and len(index.shape) >= 2
        and index.shape[-1] == 1
        and tuple(dn.collapsed_slice_dims) == (0,)
        and tuple(dn.start_index_map) == (0,)
        and tuple(dn.offset_dims) == (len(index.shape) - 1,)
        and not getattr(dn, "operand_batching_dims", ())
        and tuple(eqn.params["slice_sizes"]) == (1, table.shape[1])
    )


def _positions(shard, index):
    """Every device's row indices, as positions in this device's rows, and which fall there."""
    every = jax.lax.all_gather(index[..., 0], zero_axes(), axis=0, tiled=True)
    rows = shard.shape[0]
    position = every - jax.lax.axis_index(zero_axes()) * rows
    held = (position >= 0) & (position < rows)
    return jnp.clip(position, 0, rows - 1), held


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _lookup(shard, stand_in, index, dtype):
    return _forward(shard, index, dtype)


def _forward(shard, index, dtype):
    position, held = _positions(shard, index)
    rows = jnp.take(shard.astype(dtype), position, axis=0)
    rows = jnp.where(held[..., None], rows, jnp.zeros((), dtype))
    return jax.lax.psum_scatter(rows, zero_axes(), scatter_dimension=0, tiled=True)


def _lookup_fwd(shard, stand_in, index, dtype):
    return _forward(shard, index, dtype), (shard, stand_in, index)


def _lookup_bwd(dtype, residuals, cotangent):
    shard, stand_in, index = residuals
    position, held = _positions(shard, index)
    every = jax.lax.all_gather(cotangent, zero_axes(), axis=0, tiled=True).astype(jnp.float32)
    every = jnp.where(held[..., None], every, 0.0)
    grad = jnp.zeros(stand_in.shape, jnp.float32).at[position].add(every)
    return jnp.zeros_like(shard), grad.astype(stand_in.dtype), None


_lookup.defvjp(_lookup_fwd, _lookup_bwd)


def lookup(shard, stand_in, index, dtype):
    """``table[index[..., 0]]`` in ``dtype`` for this device's rows of ``index``, where this
    device holds rows ``[i * R, (i + 1) * R)`` of the table as ``shard`` (``R`` rows; rows
    past the table's own length, padding, are never indexed). The gradient goes to
    ``stand_in`` (fp32, shaped like the shard) as the sum over every device's lookups of this
    device's rows; ``shard`` gets none. ``stand_in=None``: a frozen table, no gradient."""
    dtype = jnp.dtype(dtype)
    if stand_in is None:
        return _forward(jax.lax.stop_gradient(shard), index, dtype)
    return _lookup(shard, stand_in, index, dtype)
