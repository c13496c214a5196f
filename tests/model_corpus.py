"""Models zeroflow was not written for, built the way their own libraries' users write them:
an Equinox transformer, a Flax NNX network with attention, BatchNorm and Dropout, and a small
CNN. Each entry gives the parameters as its library splits them, the model state (or None),
a batch maker and ``forward(params, model_state, batch, key) -> (loss, new_model_state)``."""
from __future__ import annotations

import functools
from typing import Any, Callable, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

VOCAB, DIM, SEQ = 16, 16, 8


class Size(NamedTuple):
    """The corpus at a given size: ``TINY`` for the training tests, ``LARGER`` for the memory
    estimator (KB-sized buffers are all fixed overhead; at MBs the terms it models dominate)."""
    vocab: int = VOCAB
    dim: int = DIM
    seq: int = SEQ
    side: int = 6  # image side of the CNN's batches
    width: int = 16  # the CNN's first conv width


TINY = Size()
LARGER = Size(vocab=512, dim=128, seq=64, side=24, width=64)


class Corpus(NamedTuple):
    params: Any
    model_state: Any
    forward: Callable
    batches: Callable  # (count, size, seed) -> list of batches


def engine_loss(forward, stateful):
    """A corpus ``forward`` as zeroflow's loss: the model state through ``model_state=`` (loss,
    no aux, new state) when ``stateful``, else the loss alone."""
    if stateful:
        def loss_fn(params, batch, *, model_state, rng):
            loss, new_state = forward(params, model_state, batch, rng)
            return loss, {}, new_state
        return loss_fn
    return lambda params, batch, *, rng: forward(params, None, batch, rng)[0]


def token_batches(count, size=16, seed=0, dims: Size = TINY):
    rng = np.random.default_rng(seed)
    return [{"tokens": rng.integers(0, dims.vocab, (size, dims.seq + 1)).astype(np.int32)}
            for _ in range(count)]


def image_batches(count, size=16, seed=0, dims: Size = TINY):
    rng = np.random.default_rng(seed)
    return [{"x": rng.normal(size=(size, dims.side, dims.side, 3)).astype(np.float32),
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

    def __init__(self, key, dim=DIM):
        k1, k2, k3 = jax.random.split(key, 3)
        self.attn = eqx.nn.MultiheadAttention(2, dim, key=k1)
        self.norm1, self.norm2 = eqx.nn.LayerNorm(dim), eqx.nn.LayerNorm(dim)
        self.up, self.down = eqx.nn.Linear(dim, 4 * dim, key=k2), eqx.nn.Linear(4 * dim, dim, key=k3)
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

    def __init__(self, key, layers=2, dims: Size = TINY):
        self.layers = layers
        keys = jax.random.split(key, layers + 2)
        self.embed = eqx.nn.Embedding(dims.vocab, dims.dim, key=keys[0])
        self.blocks = [EqxBlock(k, dims.dim) for k in keys[1:-1]]
        self.norm = eqx.nn.LayerNorm(dims.dim)
        self.head = eqx.nn.Linear(dims.dim, dims.vocab, key=keys[-1])

    def __call__(self, tokens, key):
        x = jax.vmap(self.embed)(tokens)
        for block, k in zip(self.blocks, jax.random.split(key, len(self.blocks))):
            x = block(x, k)
        return jax.vmap(self.head)(jax.vmap(self.norm)(x))


def eqx_transformer(seed=0, dims: Size = TINY, layers=2) -> Corpus:
    """``params`` is ``eqx.partition(model, eqx.is_inexact_array)[0]``, with its None holes."""
    params, static = eqx.partition(EqxTransformer(jax.random.key(seed), layers, dims),
                                   eqx.is_inexact_array)

    def forward(params, model_state, batch, key):
        model = eqx.combine(params, static)
        tokens = batch["tokens"]
        keys = jax.random.split(key, tokens.shape[0])
        logits = jax.vmap(model)(tokens[:, :-1], keys)
        return _next_token_loss(logits, tokens), model_state
    return Corpus(params, None, forward, functools.partial(token_batches, dims=dims))


class NnxNet(nnx.Module):
    """Embedding -> self-attention -> BatchNorm -> Dropout -> Linear."""
    def __init__(self, rngs: nnx.Rngs, dims: Size = TINY):
        self.embed = nnx.Embed(dims.vocab, dims.dim, rngs=rngs)
        self.attn = nnx.MultiHeadAttention(2, dims.dim, decode=False, rngs=rngs)
        self.norm = nnx.BatchNorm(dims.dim, momentum=0.8, rngs=rngs)
        self.drop = nnx.Dropout(0.2)
        self.head = nnx.Linear(dims.dim, dims.vocab, rngs=rngs)

    def __call__(self, tokens, rngs):
        x = self.embed(tokens)
        x = x + self.attn(x, mask=nnx.make_causal_mask(tokens))
        return self.head(self.drop(self.norm(x), rngs=rngs))


def nnx_net(seed=0, dims: Size = TINY) -> Corpus:
    """Through ``nnx.split`` / ``nnx.merge``: parameters and batch statistics as two States."""
    graphdef, params, stats = nnx.split(NnxNet(nnx.Rngs(seed), dims), nnx.Param, nnx.BatchStat)

    def forward(params, stats, batch, key):
        model = nnx.merge(graphdef, params, stats)
        logits = model(batch["tokens"][:, :-1], rngs=nnx.Rngs(dropout=key))
        return _next_token_loss(logits, batch["tokens"]), nnx.state(model, nnx.BatchStat)
    return Corpus(params, stats, forward, functools.partial(token_batches, dims=dims))


class SmallCNN(eqx.Module):
    conv1: eqx.nn.Conv2d
    conv2: eqx.nn.Conv2d
    head: eqx.nn.Linear

    def __init__(self, key, width=16):
        k1, k2, k3 = jax.random.split(key, 3)
        self.conv1 = eqx.nn.Conv2d(3, width, 3, padding=1, key=k1)
        self.conv2 = eqx.nn.Conv2d(width, width * 3 // 2, 3, padding=1, key=k2)
        self.head = eqx.nn.Linear(width * 3 // 2, 10, key=k3)

    def __call__(self, x):  # one image, channels last as the batches hold it
        x = jax.nn.relu(self.conv1(jnp.transpose(x, (2, 0, 1))))
        x = jax.nn.relu(self.conv2(x))
        return self.head(x.mean(axis=(1, 2)))


def small_cnn(seed=0, dims: Size = TINY) -> Corpus:
    params, static = eqx.partition(SmallCNN(jax.random.key(seed), dims.width), eqx.is_inexact_array)

    def forward(params, model_state, batch, key):
        logits = jax.vmap(eqx.combine(params, static))(batch["x"])
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()
        return loss, model_state
    return Corpus(params, None, forward, functools.partial(image_batches, dims=dims))


CORPUS = {"eqx_transformer": eqx_transformer, "nnx_net": nnx_net, "small_cnn": small_cnn}
