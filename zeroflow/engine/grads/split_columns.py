"""A matmul with a weight split over ``data`` by its output columns, computed where the columns
are, when the activations are smaller than the weight.

A vocabulary head (``x @ W``, ``W`` of width x vocabulary) can be the largest weight of a model
(4096 x 128256 at Llama-3-8B: 1 GB in bf16) while each device's activations are small (one
2048-token sequence: 16 MB). Fetched on use, the whole head is gathered for the forward pass
and again for the backward pass, and its whole gradient is made before it is reduced. Where
the head is split by columns, each device can instead multiply every device's activations
(all-gathered) by its own columns, and an all-to-all hands each device its rows of the result
in column order. The backward pass sends the output's cotangent back the same way: each
device's columns' gradient is then complete on that device (the sum over every device's rows,
in fp32), nothing is reduced, and the input's cotangent is the sum over devices of each
device's columns' share (a reduce-scatter of activations). What moves is activations and
outputs, not the weight; ``moves_less`` decides per use.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from zeroflow.backend.mesh import zero_axes


def applies(eqn, data_aval, weight_aval, dim: int, n: int) -> bool:
    """``eqn`` is ``data @ weight`` (``dot_general``, data first) contracting data's last axis
    with the weight's first, the weight split along its last (output) axis ``dim``, data with a
    leading axis of rows; and moving activations costs fewer bytes than gathering the weight."""
    if eqn.primitive.name != "dot_general" or len(weight_aval.shape) != 2 or dim != 1:
        return False
    (lhs_c, rhs_c), (lhs_b, rhs_b) = eqn.params["dimension_numbers"]
    if lhs_b or rhs_b or tuple(lhs_c) != (len(data_aval.shape) - 1,) or tuple(rhs_c) != (0,):
        return False
    if len(data_aval.shape) < 2:
        return False
    return moves_less(data_aval, eqn.outvars[0].aval, weight_aval, n)


def moves_less(data_aval, out_aval, weight_aval, n: int) -> bool:
    """Every device's activations plus this device's output, against the whole weight."""
    size = lambda a: a.size * jnp.dtype(a.dtype).itemsize  # noqa: E731
    return n * size(data_aval) + size(out_aval) < size(weight_aval)


def _local_product(x, shard, dtype, out_dtype):
    every = jax.lax.all_gather(x, zero_axes(), axis=0, tiled=True)
    return every, jnp.matmul(every, shard.astype(dtype)).astype(out_dtype)


def _to_rows(y_local, size):
    """Each device's rows of every device's columns, in column order, cut to ``size``."""
    y = jax.lax.all_to_all(y_local, zero_axes(), 0, y_local.ndim - 1, tiled=True)
    return y[..., :size]


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _matmul(x, shard, stand_in, dtype, out_dtype, size):
    return _to_rows(_local_product(x, shard, dtype, out_dtype)[1], size)


def _matmul_fwd(x, shard, stand_in, dtype, out_dtype, size):
    return _matmul(x, shard, stand_in, dtype, out_dtype, size), (x, shard, stand_in)


def _matmul_bwd(dtype, out_dtype, size, residuals, cotangent):
    x, shard, stand_in = residuals
    every = jax.lax.all_gather(x, zero_axes(), axis=0, tiled=True)
    n = every.shape[0] // x.shape[0]
    padded = jnp.pad(cotangent, [(0, 0)] * (cotangent.ndim - 1) + [(0, n * shard.shape[-1] - size)])
    d_local = jax.lax.all_to_all(
        padded.astype(dtype), zero_axes(), cotangent.ndim - 1, 0, tiled=True
    )
    rows = every.reshape(-1, every.shape[-1]).astype(dtype)
    d_weight = jnp.matmul(rows.T, d_local.reshape(-1, d_local.shape[-1])).astype(jnp.float32)
    d_every = jnp.matmul(d_local, shard.astype(dtype).T)
    d_x = jax.lax.psum_scatter(d_every, zero_axes(), scatter_dimension=0, tiled=True)
    return d_x.astype(x.dtype), jnp.zeros_like(shard), d_weight.astype(stand_in.dtype)


_matmul.defvjp(_matmul_fwd, _matmul_bwd)


def matmul(x, shard, stand_in, dtype, out_dtype, size: int):
    """``x @ W`` in ``out_dtype`` for this device's rows ``x`` (leading axis), ``W`` (``size``
    columns, stored padded to N x the shard's) split by columns over ``data``, this device's
    ``shard`` cast to ``dtype``. The weight's gradient goes to ``stand_in`` (fp32, the shard's
    shape) complete; ``stand_in=None``: a frozen weight."""
    if stand_in is None:
        return _to_rows(_local_product(x, jax.lax.stop_gradient(shard), dtype, out_dtype)[1], size)
    return _matmul(x, shard, stand_in, jnp.dtype(dtype), jnp.dtype(out_dtype), size)
