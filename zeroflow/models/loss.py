"""Next-token cross-entropy for the GPT model."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import optax

from zeroflow.config.schema import ModelConfig
from zeroflow.models.context import context_size, masked_mean, row_count
from zeroflow.models.gpt import GPT


def cross_entropy_loss(logits: jax.Array, targets: jax.Array, mask: jax.Array | None = None):
    """Mean next-token loss in nats, in fp32; ``mask`` (same shape as targets) weights it."""
    losses = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), targets)
    if mask is None:
        return losses.mean()
    mask = mask.astype(jnp.float32)
    return (losses * mask).sum() / jnp.maximum(mask.sum(), 1.0)


def lm_loss(params, batch: dict, rng: jax.Array | None = None, *, model: GPT, gather_layer=None):
    """``batch["tokens"]`` int32 [B, S+1] -> ``(loss, {"accuracy"})``; an rng turns dropout on.

    A packed batch (``zeroflow.data.packing``) holds ``tokens`` and ``targets`` [B, S] with
    ``loss_mask``, ``segment_ids`` and ``positions``: the loss and accuracy are then over the
    masked-in targets only, and ``trained_tokens`` counts them.
    """
    rngs = {} if rng is None else {"dropout": rng}
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
        logits = model.apply({"params": params}, inputs, deterministic=rng is None, rngs=rngs)
        accuracy = jnp.mean(jnp.argmax(logits, axis=-1) == targets)
        return cross_entropy_loss(logits, targets), {"accuracy": accuracy}
    targets, mask = batch["targets"], batch["loss_mask"]
    logits = model.apply(
        {"params": params},
        batch["tokens"],
        deterministic=rng is None,
        rngs=rngs,
        segment_ids=batch["segment_ids"],
        positions=batch["positions"],
    )
    # Means over whole rows: with a context axis each device holds a part of every row.
    trained = mask.astype(jnp.float32)
    losses = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), targets)
    hits = (jnp.argmax(logits, axis=-1) == targets).astype(jnp.float32)
    return (
        masked_mean(losses, trained),
        {"accuracy": masked_mean(hits, trained), "trained_tokens": row_count(trained)},
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
