"""Causal attention across the ``context`` axis: each device holds a part of every row
(``zeroflow.models.context``) and its queries must see the keys of the parts before theirs.

- ``allgather``: keys, values and their segment ids are all-gathered over ``context`` and the
  local queries attend to the whole row, masked by each token's place in it (the
  ``i``-th contiguous part on device ``i``). XLA and cuDNN take the mask as an array; the
  Pallas kernel takes the offset of the local queries as its band, one kernel per device
  (``lax.switch`` over the device's index).
- ``ring``: key/value blocks travel around the ring (``lax.ppermute``), ``C - 1`` steps, and
  the partial results are merged by their log-sum-exp (online softmax). In the load-balanced
  layout (chunks ``i`` and ``2C - 1 - i`` on device ``i``) the block of device ``j < i`` is
  seen whole by all local queries through its first chunk only, and that of ``j > i`` by the
  local second chunk only: every step is half a block's work on every device. The backward
  pass walks the ring again, with each block's key/value gradients travelling with it and
  arriving home after a last step; each block's gradient is computed from the whole
  attention's output and log-sum-exp, so no step keeps its scores.

Segment ids (packed rows) travel with their keys. Positions are applied to the queries and
keys before attention (rotary), so only the token order matters here.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Literal, NamedTuple, cast

import jax
import jax.numpy as jnp
from jax import lax

from zeroflow.backend.mesh import CONTEXT
from zeroflow.engine.plan_rules import context_attention_problem
from zeroflow.models.context import context_size, token_index
from zeroflow.models.kernels import pallas_kernel


class Block(NamedTuple):
    """Attention of some queries over one block of keys: ``forward(q, k, v, q_seg, k_seg,
    causal) -> (out, lse)`` with ``lse`` ``[B, Sq, H]`` fp32 (-inf where a row sees nothing),
    and ``backward(q, k, v, q_seg, k_seg, causal, out, lse, d_out) -> (dq, dk, dv)`` given the
    whole attention's ``out`` and ``lse``. ``causal``: token order, top-left aligned."""

    forward: Callable[..., tuple[jax.Array, jax.Array]]
    backward: Callable[..., tuple[jax.Array, jax.Array, jax.Array]]


def _scores(q, k, q_seg, k_seg, causal):
    """fp32 scaled scores [B, KV, G, Sq, Sk] and what survives the masks."""
    b, sq, h, d = q.shape
    kv = k.shape[2]
    grouped = q.reshape(b, sq, kv, h // kv, d)
    s = jnp.einsum("bqkgd,bskd->bkgqs", grouped, k, preferred_element_type=jnp.float32)
    keep = q_seg[:, :, None] == k_seg[:, None, :]
    if causal:
        keep = keep & jnp.tril(jnp.ones((sq, k.shape[1]), bool))
    return s / math.sqrt(d), keep[:, None, None]


def _xla_forward(q, k, v, q_seg, k_seg, causal):
    s, keep = _scores(q, k, q_seg, k_seg, causal)
    s = jnp.where(keep, s, -jnp.inf)
    m = jnp.max(s, axis=-1)
    m_safe = jnp.where(jnp.isfinite(m), m, 0.0)
    p = jnp.exp(s - m_safe[..., None])
    total = jnp.sum(p, axis=-1)
    out = jnp.einsum("bkgqs,bskd->bqkgd", p.astype(v.dtype), v, preferred_element_type=jnp.float32)
    out = out / jnp.maximum(jnp.moveaxis(total, 3, 1), 1e-30)[..., None]
    lse = jnp.where(total > 0, m_safe + jnp.log(jnp.maximum(total, 1e-30)), -jnp.inf)
    b, sq, h, d = q.shape
    return out.reshape(b, sq, h, d).astype(q.dtype), jnp.moveaxis(lse, 3, 1).reshape(b, sq, h)


def _xla_backward(q, k, v, q_seg, k_seg, causal, out, lse, d_out):
    b, sq, h, d = q.shape
    kv = k.shape[2]
    s, keep = _scores(q, k, q_seg, k_seg, causal)
    lse = jnp.moveaxis(lse.reshape(b, sq, kv, h // kv), 1, 3)  # [B, KV, G, Sq]
    p = jnp.where(keep, jnp.exp(s - lse[..., None]), 0.0)
    d_grouped = d_out.reshape(b, sq, kv, h // kv, d).astype(jnp.float32)
    delta = jnp.sum(d_grouped * out.reshape(d_grouped.shape).astype(jnp.float32), axis=-1)
    dp = jnp.einsum("bqkgd,bskd->bkgqs", d_grouped, v.astype(jnp.float32))
    ds = p * (dp - jnp.moveaxis(delta, 1, 3)[..., None]) / math.sqrt(d)
    grouped = q.reshape(b, sq, kv, h // kv, d).astype(jnp.float32)
    dq = jnp.einsum("bkgqs,bskd->bqkgd", ds, k.astype(jnp.float32)).reshape(q.shape)
    dk = jnp.einsum("bkgqs,bqkgd->bskd", ds, grouped)
    dv = jnp.einsum("bkgqs,bqkgd->bskd", p, d_grouped)
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)


XLA_BLOCK = Block(_xla_forward, _xla_backward)


@functools.cache
def _pallas_block() -> Block:
    forward = pallas_kernel("flash_attention_forward", "attention='pallas'")
    backward = pallas_kernel("flash_attention_backward", "attention='pallas'")

    def fwd(q, k, v, q_seg, k_seg, causal):
        out, lse = forward(q, k, v, causal=causal, segment_ids=(q_seg, k_seg))
        return out, jnp.swapaxes(lse, 1, 2)

    def bwd(q, k, v, q_seg, k_seg, causal, out, lse, d_out):
        return backward(
            q, k, v, out, jnp.swapaxes(lse, 1, 2), d_out, causal=causal, segment_ids=(q_seg, k_seg)
        )

    return Block(fwd, bwd)


def _merged(out, lse, part, part_lse):
    """Two partial attentions of the same queries over disjoint keys as one (fp32)."""
    new = jnp.logaddexp(lse, part_lse)
    safe = jnp.where(jnp.isfinite(new), new, 0.0)
    weight = lambda x: jnp.exp(x - safe)[..., None]  # noqa: E731  (exp(-inf) = 0)
    return weight(lse) * out + weight(part_lse) * part.astype(jnp.float32), new


def _shift(tree, size):
    """Each device's ``tree`` to the next device of the ring."""
    return lax.ppermute(tree, CONTEXT, [(j, (j + 1) % size) for j in range(size)])


def _varying(tree):
    """``tree`` typed as differing over ``context``, as what travels the ring comes back: a
    loop's carry keeps its type (the backward pass's residuals come without it)."""

    def one(x):
        try:
            return lax.pcast(x, CONTEXT, to="varying")
        except ValueError:  # varying already; how the aval spells it differs by jax version
            return x

    return jax.tree.map(one, tree)


def _halves(x):
    half = x.shape[1] // 2
    return x[:, :half], x[:, half:]


def _step_forward(block: Block, q, q_seg, kv, earlier):
    """This device's queries over a block from another device: ``earlier`` (that device comes
    before this one) sees its first chunk with all queries, else its whole block with the
    second query chunk. Both give ``(out, lse)`` of all queries (-inf where none was seen)."""
    k, v, k_seg = kv

    def from_earlier():
        (k1, _), (v1, _), (s1, _) = _halves(k), _halves(v), _halves(k_seg)
        out, lse = block.forward(q, k1, v1, q_seg, s1, False)
        return out.astype(jnp.float32), lse

    def from_later():
        (_, q2), (_, seg2) = _halves(q), _halves(q_seg)
        out, lse = block.forward(q2, k, v, seg2, k_seg, False)
        zeros = jnp.zeros_like(out, jnp.float32)
        return (
            jnp.concatenate([zeros, out.astype(jnp.float32)], axis=1),
            jnp.concatenate([jnp.full_like(lse, -jnp.inf), lse], axis=1),
        )

    return lax.cond(earlier, from_earlier, from_later)


def _step_backward(block: Block, q, q_seg, out, lse, d_out, kv, earlier):
    """``(dq, dk, dv)`` of one ring step (``_step_forward``'s), shaped like the whole local
    queries and the whole travelling block."""
    k, v, k_seg = kv

    def from_earlier():
        (k1, _), (v1, _), (s1, _) = _halves(k), _halves(v), _halves(k_seg)
        dq, dk, dv = block.backward(q, k1, v1, q_seg, s1, False, out, lse, d_out)
        pad = lambda g: jnp.concatenate([g, jnp.zeros_like(g)], axis=1)  # noqa: E731
        return dq.astype(jnp.float32), pad(dk.astype(jnp.float32)), pad(dv.astype(jnp.float32))

    def from_later():
        second = [_halves(x)[1] for x in (q, q_seg, out, lse, d_out)]
        q2, seg2, out2, lse2, d2 = second
        dq, dk, dv = block.backward(q2, k, v, seg2, k_seg, False, out2, lse2, d2)
        dq = jnp.concatenate([jnp.zeros_like(dq, jnp.float32), dq.astype(jnp.float32)], axis=1)
        return dq, dk.astype(jnp.float32), dv.astype(jnp.float32)

    return lax.cond(earlier, from_earlier, from_later)


def _earlier(step, size):
    """Whether the block this device holds at ring ``step`` came from a device before it."""
    rank = lax.axis_index(CONTEXT)
    return (rank - step) % size < rank


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6))
def _ring(q, k, v, q_seg, k_seg, block: Block, size: int):
    return _ring_forward(q, k, v, q_seg, k_seg, block, size)[0]


def _ring_forward(q, k, v, q_seg, k_seg, block: Block, size: int):
    out, lse = block.forward(q, k, v, q_seg, k_seg, True)
    out = out.astype(jnp.float32)

    def step(carry, i):
        out, lse, kv = carry
        kv = _shift(kv, size)
        part, part_lse = _step_forward(block, q, q_seg, kv, _earlier(i, size))
        out, lse = _merged(out, lse, part, part_lse)
        return (out, lse, kv), None

    carry = _varying((out, lse, (k, v, k_seg)))
    (out, lse, _), _ = lax.scan(step, carry, jnp.arange(1, size))
    out = out.astype(q.dtype)
    return out, (q, k, v, q_seg, k_seg, out, lse)


def _ring_backward(block: Block, size: int, residuals, d_out):
    q, k, v, q_seg, k_seg, out, lse = residuals
    dq, dk, dv = block.backward(q, k, v, q_seg, k_seg, True, out, lse, d_out)
    grads = (dq.astype(jnp.float32), dk.astype(jnp.float32), dv.astype(jnp.float32))

    def step(carry, i):
        dq, kv, d_kv = carry
        kv, d_kv = _shift((kv, d_kv), size)
        g_q, g_k, g_v = _step_backward(block, q, q_seg, out, lse, d_out, kv, _earlier(i, size))
        return (dq + g_q, kv, (d_kv[0] + g_k, d_kv[1] + g_v)), None

    carry = _varying((grads[0], (k, v, k_seg), grads[1:]))
    (dq, _, d_kv), _ = lax.scan(step, carry, jnp.arange(1, size))
    dk, dv = _shift(d_kv, size)  # one more step: each block's gradient is home
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None, None


_ring.defvjp(_ring_forward, _ring_backward)


def _allgather(q, k, v, q_seg, k_seg, implementation: str, window: int):
    """Local queries over the whole row's keys and values, gathered from every device."""
    size, length = context_size(), q.shape[1]
    k, v, k_seg = (lax.all_gather(x, CONTEXT, axis=1, tiled=True) for x in (k, v, k_seg))
    if implementation == "pallas":
        kernel = functools.partial(
            pallas_kernel("flash_attention", "attention='pallas'"),
            q,
            k,
            v,
            causal=False,
            segment_ids=(q_seg, k_seg),
        )
        # Query i of device r is token r * length + i: it sees keys up to that, a band the
        # kernel takes as a static window (and skips the blocks beyond it).
        branches = [functools.partial(kernel, window=(k.shape[1], r * length)) for r in range(size)]
        return lax.switch(lax.axis_index(CONTEXT), [lambda b=b: b() for b in branches])
    query_at = token_index(length, "allgather")
    key_at = jnp.arange(k.shape[1])
    keep = (key_at[None, :] <= query_at[:, None]) & (q_seg[:, :, None] == k_seg[:, None, :])
    if window:
        keep = keep & (query_at[:, None] - key_at[None, :] < window)
    kind = cast(Literal["xla", "cudnn"], implementation)  # pallas returned above
    return jax.nn.dot_product_attention(q, k, v, mask=keep[:, None], implementation=kind)


def context_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    strategy: str,
    implementation: str,
    window: int = 0,
    segment_ids: jax.Array | None = None,
) -> jax.Array:
    """Causal attention of this device's queries ``[B, S/C, H, D]`` over the whole rows, whose
    keys and values ``[B, S/C, KV, D]`` are split over ``context`` as ``strategy`` lays them
    out (``zeroflow.models.context``). ``segment_ids`` ``[B, S/C]``: packed rows."""
    check_supported(strategy, implementation, window)
    if segment_ids is None:
        segment_ids = jnp.zeros(q.shape[:2], jnp.int32)
    segment_ids = segment_ids.astype(jnp.int32)
    if strategy == "allgather":
        return _allgather(q, k, v, segment_ids, segment_ids, implementation, window)
    block = _pallas_block() if implementation == "pallas" else XLA_BLOCK
    return _ring(q, k, v, segment_ids, segment_ids, block, context_size())


def check_supported(strategy: str, implementation: str, window: int) -> None:
    """One line where a strategy cannot run with an attention implementation."""
    problem = context_attention_problem(strategy, implementation, window)
    if problem:
        raise ValueError(problem)
