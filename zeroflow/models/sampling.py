"""Autoregressive sampling without a KV cache: one compiled full-window forward per token."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from zeroflow.config.schema import ModelConfig
from zeroflow.models.gpt import GPT


@functools.lru_cache(maxsize=8)
def _next_token_fn(cfg_fields: tuple, top_k: int | None):
    """Compiled ``(params, window [1, seq_len], last, rng, temperature) -> token``, cached per
    config so repeated ``generate`` calls reuse the compilation."""
    model = GPT(ModelConfig(*cfg_fields))

    @jax.jit
    def next_token(params, window, last, rng, temperature):
        logits = model.apply({"params": params}, window)[0, last]  # fp32 [vocab]
        greedy = jnp.argmax(logits)
        if top_k is not None:
            kth_largest = jax.lax.top_k(logits, top_k)[0][-1]
            logits = jnp.where(logits < kth_largest, -jnp.inf, logits)
        sampled = jax.random.categorical(rng, logits / jnp.maximum(temperature, 1e-6))
        return jnp.where(temperature > 0, sampled, greedy)

    return next_token


def generate(
    params,
    cfg: ModelConfig,
    prompt_tokens: list[int],
    *,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_k: int | None = None,
    rng: jax.Array,
) -> list[int]:
    """Sample ``max_new_tokens`` tokens after ``prompt_tokens`` and return only the new ones.

    ``temperature=0`` is greedy. The model sees at most the last ``cfg.seq_len`` tokens: the
    window is right-padded (causal attention ignores the padding) and slides once full.
    """
    if not prompt_tokens:
        raise ValueError("generate needs at least one prompt token")
    if top_k is not None and not 0 < top_k <= cfg.vocab_size:
        raise ValueError(f"top_k={top_k} must be in [1, vocab_size={cfg.vocab_size}]")
    next_token = _next_token_fn(dataclasses.astuple(cfg), top_k)
    tokens = list(prompt_tokens)
    for step_rng in jax.random.split(rng, max_new_tokens):
        context = tokens[-cfg.seq_len :]
        window = jnp.asarray([context + [0] * (cfg.seq_len - len(context))], jnp.int32)
        token = next_token(params, window, len(context) - 1, step_rng, temperature)
        tokens.append(int(token))
    return tokens[len(prompt_tokens) :]
