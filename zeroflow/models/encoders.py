"""Bidirectional transformer encoders read from Hugging Face checkpoints: a ViT image encoder
(CLIP's vision tower: pre-norm blocks, class token, learned positions) and a BERT text encoder
(post-norm blocks, token types, learned positions).

Both stack their blocks on a leading layer axis (``nn.scan``, parameters under ``layers/``)
and return ``{"hidden": [B, T, E], "pooled": [B, E]}``. Matmuls run in ``dtype`` (the dtype
the parameters arrive in is cast to it); layer norms, softmax and the pooled output are fp32.
The architecture fields are ``EncoderConfig``'s, filled from config.json by the converters in
``zeroflow.hf.clip_vision`` and ``zeroflow.hf.bert``.
"""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp

LAYERS = "layers"
"Top-level key of the stacked block parameters (leading layer axis)."
VISION, TEXT = "vision", "text"


@dataclasses.dataclass(frozen=True)
class EncoderConfig:
    """One encoder's architecture (what config.json says), for either modality."""

    modality: str
    "'vision' (pixel_values [B, C, H, W]) or 'text' (input_ids and attention_mask [B, T])."
    hidden: int
    num_layers: int
    num_heads: int
    mlp_dim: int
    activation: str
    "'gelu' (erf), 'gelu_tanh' or 'quick_gelu' (x * sigmoid(1.702 x), CLIP's)."
    norm_eps: float
    max_positions: int = 0
    "Text: the learned position table's size."
    vocab_size: int = 0
    type_vocab_size: int = 0
    image_size: int = 0
    patch_size: int = 0
    channels: int = 3

    @property
    def head_dim(self) -> int:
        return self.hidden // self.num_heads

    @property
    def num_patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2


_ACTIVATIONS = {
    "gelu": lambda x: nn.gelu(x, approximate=False),
    "gelu_tanh": lambda x: nn.gelu(x, approximate=True),
    "quick_gelu": lambda x: x * jax.nn.sigmoid(1.702 * x),
}
ACTIVATIONS = tuple(_ACTIVATIONS)


def _norm(cfg: EncoderConfig, name: str) -> nn.LayerNorm:
    return nn.LayerNorm(epsilon=cfg.norm_eps, dtype=jnp.float32, name=name)


class Attention(nn.Module):
    """Multi-head self-attention with biases; ``bias`` is added to the scores ([B, 1, 1, T])."""

    cfg: EncoderConfig
    dtype: jnp.dtype

    @nn.compact
    def __call__(self, x, bias):
        cfg = self.cfg

        def proj(name):
            return nn.DenseGeneral((cfg.num_heads, cfg.head_dim), dtype=self.dtype, name=name)(x)

        q, k, v = proj("query"), proj("key"), proj("value")
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k).astype(jnp.float32) / cfg.head_dim**0.5
        if bias is not None:
            scores = scores + bias
        weights = jax.nn.softmax(scores, axis=-1).astype(self.dtype)
        out = jnp.einsum("bhqk,bkhd->bqhd", weights, v)
        return nn.DenseGeneral(cfg.hidden, axis=(-2, -1), dtype=self.dtype, name="out")(out)


class Mlp(nn.Module):
    cfg: EncoderConfig
    dtype: jnp.dtype

    @nn.compact
    def __call__(self, x):
        h = nn.Dense(self.cfg.mlp_dim, dtype=self.dtype, name="fc1")(x)
        return nn.Dense(self.cfg.hidden, dtype=self.dtype, name="fc2")(
            _ACTIVATIONS[self.cfg.activation](h)
        )


class Block(nn.Module):
    """One encoder block; ``pre_norm``: CLIP's order (norm, sublayer, add), else BERT's
    (sublayer, add, norm)."""

    cfg: EncoderConfig
    dtype: jnp.dtype
    pre_norm: bool

    @nn.compact
    def __call__(self, x, bias):
        attn, mlp = (
            Attention(self.cfg, self.dtype, name="attn"),
            Mlp(self.cfg, self.dtype, name="mlp"),
        )
        norm1, norm2 = _norm(self.cfg, "norm1"), _norm(self.cfg, "norm2")
        if self.pre_norm:
            x = x + attn(norm1(x).astype(self.dtype), bias).astype(x.dtype)
            x = x + mlp(norm2(x).astype(self.dtype)).astype(x.dtype)
        else:
            x = norm1(x + attn(x.astype(self.dtype), bias).astype(x.dtype))
            x = norm2(x + mlp(x.astype(self.dtype)).astype(x.dtype))
        return x, None


def _stack(cfg: EncoderConfig, dtype, pre_norm: bool):
    return nn.scan(
        Block,
        variable_axes={"params": 0},
        split_rngs={"params": True},
        in_axes=(nn.broadcast,),
        length=cfg.num_layers,
    )(cfg, dtype, pre_norm, name=LAYERS)


class VisionEncoder(nn.Module):
    """CLIP's vision tower. ``pixel_values``: [B, C, H, W] as the image processor makes them.
    ``pooled``: the class token after the final norm (transformers' ``pooler_output``)."""

    cfg: EncoderConfig
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, pixel_values):
        cfg, p = self.cfg, self.cfg.patch_size
        b, c, h, w = pixel_values.shape
        patches = pixel_values.reshape(b, c, h // p, p, w // p, p).transpose(0, 2, 4, 1, 3, 5)
        patches = patches.reshape(b, (h // p) * (w // p), c, p, p).astype(self.dtype)
        kernel = self.param("patch_embed", nn.initializers.lecun_normal(), (c, p, p, cfg.hidden))
        x = jnp.einsum("bncij,cije->bne", patches, kernel.astype(self.dtype))
        cls = self.param("class_embed", nn.initializers.normal(0.02), (cfg.hidden,))
        x = jnp.concatenate([jnp.broadcast_to(cls.astype(x.dtype), (b, 1, cfg.hidden)), x], 1)
        positions = self.param(
            "positions", nn.initializers.normal(0.02), (cfg.num_patches + 1, cfg.hidden)
        )
        x = _norm(cfg, "pre_norm")(x.astype(jnp.float32) + positions.astype(jnp.float32))
        x, _ = _stack(cfg, self.dtype, pre_norm=True)(x, None)
        return {"hidden": x, "pooled": _norm(cfg, "post_norm")(x[:, 0])}


class TextEncoder(nn.Module):
    """BERT. ``input_ids`` and ``attention_mask`` (1 = token, 0 = padding): [B, T].
    ``pooled``: the first ([CLS]) token's hidden state (what BGE embeds)."""

    cfg: EncoderConfig
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, input_ids, attention_mask=None):
        cfg = self.cfg
        t = input_ids.shape[1]

        def table(name, n):
            return self.param(name, nn.initializers.normal(0.02), (n, cfg.hidden))

        x = (
            table("token_embed", cfg.vocab_size)[input_ids]
            + table("positions", cfg.max_positions)[:t][None]
            + table("type_embed", cfg.type_vocab_size)[0]
        )
        x = _norm(cfg, "embed_norm")(x.astype(jnp.float32))
        bias = None
        if attention_mask is not None:
            bias = jnp.where(attention_mask[:, None, None, :] > 0, 0.0, jnp.finfo(jnp.float32).min)
        x, _ = _stack(cfg, self.dtype, pre_norm=False)(x, bias)
        return {"hidden": x, "pooled": x[:, 0]}


def encoder_module(cfg: EncoderConfig, dtype=jnp.float32) -> nn.Module:
    return (VisionEncoder if cfg.modality == VISION else TextEncoder)(cfg, dtype)


def mean_pool(hidden, attention_mask):
    """Mean of the hidden states of the real tokens (E5's pooling)."""
    mask = attention_mask[..., None].astype(jnp.float32)
    return (hidden * mask).sum(1) / jnp.maximum(mask.sum(1), 1.0)
