"""Next-token cross-entropy for the GPT model: on the whole logits, or chunked
(``model.loss_chunk``, ``zeroflow.ops.chunked_cross_entropy``) without ever holding them."""

from __future__ import annotations

import functools
from typing import cast

import jax
import jax.numpy as jnp
import optax

from zeroflow.config.schema import ModelConfig
from zeroflow.models.context import context_size, row_count
from zeroflow.models.context import masked_mean as row_mean
from zeroflow.models.gpt import GPT, unembed_vocab_axis
from zeroflow.ops import chunked_token_losses


def cross_entropy_loss(logits: jax.Array, targets: jax.Array, mask: jax.Array | None = None):
    """Mean next-token loss in nats, in fp32; ``mask`` (same shape as targets) weights it."""
    losses = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), targets)
    return masked_mean(losses, mask)


def masked_mean(values: jax.Array, mask: jax.Array | None = None):
    """``values.mean()``, or over the masked-in entries (``mask`` weights each one)."""
    if mask is None:
        return values.mean()
    mask = mask.astype(jnp.float32)
    return (values * mask).sum() / jnp.maximum(mask.sum(), 1.0)


def token_losses(model: GPT, params, tokens: jax.Array, targets: jax.Array, **apply_kwargs):
    """``(losses, predictions)`` [B, S]: each target's cross-entropy (fp32) and the arg-max of its
    logits. With ``model.cfg.loss_chunk`` the chunked cross-entropy computes both from the final
    hidden states without holding the [B, S, vocab] logits; otherwise from the whole logits."""
    cfg = model.cfg
    if not cfg.loss_chunk:
        # flax types apply() as maybe (output, variables); without mutable= it is the output
        logits = cast(jax.Array, model.apply({"params": params}, tokens, **apply_kwargs))
        losses = optax.softmax_cross_entropy_with_integer_labels(logits, targets)
        return losses, jnp.argmax(logits, axis=-1)
    hidden, unembed = cast(
        tuple[jax.Array, jax.Array],
        model.apply({"params": params}, tokens, return_hidden=True, **apply_kwargs),
    )
    return chunked_token_losses(
        hidden,
        unembed,
        targets,
        token_chunk=cfg.loss_chunk,
        vocab_chunk=cfg.loss_vocab_chunk,
        vocab_axis=unembed_vocab_axis(cfg),
    )


def lm_loss(params, batch: dict, rng: jax.Array | None = None, *, model: GPT, gather_layer=None):
    """``batch["tokens"]`` int32 [B, S+1] -> ``(loss, {"accuracy"})``; an rng turns dropout on.

    A packed batch (``zeroflow.data.packing``) holds ``tokens`` and ``targets`` [B, S] with
    ``loss_mask``, ``segment_ids`` and ``positions``: the loss and accuracy are then over the
    masked-in targets only, and ``trained_tokens`` counts them.
    """
    apply_kwargs = {"deterministic": rng is None, "rngs": {} if rng is None else {"dropout": rng}}
    if gather_layer is not None:
        model = model.clone(layer_transform=gather_layer)
    if "targets" not in batch:
        if context_size() > 1:
            raise ValueError(
                "with a context axis the batch needs 'targets' beside 'tokens' (the sequence "
                "is split over devices, so it cannot be shifted inside the step); "
                "zeroflow.models.context.context_batch makes them from [B, S + 1] windows"
            )
        tokens = batch["tokens"]
        inputs, targets = tokens[:, :-1], tokens[:, 1:]
        losses, predictions = token_losses(model, params, inputs, targets, **apply_kwargs)
        return losses.mean(), {"accuracy": jnp.mean(predictions == targets)}
    targets, mask = batch["targets"], batch["loss_mask"]
    losses, predictions = token_losses(
        model,
        params,
        batch["tokens"],
        targets,
        segment_ids=batch["segment_ids"],
        positions=batch["positions"],
        **apply_kwargs,
    )
    # Means over whole rows: with a context axis each device holds a part of every row.
    trained = mask.astype(jnp.float32)
    hits = (predictions == targets).astype(jnp.float32)
    return (
        row_mean(losses, trained),
        {"accuracy": row_mean(hits, trained), "trained_tokens": row_count(trained)},
    )


def make_loss_fn(cfg: ModelConfig):
    """``loss_fn(params, batch, rng=None) -> (loss, {"accuracy": ...})`` for ``jax.value_and_grad``
    with ``has_aux=True``; params may be fp32, bf16 or fp16 (the model computes in their dtype)."""
    return functools.partial(lm_loss, model=GPT(cfg))


def make_layerwise_loss_fn(cfg: ModelConfig):
    """``loss_fn(params, batch, gather_layer, rng=None)`` for ``zf.make_train_step(...,
    gather_per_layer="layers")``: at ZeRO stage 3 each scanned layer is gathered just before
    it runs instead of the whole model at the start of the step."""
    model = GPT(cfg)

    def loss_fn(params, batch, gather_layer, rng=None):
        return lm_loss(params, batch, rng, model=model, gather_layer=gather_layer)

    return loss_fn
