"""Models zeroflow was not written for, built the way their own libraries' users write them:
an Equinox transformer, a Flax NNX network with attention, BatchNorm and Dropout, and a small
CNN. Each entry gives the parameters as its library splits them, the model state (or None),
a batch maker and ``forward(params, model_state, batch, key) -> (loss, new_model_state)``."""
from __future__ import annotations

from typing import Any, Callable, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

VOCAB, DIM, SEQ = 16, 16, 8


class Corpus(NamedTuple):
    params: Any
    model_state: Any
    forward: Callable
    batches: Callable  # (count, size, seed) -> list of batches


def token_batches(count, size=16, seed=0):
    rng = np.random.default_rng(seed)
    return [{"tokens": rng.integers(0, VOCAB, (size, SEQ + 1)).astype(np.int32)}
            for _ in range(count)]


def image_batches(count, size=16, seed=0):
    rng = np.random.default_rng(seed)
    return [{"x": rng.normal(size=(size, 6, 6, 3)).astype(np.float32),
             "y": rng.integers(0, 10, size).astype(np.int32)} for _ in range(count)]


def _next_token_loss(logits, tokens):
    return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()


class EqxBlock(eqx.Module):
    attn: eqx.nn.MultiheadAttention
    norm1: eqx.nn.LayerNorm
    norm2: eqx.nn.LayerNorm
    up: eqx.nn.Linear
    down: eqx.nn.Linear
    drop: eqx.nn.Dropout

    def __init__(self, key):
        k1, k2, k3 = jax.random.split(key, 3)
        self.attn = eqx.nn.MultiheadAttention(2, DIM, key=k1)
        self.norm1, self.norm2 = eqx.nn.LayerNorm(DIM), eqx.nn.LayerNorm(DIM)
        self.up, self.down = eqx.nn.Linear(DIM, 4 * DIM, key=k2), eqx.nn.Linear(4 * DIM, DIM, key=k3)
        self.drop = eqx.nn.Dropout(0.2)

    def __call__(self, x, key):
        k1, k2 = jax.random.split(key)
        h = jax.vmap(self.norm1)(x)
        mask = jnp.tril(jnp.ones((x.shape[0], x.shape[0]), bool))
        x = x + self.drop(self.attn(h, h, h, mask=mask), key=k1)
        h = jax.vmap(self.norm2)(x)
        return x + self.drop(jax.vmap(self.down)(jax.nn.gelu(jax.vmap(self.up)(h))), key=k2)


class EqxTransformer(eqx.Module):
    embed: eqx.nn.Embedding
    blocks: list
    norm: eqx.nn.LayerNorm
    head: eqx.nn.Linear
    layers: int = eqx.field(static=True)  # a non-array field: a None hole in the params

    def __init__(self, key, layers=2):
        self.layers = layers
        keys = jax.random.split(key, layers + 2)
        self.embed = eqx.nn.Embedding(VOCAB, DIM, key=keys[0])
        self.blocks = [EqxBlock(k) for k in keys[1:-1]]
        self.norm = eqx.nn.LayerNorm(DIM)
        self.head = eqx.nn.Linear(DIM, VOCAB, key=keys[-1])

    def __call__(self, tokens, key):
        x = jax.vmap(self.embed)(tokens)
        for block, k in zip(self.blocks, jax.random.split(key, len(self.blocks))):
            x = block(x, k)
        return jax.vmap(self.head)(jax.vmap(self.norm)(x))


def eqx_transformer(seed=0) -> Corpus:
    """``params`` is ``eqx.partition(model, eqx.is_inexact_array)[0]``, with its None holes."""
    params, static = eqx.partition(EqxTransformer(jax.random.key(seed)), eqx.is_inexact_array)

    def forward(params, model_state, batch, key):
        model = eqx.combine(params, static)
        tokens = batch["tokens"]
        keys = jax.random.split(key, tokens.shape[0])
        logits = jax.vmap(model)(tokens[:, :-1], keys)
        return _next_token_loss(logits, tokens), model_state
    return Corpus(params, None, forward, token_batches)


class NnxNet(nnx.Module):
    """Embedding -> self-attention -> BatchNorm -> Dropout -> Linear."""
    def __init__(self, rngs: nnx.Rngs):
        self.embed = nnx.Embed(VOCAB, DIM, rngs=rngs)
        self.attn = nnx.MultiHeadAttention(2, DIM, decode=False, rngs=rngs)
        self.norm = nnx.BatchNorm(DIM, momentum=0.8, rngs=rngs)
        self.drop = nnx.Dropout(0.2)
        self.head = nnx.Linear(DIM, VOCAB, rngs=rngs)

    def __call__(self, tokens, rngs):
        x = self.embed(tokens)
        x = x + self.attn(x, mask=nnx.make_causal_mask(tokens))
        return self.head(self.drop(self.norm(x), rngs=rngs))


def nnx_net(seed=0) -> Corpus:
    """Through ``nnx.split`` / ``nnx.merge``: parameters and batch statistics as two States."""
    graphdef, params, stats = nnx.split(NnxNet(nnx.Rngs(seed)), nnx.Param, nnx.BatchStat)

    def forward(params, stats, batch, key):
        model = nnx.merge(graphdef, params, stats)
        logits = model(batch["tokens"][:, :-1], rngs=nnx.Rngs(dropout=key))
        return _next_token_loss(logits, batch["tokens"]), nnx.state(model, nnx.BatchStat)
    return Corpus(params, stats, forward, token_batches)


class SmallCNN(eqx.Module):
    conv1: eqx.nn.Conv2d
    conv2: eqx.nn.Conv2d
    head: eqx.nn.Linear

    def __init__(self, key):
        k1, k2, k3 = jax.random.split(key, 3)
        self.conv1 = eqx.nn.Conv2d(3, 16, 3, padding=1, key=k1)
        self.conv2 = eqx.nn.Conv2d(16, 24, 3, padding=1, key=k2)
        self.head = eqx.nn.Linear(24, 10, key=k3)

    def __call__(self, x):  # one image, channels last as the batches hold it
        x = jax.nn.relu(self.conv1(jnp.transpose(x, (2, 0, 1))))
        x = jax.nn.relu(self.conv2(x))
        return self.head(x.mean(axis=(1, 2)))


def small_cnn(seed=0) -> Corpus:
    params, static = eqx.partition(SmallCNN(jax.random.key(seed)), eqx.is_inexact_array)

    def forward(params, model_state, batch, key):
        logits = jax.vmap(eqx.combine(params, static))(batch["x"])
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()
        return loss, model_state
    return Corpus(params, None, forward, image_batches)


CORPUS = {"eqx_transformer": eqx_transformer, "nnx_net": nnx_net, "small_cnn": small_cnn}
