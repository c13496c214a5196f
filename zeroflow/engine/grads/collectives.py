"""The per-device collectives of the ZeRO gradient computation, some as differentiable functions.

Each runs inside ``shard_map`` over the ``data`` axis (with ``context``, over both:
``zeroflow.backend.mesh.zero_axes``):
- ``all_gather`` / ``reduce_scatter``: a stage-3 weight shard made whole, a gradient summed
  over devices into this device's slice (``sources.Stage3Collectives`` picks these or their
  ZeRO++ variants; ``sources.gather_weight`` makes the pair one differentiable fetch);
- ``scatter_grad_on_use``: a whole (stage-2) weight passed through unchanged whose gradient is
  reduce-scattered the moment the backward pass has produced it, so the full-size local
  gradient of a leaf is a transient, never held for all leaves at once;
- ``stream_in``: one layer of a host-resident weight copied to the device.

Gradients are reduced in fp32 whatever the compute dtype: a sum over many devices can overflow
bf16/fp16's range and rounds away their low bits (XLA:CPU also rejects a bf16 reduce-scatter).
The full-size local gradient of one leaf is therefore fp32 for the moment of its reduction.

A leaf stored padded (``zeroflow.engine.padding``: its dimension does not divide by N) is gathered
and then cut to its own size, and its gradient is padded with zeros before the reduce-scatter;
the loss never sees the padding.

The differentiable ones are ``custom_jvp``s whose tangent map is linear in a stand-in (zeros
shaped like the gradient that leaves the backward pass, fp32 where it is reduced; never read, so XLA drops
it) and whose primal is plain jax: so ``jax.checkpoint`` sees the gather or copy and can
recompute it (``save_all_but_fetched``), and the gradient comes from transposing the tangent
map (an all-gather transposes to the reduce-scatter, in the tangent's fp32).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from zeroflow.backend.mesh import zero_axes, zero_axis_names
from zeroflow.engine import offload
from zeroflow.engine.hosts import index_groups
from zeroflow.engine.padding import cut_to, pad_to


def varying(x):
    """Mark ``x`` as differing across the ZeRO axes (``data``, and ``context`` where the mesh
    has one) so its gradient stays local (no implicit psum) where a ``shard_map`` checks
    varying axes; the step's does not (``check_vma=False``: there jax leaves ``x`` as it is).
    Outside ``shard_map`` (the one-device step) there is no ``data`` axis: ``x`` as it is."""
    for axis in zero_axis_names():  # one at a time: x may vary over one of them already
        try:
            x = jax.lax.pcast(x, axis, to="varying")
        except ValueError:  # already varying; how the aval spells it differs by jax version
            pass
        except NameError:  # unbound axis name: not inside shard_map over data
            return x
    return x


def all_gather(
    shard, dim: int, dtype, size: int | None = None, groups=None, *, sliced: bool = False
):
    """The whole weight in ``dtype`` from this device's ``shard`` (split along ``dim``), cut to
    ``size`` entries along ``dim`` when it is stored padded. ``groups``: ``axis_index_groups``
    of ``data`` that each hold a whole copy (hpZ: each host's devices), None: all devices.

    ``sliced``: ``shard`` is one iteration's slice of a stack a loop walks through. Split along
    a dimension other than its first, it is gathered on a new leading (device) axis, which is
    moved into place afterwards: gathered along ``dim`` itself, XLA:GPU lays the operand out
    with ``dim`` major, and for a loop's slice it does that to the whole stack of shards, once,
    outside the loop (a second copy of the stack, kept for the whole step). Moved into place,
    only the one gathered slice is copied."""
    if sliced and dim > 0:
        parts = jax.lax.all_gather(
            shard.astype(dtype),
            zero_axes(),
            axis=0,
            tiled=False,
            axis_index_groups=index_groups(groups),
        )
        whole = jnp.moveaxis(parts, 0, dim).reshape(
            *shard.shape[:dim], parts.shape[0] * shard.shape[dim], *shard.shape[dim + 1 :]
        )
    else:
        whole = jax.lax.all_gather(
            shard.astype(dtype),
            zero_axes(),
            axis=dim,
            tiled=True,
            axis_index_groups=index_groups(groups),
        )
    return whole if size is None else cut_to(whole, dim, size)


def reduce_scatter(grad, dim: int, padded: int | None = None, dtype=jnp.float32):
    """This device's slice (along ``dim``) of the sum over devices of ``grad``, summed in
    ``dtype`` (fp32: exact for half-precision gradients; the compute dtype moves half the bytes,
    ``Precision.reduce``) and returned in fp32; with ``padded``, ``grad`` is first padded with
    zeros to that many entries along ``dim``."""
    grad = grad.astype(dtype)
    if padded is not None:
        grad = pad_to(grad, dim, padded)
    summed = jax.lax.psum_scatter(grad, zero_axes(), scatter_dimension=dim, tiled=True)
    return summed.astype(jnp.float32)


def gathered_tangent(
    tangent,
    dim: int,
    dtype,
    size: int | None = None,
    sliced: bool = False,
    reduce_dtype=jnp.float32,
):
    # Linear in ``tangent`` (fp32): its transpose pads the cotangent with zeros (the transpose
    # of the cut) and reduce-scatters it in ``reduce_dtype`` (see ``reduce_scatter``).
    return all_gather(tangent.astype(reduce_dtype), dim, reduce_dtype, size, sliced=sliced).astype(
        dtype
    )


@functools.partial(jax.custom_jvp, nondiff_argnums=(2, 3))
def scatter_grad_on_use(weight, stand_in, dim: int, reduce_dtype=jnp.float32):
    """``weight`` unchanged; its gradient, reduce-scattered along ``dim``, goes to ``stand_in``.

    ``stand_in`` is an fp32 array of zeros shaped like this device's shard of ``weight`` (of its
    padded form, when it is stored padded), never read: differentiating it instead of ``weight``
    gives the gradient the sharded type, so the reduce-scatter runs inside the backward pass as
    soon as this leaf's gradient is complete
    (ZeRO-2), and the gradient that leaves the backward pass is already 1/N of the leaf.
    """
    del stand_in, dim, reduce_dtype
    return weight


@scatter_grad_on_use.defjvp
def _scatter_jvp(dim, reduce_dtype, primals, tangents):
    (weight, _), (_, d_stand_in) = primals, tangents
    return weight, gathered_tangent(
        d_stand_in, dim, weight.dtype, weight.shape[dim], reduce_dtype=reduce_dtype
    )


@jax.custom_jvp
def stream_in(host, delta):
    """``host`` (one layer's slice, in host memory) copied to the device as ``delta.dtype``.

    The gradient goes to ``delta``, a device array of zeros standing in for the weight: jax
    types a host value's cotangent as host memory, so differentiating ``host`` itself would
    ship every layer's gradient to the host and mix memory spaces in the backward pass. The
    forward never reads ``delta``, so XLA drops it; only its gradient, built one layer at a
    time on the device like any other weight's, is used.
    """
    return offload.to_device(varying(host)).astype(delta.dtype)


@stream_in.defjvp
def _stream_in_jvp(primals, tangents):
    (host, delta), (_, d_delta) = primals, tangents
    return offload.to_device(varying(host)).astype(delta.dtype), d_delta


_FETCHING = frozenset({"all_gather", "device_put", "pcast", "pvary"})
# Layout changes: a fetched weight is often one of these away from its gather (the sliced
# gather's moveaxis and reshape, the cut of a padded weight). Saving their output would keep
# the fetched weight after all; not saving it costs nothing, as their input (the same bytes)
# is saved instead wherever it is saveable.
_RELAID = frozenset({"transpose", "reshape", "slice"})


def save_all_but_fetched(prim, *_, **__) -> bool:
    """A ``jax.checkpoint`` policy: save whatever the backward pass needs, except weights being
    fetched (all-gathered, copied in from the host) and layout changes of them. Those are
    fetched again in the backward pass, from the shard or host slice the forward pass read, so
    a scanned layer stack keeps no whole per-layer weight for the backward pass."""
    return prim.name not in _FETCHING and prim.name not in _RELAID


_FLIP = 0x8000


def as_words(x, move):
    """``move(x)`` (a gather or reshard) applied to a bf16/fp16 array's raw 16-bit words, so
    that the backend moves 2 bytes per element. The words' sign bit is flipped on the way
    there and back: XLA folds a bare pair of bitcasts around a collective and then, on CPU,
    widens the collective to fp32 again."""
    if not (jnp.issubdtype(x.dtype, jnp.floating) and jnp.dtype(x.dtype).itemsize == 2):
        return move(x)
    words = jax.lax.bitcast_convert_type(x, jnp.uint16) ^ jnp.uint16(_FLIP)
    return jax.lax.bitcast_convert_type(move(words) ^ jnp.uint16(_FLIP), x.dtype)
