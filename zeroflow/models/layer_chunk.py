"""A decoder layer in position chunks (``model.layer_chunk``), with its own backward pass.

For a row of a million tokens the plain layer's backward pass holds whole-row copies of every
norm output, MLP intermediate and gradient. ``chunked_block`` runs everything but the attention
core a chunk of positions at a time and writes its vector-Jacobian product by hand, so only the
layer input, q, k, v, the attention output and one key/value head group's gradients are ever
whole-row. The model supplies its parts (``Pieces``: norms, projections, attention, MLP) as
functions of the block's params; this module owns the loops and the backward order.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from zeroflow.autocast import fp8_saved
from zeroflow.config.schema import ModelConfig
from zeroflow.util.settings import FP8_INPUT_REMATS


def chunk_of(tree, i, chunk: int):
    """Positions ``[i * chunk, (i + 1) * chunk)`` of every [B, S, ...] array of ``tree``."""
    return jax.tree.map(lambda a: lax.dynamic_slice_in_dim(a, i * chunk, chunk, axis=1), tree)


def _put(whole, part, i, chunk: int):
    return lax.dynamic_update_slice_in_dim(whole, part.astype(whole.dtype), i * chunk, axis=1)


def _padded(part, seq: int):
    return jnp.pad(part, [(0, 0), (0, seq - part.shape[1])] + [(0, 0)] * (part.ndim - 2))


def chunk_loop(step: Callable, chunk: int, seq: int, carry):
    """``step(i, carry) -> (parts, sums, carry)`` for each chunk ``i`` of ``seq`` positions:
    ``parts`` (a pytree of [B, chunk, ...] arrays) written into whole-row arrays, ``sums``
    (a pytree) summed in fp32, ``carry`` threaded through; returns the three. The first chunk
    runs before the loop and its parts, padded, are the whole-row arrays' start: no zeroed
    buffer that XLA could share between two loops and keep alive from one to the other."""
    parts, sums, carry = step(0, carry)
    state = (
        jax.tree.map(lambda p: _padded(p, seq), parts),
        jax.tree.map(lambda s: s.astype(jnp.float32), sums),
        carry,
    )

    def body(i, state):
        wholes, summed, carry = state
        parts, sums, carry = step(i, carry)
        wholes = jax.tree.map(lambda w, p: _put(w, p, i, chunk), wholes, parts)
        summed = jax.tree.map(lambda a, s: a + s.astype(jnp.float32), summed, sums)
        return wholes, summed, carry

    return lax.fori_loop(1, seq // chunk, body, state)


def chunks_layer(cfg: ModelConfig, seq: int) -> bool:
    """Whether a block of ``seq`` positions runs chunked (``model.layer_chunk``)."""
    if not 0 < cfg.layer_chunk < seq:
        return False
    if seq % cfg.layer_chunk:
        raise ValueError(
            f"model.layer_chunk={cfg.layer_chunk} must divide the row's {seq} positions "
            "(or be 0, or at least the row)"
        )
    return True


class Pieces(NamedTuple):
    """The chunked block's parts as functions of the block's params: ``read(x, saved, i)`` (the
    input chunk ``i`` its branches read), ``qkv(p, read_c, i)``, ``attend(p, q, k, v)``,
    ``branches(p, out_c, read_c) -> (attn_out, mlp_out)`` and its two halves, the output
    projection ``project_out(p, out_c)`` and ``after_projection(p, projected_c, read_c)``."""

    read: Callable
    qkv: Callable
    attend: Callable
    branches: Callable
    project_out: Callable
    after_projection: Callable


def chunked_block(
    cfg: ModelConfig, pieces: Callable, params, x, segment_ids, positions, layer
) -> jax.Array:
    """``Block`` with ``params`` (its own) on ``x`` [B, S, embed], everything but the attention
    core in ``cfg.layer_chunk``-position chunks: the norms, the q/k/v and output projections,
    the MLP and the residual adds. Its own backward pass (remat by hand, ``_chunked_backward``)
    recomputes q, k, v a chunk at a time and the attention over the whole row per key/value
    head group, goes back through the MLP chunks adding each chunk's input gradient into the
    buffer of the incoming one, then through the output projection and the attention one head
    group at a time, then through the q/k/v chunks. For the whole row it holds at most the
    input's gradient, the input (or its e4m3 bytes), q, k, v and the attention output, and one
    head group's gradients; norm outputs, rotary tables and MLP intermediates live one chunk at
    a time. Parameter gradients are summed over the chunks in fp32. Same values as the block in
    one piece, the residual stream added in the same order. ``pieces((positions, segment_ids,
    layer))`` gives the model's parts (``Pieces``) for this row."""
    if positions is None:
        positions = jnp.arange(x.shape[1], dtype=jnp.int32)[None]
    fp8 = cfg.remat_dtype == "fp8" and cfg.remat in FP8_INPUT_REMATS
    # FP8 layer inputs: the branches read the e4m3 bytes and one scale, all the remat policy
    # keeps of the layer (layer_input_read's rounding, in pieces).
    saved = fp8_saved.fp8_parts(x) if fp8 else None
    chunk, seq, shape, dtype = cfg.layer_chunk, x.shape[1], x.shape, x.dtype

    @jax.custom_vjp
    def layer_fn(params, x, saved, context):
        parts = pieces(context)
        qs, ks, vs = _qkv_rows(parts, params, x, saved, chunk, seq)
        outs = tuple(map(functools.partial(parts.attend, params), qs, ks, vs))

        def step(i, carry):
            attn_out, mlp_out = parts.branches(
                params, _joined_heads(outs, i, chunk), parts.read(x, saved, i)
            )
            return chunk_of(x, i, chunk) + attn_out + mlp_out, {}, carry

        return chunk_loop(step, chunk, seq, None)[0]

    def layer_fwd(params, x, saved, context):
        kept = None if fp8 else x  # FP8 inputs: the backward pass reads the bytes only
        return layer_fn(params, x, saved, context), (params, kept, saved, context)

    def layer_bwd(residuals, d_y):
        return _chunked_backward(cfg, pieces, residuals, d_y, shape, dtype)

    layer_fn.defvjp(layer_fwd, layer_bwd)
    return layer_fn(params, x, saved, (positions, segment_ids, layer))


def _qkv_rows(parts: Pieces, params, x, saved, chunk: int, seq: int):
    """q, k, v of the whole row, computed a chunk at a time, each as a tuple of one array per
    key/value head and the query heads that share it (``_by_group``)."""

    def with_kv(i, carry):
        q, k, v = parts.qkv(params, parts.read(x, saved, i), i)
        groups = k.shape[2]
        return (_by_group(q, groups), _by_group(k, groups), _by_group(v, groups)), {}, carry

    return chunk_loop(with_kv, chunk, seq, None)[0]


def _by_group(t: jax.Array, groups: int) -> tuple:
    """[B, S, heads, D] as ``groups`` arrays [B, S, heads / groups, D]: the attention of one
    key/value head group needs nothing of the others, and each group's arrays can be freed
    as soon as its backward pass is done."""
    size = t.shape[2] // groups
    return tuple(t[:, :, g * size : (g + 1) * size] for g in range(groups))


def _joined_heads(groups: tuple, i, chunk: int) -> jax.Array:
    """Chunk ``i`` of every group's array (``_by_group``), the heads back together."""
    return jnp.concatenate(chunk_of(groups, i, chunk), axis=2)


def _chunked_backward(cfg, pieces: Callable, residuals, d_y, shape, dtype):
    """``chunked_block``'s vector-Jacobian product: ``(d_params, d_x, None, None)``. The
    attention runs per key/value head group (``_by_group``): each group's q and output are
    freed once its backward pass is done. The output projection's backward pass runs per group
    on the whole row, from the gradient of its output, which without post-norms is the input's
    gradient itself (``x + attn_out + mlp(norm(read + attn_out))``: both receive the incoming
    gradient plus the MLP input's), so no gradient of the attention output is held for all
    heads at once."""
    params, kept, saved, context = residuals
    parts, seq, chunk = pieces(context), shape[1], cfg.layer_chunk
    x = kept if kept is not None else jax.ShapeDtypeStruct(shape, dtype)
    qs, ks, vs = _qkv_rows(parts, params, x, saved, chunk, seq)
    outs, attend_vjps = zip(
        *(jax.vjp(functools.partial(parts.attend, params), *qkv) for qkv in zip(qs, ks, vs))
    )
    tail_params, out_params, qkv_params = _split_params(params)

    def through_branches(i, d_x):
        projected = parts.project_out(params, _joined_heads(outs, i, chunk))
        tail_vjp = jax.vjp(parts.after_projection, tail_params, projected, parts.read(x, saved, i))[
            1
        ]
        d_y_c = chunk_of(d_x, i, chunk)  # not yet updated: the incoming gradient
        d_params, d_projected, d_read = tail_vjp((d_y_c, d_y_c))
        d_x = _put(d_x, d_y_c + d_read, i, chunk)
        return (d_projected if cfg.post_norms else ()), d_params, d_x

    # The input's gradient starts as the incoming one (the residual add), which the loop reads
    # from its own buffer, chunk by chunk before adding to it: one whole-row gradient, not two.
    d_projected, summed, d_x = chunk_loop(through_branches, chunk, seq, d_y)
    d_tail = jax.tree.map(lambda a, p: a.astype(p.dtype), summed, tail_params)
    d_out_params, d_qkv_rows = _attention_backward(
        out_params, outs, attend_vjps, d_projected if cfg.post_norms else d_x
    )

    def through_qkv(i, d_x):
        qkv_vjp = jax.vjp(lambda p, r: parts.qkv(p, r, i), qkv_params, parts.read(x, saved, i))[1]
        d_params, d_read = qkv_vjp(tuple(_joined_heads(d, i, chunk) for d in d_qkv_rows))
        return (), d_params, _put(d_x, chunk_of(d_x, i, chunk) + d_read, i, chunk)

    _, summed, d_x = chunk_loop(through_qkv, chunk, seq, d_x)
    d_qkv = jax.tree.map(lambda a, p: a.astype(p.dtype), summed, qkv_params)
    return _merged(_merged(d_tail, d_out_params), d_qkv), d_x, None, None


def _attention_backward(out_params, outs, attend_vjps, d_projected):
    """The output projection's and the attention's backward passes, one key/value head group
    at a time, from ``d_projected`` [B, S, embed], the gradient of the projection's output:
    ``(d_out_params, (d_qs, d_ks, d_vs))``, the latter tuples of one array per group."""
    proj = out_params["attn"]["out"]
    kernel = proj["kernel"]  # [heads, head_dim, embed]
    size = kernel.shape[0] // len(outs)
    d_kernels, grads = [], []
    for g, (out_g, attend_vjp) in enumerate(zip(outs, attend_vjps)):
        kernel_g = kernel[g * size : (g + 1) * size]
        d_out_g = jnp.einsum("bse,hde->bshd", d_projected.astype(kernel.dtype), kernel_g)
        d_kernels.append(
            jnp.einsum(
                "bshd,bse->hde",
                out_g.astype(kernel.dtype),
                d_projected.astype(kernel.dtype),
                preferred_element_type=jnp.float32,
            ).astype(kernel.dtype)
        )
        grads.append(attend_vjp(d_out_g.astype(out_g.dtype)))
        # The next group starts once this one is done: XLA would otherwise interleave them and
        # hold every group's output and gradients together.
        d_projected, (d_kernels[-1], grads[-1]) = lax.optimization_barrier(
            (d_projected, (d_kernels[-1], grads[-1]))
        )
    d_proj = {"kernel": jnp.concatenate(d_kernels, axis=0)}
    if "bias" in proj:
        d_proj["bias"] = d_projected.sum((0, 1), dtype=jnp.float32).astype(proj["bias"].dtype)
    return {"attn": {"out": d_proj}}, tuple(zip(*grads))


QKV_PARAMS = ("query", "key", "value", "query_norm", "key_norm")
"The attention's weights the chunked block's q/k/v part reads (the rest: its output part)."


def _split_params(params) -> tuple[dict, dict, dict]:
    """A block's params as the chunked block's backward pass reads them: (the MLP and the
    norms after the attention; the output projection; the input norm and q/k/v projections)."""
    attn = params["attn"]
    qkv = {"attn_norm": params["attn_norm"], "attn": {k: attn[k] for k in attn if k in QKV_PARAMS}}
    tail = {k: v for k, v in params.items() if k not in ("attn_norm", "attn")}
    out = {"attn": {k: attn[k] for k in attn if k not in QKV_PARAMS}}
    return tail, out, qkv


def _merged(a: dict, b: dict) -> dict:
    """Two nested dicts with disjoint leaves as one."""
    out = dict(a)
    for key, value in b.items():
        out[key] = _merged(out[key], value) if key in out else value
    return out
