"""Cross-entropy of a linear output layer that never holds the ``[tokens, vocab]`` logits.

A language model's last layer is ``logits = hidden @ w_out``; at long sequences and large
vocabularies those logits (and their softmax and gradient, each as large) are the largest
arrays of the step: 128K tokens x 128K vocabulary is 64 GB in fp32. Here the loss runs over
tiles of ``token_chunk`` positions x ``vocab_chunk`` vocabulary entries: the forward pass keeps
a running log-sum-exp per token, and its own backward pass (``jax.custom_vjp``) recomputes each
tile's logits and adds that tile's share to the gradients of the hidden states and of the
output projection, accumulated in fp32. At most one tile of logits exists at a time, so the
peak grows with neither the vocabulary nor the sequence.

Chunks need not divide the sizes: the last chunk of each axis starts early enough to fit
(``size - chunk``) and ignores the entries an earlier chunk already counted, so no input is
padded or copied.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

F32 = jnp.float32
MAX_VOCAB = 2**24
"Labels travel as fp32, which holds every integer up to this exactly."


def chunked_cross_entropy(
    hidden: jax.Array,
    w_out: jax.Array,
    labels: jax.Array,
    *,
    weights: jax.Array | None = None,
    token_chunk: int = 1024,
    vocab_chunk: int = 8192,
    vocab_axis: int = 1,
) -> jax.Array:
    """Mean cross-entropy in nats (fp32) of ``softmax(hidden @ w_out)`` against ``labels``,
    equal to the plain loss on the full logits, without ever holding them.

    ``hidden`` [..., seq, embed]; ``w_out`` [embed, vocab] (``vocab_axis=1``) or [vocab, embed]
    (``vocab_axis=0``: a tied input embedding); ``labels`` [..., seq] integers in [0, vocab).
    ``weights`` (shape of ``labels``) weight each token: the mean is then
    ``sum(loss * weights) / max(sum(weights), 1)``, so weight 0 masks a token out (its label may
    then be anything). Each tile of logits is every row of the leading axes x ``token_chunk``
    positions x ``vocab_chunk`` vocabulary entries, in fp32.
    """
    losses, _ = chunked_token_losses(
        hidden,
        w_out,
        labels,
        token_chunk=token_chunk,
        vocab_chunk=vocab_chunk,
        vocab_axis=vocab_axis,
    )
    if weights is None:
        return losses.mean()
    if jnp.shape(weights) != jnp.shape(labels):
        raise ValueError(
            f"weights shape {jnp.shape(weights)} must equal the labels shape {jnp.shape(labels)}"
        )
    weights = weights.astype(F32)
    return (losses * weights).sum() / jnp.maximum(weights.sum(), 1.0)


def chunked_token_losses(
    hidden: jax.Array,
    w_out: jax.Array,
    labels: jax.Array,
    *,
    token_chunk: int = 1024,
    vocab_chunk: int = 8192,
    vocab_axis: int = 1,
) -> tuple[jax.Array, jax.Array]:
    """``(losses, predictions)``, both shaped like ``labels``: each token's cross-entropy (fp32,
    differentiable in ``hidden`` and ``w_out``) and the arg-max of its logits (int32, the first
    one on ties, as ``jnp.argmax``). Arguments as ``chunked_cross_entropy``."""
    _check(hidden, w_out, labels, token_chunk, vocab_chunk, vocab_axis)
    seq, width = hidden.shape[-2:]
    rows = hidden.reshape(-1, seq, width)
    tc = min(token_chunk, seq)
    vc = min(vocab_chunk, w_out.shape[vocab_axis])
    # The labels enter the custom_vjp as fp32 (exact below 2**24): inside shard_map the zero
    # cotangent jax makes for an integer input lacks the input's manual-axis type and fails
    # jax's own cotangent check, while a float one is made with zeros_like and keeps it.
    losses, predictions = _token_losses(
        tc, vc, vocab_axis, *_one_type(rows, w_out, labels.reshape(-1, seq).astype(F32))
    )
    return losses.reshape(labels.shape), predictions.reshape(labels.shape)


def _check(hidden, w_out, labels, token_chunk, vocab_chunk, vocab_axis) -> None:
    """One readable line for inputs the loss cannot take."""
    for name, chunk in (("token_chunk", token_chunk), ("vocab_chunk", vocab_chunk)):
        if not isinstance(chunk, int) or isinstance(chunk, bool) or chunk < 1:
            raise ValueError(f"{name} must be a positive int, got {chunk!r}")
    if vocab_axis not in (0, 1):
        raise ValueError(
            f"vocab_axis must be 0 ([vocab, embed]) or 1 ([embed, vocab]), got {vocab_axis!r}"
        )
    if jnp.ndim(hidden) < 2 or jnp.ndim(w_out) != 2:
        raise ValueError(
            f"hidden must be [..., seq, embed] and w_out 2-D, got shapes {jnp.shape(hidden)} "
            f"and {jnp.shape(w_out)}"
        )
    if w_out.shape[1 - vocab_axis] != hidden.shape[-1]:
        raise ValueError(
            f"w_out {w_out.shape} (vocab_axis={vocab_axis}) does not contract with hidden "
            f"{hidden.shape}: its embed axis is {w_out.shape[1 - vocab_axis]}, hidden's "
            f"{hidden.shape[-1]}"
        )
    if jnp.shape(labels) != hidden.shape[:-1]:
        raise ValueError(
            f"labels shape {jnp.shape(labels)} must be hidden's without its last axis, "
            f"{hidden.shape[:-1]}"
        )
    if not jnp.issubdtype(labels.dtype, jnp.integer):
        raise ValueError(f"labels must be integers, got {labels.dtype}")
    if w_out.shape[vocab_axis] > MAX_VOCAB:
        raise ValueError(f"vocabulary of {w_out.shape[vocab_axis]} is over {MAX_VOCAB} entries")


def _start(index, chunk: int, size: int):
    """Where chunk ``index`` begins: ``index * chunk``, or early enough for the last to fit."""
    return jnp.minimum(index * chunk, size - chunk)


def _fresh(index, chunk: int, start, axis_size: int):
    """Which of the chunk's ``axis_size`` entries no earlier chunk counted."""
    return start + jnp.arange(axis_size) >= index * chunk


def _one_type(*arrays):
    """``arrays`` with one manual-axis type inside ``shard_map``, the union of theirs (outside
    it, unchanged values). Adding a zero made from every input is what jax's own arithmetic
    does to operands of different types: it marks them varying, and the transpose sums the
    gradient of an input that was the same on every device (replicated weights) over the
    devices, as the plain loss's autodiff would. The custom_vjp's cotangents then have its
    inputs' types, and its loops' carries, started from ``zeros_like`` of an input, the type
    their bodies give them (a plain constant's would not match). XLA drops additions of zero."""
    zero = sum(jnp.zeros_like(a.reshape(-1)[0], F32) for a in arrays)
    return tuple(a + zero.astype(a.dtype) for a in arrays)


def _logits(h, w_c, vocab_axis: int):
    """[rows, tc, embed] x one vocabulary chunk of ``w_out`` -> [rows, tc, vc] fp32."""
    dtype = jnp.result_type(h, w_c)
    return lax.dot_general(
        h.astype(dtype),
        w_c.astype(dtype),
        (((2,), (1 - vocab_axis,)), ((), ())),
        preferred_element_type=F32,
    )


def _vocab_tile(h, w, labels, v, vc: int, vocab_axis: int):
    """Vocabulary chunk ``v`` for the token chunk ``h`` / ``labels``: ``(start, w_c, logits,
    fresh columns, one-hot of the labels among the fresh columns)``."""
    vocab = w.shape[vocab_axis]
    start = _start(v, vc, vocab)
    w_c = lax.dynamic_slice_in_dim(w, start, vc, axis=vocab_axis)
    logits = _logits(h, w_c, vocab_axis)
    fresh = _fresh(v, vc, start, vc)
    hit = (start + jnp.arange(vc) == labels[..., None]) & fresh
    return start, w_c, logits, fresh, hit


def _chunk_forward(h, w, labels, vc: int, vocab_axis: int):
    """One token chunk: ``(loss, predictions, log-sum-exp)``, each [rows, tc], from a running
    max, sum of exponentials, label logit and arg-max over the vocabulary chunks."""
    zeros = jnp.zeros_like(labels, F32)
    init = (zeros - jnp.inf, zeros, zeros, zeros - jnp.inf, jnp.zeros_like(labels))

    def step(carry, v):
        top, total, picked, best, arg = carry
        start, _, logits, fresh, hit = _vocab_tile(h, w, labels, v, vc, vocab_axis)
        logits = jnp.where(fresh, logits, -jnp.inf)
        chunk_top = logits.max(-1)
        new_top = jnp.maximum(top, chunk_top)
        total = total * jnp.exp(top - new_top) + jnp.exp(logits - new_top[..., None]).sum(-1)
        picked = picked + jnp.where(hit, logits, 0.0).sum(-1)
        better = chunk_top > best  # strict: an earlier chunk keeps a tie, as argmax does
        arg = jnp.where(better, start + jnp.argmax(logits, -1).astype(jnp.int32), arg)
        return (new_top, total, picked, jnp.maximum(best, chunk_top), arg), None

    chunks = -(-w.shape[vocab_axis] // vc)
    (top, total, picked, _, arg), _ = lax.scan(step, init, jnp.arange(chunks))
    lse = top + jnp.log(total)
    return lse - picked, arg, lse


def _forward(tc: int, vc: int, vocab_axis: int, hidden, w, labels):
    """All token chunks: ``(losses, predictions, log-sum-exp)``, each [rows, seq]."""
    labels = labels.astype(jnp.int32)
    seq = hidden.shape[1]
    init = (jnp.zeros_like(labels, F32), jnp.zeros_like(labels), jnp.zeros_like(labels, F32))

    def step(carry, t):
        start = _start(t, tc, seq)
        h = lax.dynamic_slice_in_dim(hidden, start, tc, axis=1)
        lab = lax.dynamic_slice_in_dim(labels, start, tc, axis=1)
        # An overlapping last chunk writes the same values again for the positions it repeats.
        out = _chunk_forward(h, w, lab, vc, vocab_axis)
        return tuple(
            lax.dynamic_update_slice_in_dim(b, o, start, 1) for b, o in zip(carry, out)
        ), None

    (losses, predictions, lse), _ = lax.scan(step, init, jnp.arange(-(-seq // tc)))
    return losses, predictions, lse


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _token_losses(tc: int, vc: int, vocab_axis: int, hidden, w, labels):
    losses, predictions, _ = _forward(tc, vc, vocab_axis, hidden, w, labels)
    return losses, predictions


def _token_losses_fwd(tc, vc, vocab_axis, hidden, w, labels):
    losses, predictions, lse = _forward(tc, vc, vocab_axis, hidden, w, labels)
    return (losses, predictions), (hidden, w, labels, lse)


def _chunk_backward(h, w, labels, lse, g, dw, vc: int, vocab_axis: int):
    """One token chunk's gradients: ``(d hidden [rows, tc, embed] fp32, dw + its share)``.
    ``g`` [rows, tc] is the cotangent of each token's loss (0 where another chunk owns it)."""
    dtype = jnp.result_type(h, w)

    def step(carry, v):
        dh, dw = carry
        start, w_c, logits, fresh, hit = _vocab_tile(h, w, labels, v, vc, vocab_axis)
        probs = jnp.where(fresh, jnp.exp(logits - lse[..., None]), 0.0)
        dlogits = ((probs - hit) * g[..., None]).astype(dtype)
        dh = dh + lax.dot_general(
            dlogits,
            w_c.astype(dtype),
            (((2,), (vocab_axis,)), ((), ())),
            preferred_element_type=F32,
        )
        # [embed, vc] for w [embed, vocab], [vc, embed] for w [vocab, embed].
        pair = (h.astype(dtype), dlogits) if vocab_axis == 1 else (dlogits, h.astype(dtype))
        share = lax.dot_general(*pair, (((0, 1), (0, 1)), ((), ())), preferred_element_type=F32)
        # Entries an earlier chunk counted get zero here (their dlogits are 0).
        old = lax.dynamic_slice_in_dim(dw, start, vc, axis=vocab_axis)
        return (dh, lax.dynamic_update_slice_in_dim(dw, old + share, start, vocab_axis)), None

    dh0 = jnp.zeros_like(h, F32)
    chunks = -(-w.shape[vocab_axis] // vc)
    (dh, dw), _ = lax.scan(step, (dh0, dw), jnp.arange(chunks))
    return dh, dw


def _token_losses_bwd(tc, vc, vocab_axis, residuals, cotangents):
    hidden, w, labels_f32, lse = residuals
    labels = labels_f32.astype(jnp.int32)
    g_all = cotangents[0].astype(F32)
    seq = hidden.shape[1]
    init = (jnp.zeros_like(hidden), jnp.zeros_like(w, F32))

    def step(carry, t):
        dhidden, dw = carry
        start = _start(t, tc, seq)
        fresh = _fresh(t, tc, start, tc)[:, None]  # [tc, 1]: positions of this chunk
        take = functools.partial(lax.dynamic_slice_in_dim, start_index=start, slice_size=tc, axis=1)
        g = jnp.where(fresh[:, 0], take(g_all), 0.0)
        dh, dw = _chunk_backward(take(hidden), w, take(labels), take(lse), g, dw, vc, vocab_axis)
        dh = jnp.where(fresh, dh.astype(hidden.dtype), take(dhidden))
        return (lax.dynamic_update_slice_in_dim(dhidden, dh, start, 1), dw), None

    (dhidden, dw), _ = lax.scan(step, init, jnp.arange(-(-seq // tc)))
    return dhidden, dw.astype(w.dtype), jnp.zeros_like(labels_f32)


_token_losses.defvjp(_token_losses_fwd, _token_losses_bwd)
