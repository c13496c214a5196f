"""GPT-style decoder (flax.linen) driven by ``ModelConfig``.

Precision follows the parameters: the training engine passes params already cast to the compute
dtype (fp32, bf16 or fp16), every matmul runs in that dtype, norms / rotary angles / softmax
statistics run in fp32 internally, and logits come back as fp32. Layers never name a dtype
except fp32 for freshly initialised (master) parameters.

Decoder blocks are stacked with ``nn.scan`` so every block parameter has a leading ``layers``
axis of size ``num_layers``; ZeRO-3 can then gather one layer's slice at a time.
"""

from __future__ import annotations

import functools
import math
import re
import warnings
from collections.abc import Callable
from typing import Any, Literal, cast

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax import lax
from jax.ad_checkpoint import checkpoint_name

from zeroflow import backend
from zeroflow.autocast import fp8_saved
from zeroflow.config.schema import ModelConfig, choices_of
from zeroflow.engine.grads.collectives import save_all_but_fetched
from zeroflow.models import layer_chunk
from zeroflow.models.axes import (
    EMBED,
    HEAD_DIM,
    HEADS,
    KV_HEADS,
    LAYERS,
    MLP,
    NORM,
    POSITIONS,
    VOCAB,
)
from zeroflow.models.context import context_size, token_index
from zeroflow.models.context_attention import context_attention
from zeroflow.models.cudnn_rules import cudnn_attention_problem
from zeroflow.models.kernels import pallas_kernel
from zeroflow.util.settings import FP8_DOTS_REMATS, FP8_INPUT_REMATS, FP8_REMATS

INIT_STD = 0.02

MATMUL_OUTPUTS = ("query", "key", "value", "attn_out", "mlp_up", "mlp_gate", "mlp_down")
"Names (``checkpoint_name``) of a block's weight-matmul outputs: what remat 'offload_dots' moves"
" to host memory for the backward pass."
LAYER_INPUT = "layer_input"
"Name (``checkpoint_name``) of each block's input: what remat 'offload_input' moves to host memory."
OFFLOADED = {"offload_dots": MATMUL_OUTPUTS, "offload_input": (LAYER_INPUT,)}
"The names each offloading remat policy keeps in pinned host memory."
FP8_SAVED_OUTPUTS = MATMUL_OUTPUTS[:-1]
"The matmul outputs model.remat_dtype='fp8' rounds through e4m3: all but 'mlp_down', which the"
" backward pass never reads (only added to the residual stream), so no remat policy saves it."
INIT_REMAT = {"offload_dots": "save_dots", "offload_input": "full"}
"What an offloading policy runs as while initialising (only shapes, no backend to ask)."

GATED = ("swiglu", "geglu")
"MLP activations with a gate projection beside up and down."

_CHOICES = choices_of(ModelConfig)
"The allowed values of each enumerated model setting, as ModelConfig spells them."


def saved_output(cfg: ModelConfig, x: jax.Array, name: str) -> jax.Array:
    """A block's matmul output, named ``name`` for the remat policies; with
    ``remat_dtype='fp8'`` rounded through e4m3 (``zeroflow.autocast.fp8_saved``), whose bytes
    and scale are then what the policy keeps."""
    x = checkpoint_name(x, name)
    if cfg.remat_dtype == "fp8" and cfg.remat in FP8_DOTS_REMATS and name in FP8_SAVED_OUTPUTS:
        x = fp8_saved.saved_in_fp8(x)
    return x


def layer_input_read(cfg: ModelConfig, x: jax.Array) -> jax.Array:
    """What a block's branches (norms, attention, MLP) read of its input ``x``: ``x``, or with
    ``remat_dtype='fp8'`` under remat full / offload_input ``x`` rounded through e4m3, whose
    bytes and scale are then all the policy keeps of the layer (FP8 layer inputs). The residual
    stream itself adds the exact ``x``."""
    if cfg.remat_dtype == "fp8" and cfg.remat in FP8_INPUT_REMATS:
        return fp8_saved.saved_in_fp8(x)
    return x


def num_kv_heads(cfg: ModelConfig) -> int:
    return cfg.num_kv_heads or cfg.num_heads


def head_dim(cfg: ModelConfig) -> int:
    return cfg.head_dim or cfg.embed_dim // cfg.num_heads


def max_positions(cfg: ModelConfig) -> int:
    return cfg.max_positions or cfg.seq_len


def check_config(cfg: ModelConfig) -> None:
    """Fail fast on settings the model cannot run, naming the valid ones."""
    for field, valid in _CHOICES.items():
        if getattr(cfg, field) not in valid:
            raise ValueError(f"model.{field}={getattr(cfg, field)!r}; expected one of {valid}")
    if cfg.num_heads % num_kv_heads(cfg):
        raise ValueError(
            f"model.num_heads={cfg.num_heads} must be a multiple of "
            f"num_kv_heads={num_kv_heads(cfg)}"
        )
    if head_dim(cfg) <= 0 or (cfg.positions == "rope" and head_dim(cfg) % 2):
        raise ValueError(f"head dim {head_dim(cfg)} must be positive and even (rotary embedding)")
    _check_kernel_options(cfg)
    _check_layer_options(cfg)
    if cfg.loss_chunk < 0 or cfg.mlp_chunk < 0 or cfg.loss_vocab_chunk < 1:
        raise ValueError(
            f"model.loss_chunk={cfg.loss_chunk} and model.mlp_chunk={cfg.mlp_chunk} must be >= 0 "
            f"and model.loss_vocab_chunk={cfg.loss_vocab_chunk} positive"
        )
    _check_layer_chunk(cfg)


def _check_layer_chunk(cfg: ModelConfig) -> None:
    """``model.layer_chunk``: what the chunked block (``chunked_block``) cannot do."""
    if cfg.layer_chunk < 0:
        raise ValueError(f"model.layer_chunk={cfg.layer_chunk} must be >= 0 (0 = one piece)")
    if cfg.layer_chunk and cfg.remat in FP8_DOTS_REMATS:
        raise ValueError(
            f"model.layer_chunk={cfg.layer_chunk} needs model.remat 'none', 'full' or "
            f"'offload_input' (the matmul outputs {cfg.remat!r} keeps are inside its chunks)"
        )
    if cfg.layer_chunk and cfg.dropout:
        raise ValueError(
            f"model.layer_chunk={cfg.layer_chunk} needs model.dropout=0 (got {cfg.dropout})"
        )


def _check_kernel_options(cfg: ModelConfig) -> None:
    """The shapes the Pallas kernels take (attention 'pallas', mlp 'block_sparse')."""
    if cfg.attention == "pallas" and head_dim(cfg) > PALLAS_MAX_HEAD_DIM:
        raise ValueError(
            f"model.attention='pallas' supports head dims up to {PALLAS_MAX_HEAD_DIM} (the "
            f"Mosaic GPU kernel's), got {head_dim(cfg)}; use attention='xla' or 'cudnn'"
        )
    if cfg.mlp != "block_sparse":
        return
    if cfg.mlp_bias:
        raise ValueError(
            "model.mlp_bias needs model.mlp='dense' (block-sparse layers have no bias)"
        )
    # The weight is a grid of mlp_block_size blocks: both of its sides must be whole blocks.
    uneven = [
        f"{name}={getattr(cfg, name)}"
        for name in ("embed_dim", "mlp_dim")
        if getattr(cfg, name) % cfg.mlp_block_size
    ]
    if uneven:
        raise ValueError(
            f"model.mlp='block_sparse' needs model.embed_dim and model.mlp_dim to be multiples "
            f"of model.mlp_block_size={cfg.mlp_block_size}; got {', '.join(uneven)}"
        )


def _check_layer_options(cfg: ModelConfig) -> None:
    """The options of the Gemma/Qwen3 family that some paths cannot run, refused by name."""
    if cfg.global_every < 0 or (cfg.global_every and not cfg.sliding_window):
        raise ValueError(
            f"model.global_every={cfg.global_every} needs model.sliding_window > 0 "
            "(it says which layers skip the window) and must be >= 0"
        )
    if cfg.attn_softcap and cfg.attention != "xla":
        raise ValueError(
            f"model.attn_softcap={cfg.attn_softcap} needs attention='xla' "
            f"(the {cfg.attention} attention has no score soft-capping)"
        )
    if cfg.logit_softcap and cfg.loss_chunk:
        raise ValueError(
            f"model.logit_softcap={cfg.logit_softcap} needs model.loss_chunk=0 "
            "(the chunked cross-entropy projects the logits itself, without the cap)"
        )
    for name in ("attn_softcap", "logit_softcap", "query_pre_attn_scalar", "local_rope_base"):
        if getattr(cfg, name) < 0:
            raise ValueError(f"model.{name}={getattr(cfg, name)} must be >= 0 (0 = off)")
    if not 0 <= cfg.norm_offset <= 1:
        raise ValueError(
            f"model.norm_offset={cfg.norm_offset} must be between 0 and 1 (Gemma's 1: the norm's "
            "scale starts at 1 - norm_offset)"
        )


def _param(module: nn.Module, name: str, init, shape, names):
    """A freshly initialised fp32 parameter tagged with logical axis names."""
    return module.param(name, nn.with_logical_partitioning(init, names), shape, jnp.float32)


class Dense(nn.Module):
    """Projection ``x[..., *in] @ kernel[*in, *features] (+ bias[*features])`` in the kernel's
    dtype; bias-free unless ``use_bias``."""

    features: tuple[int, ...]
    kernel_axes: tuple[str, ...]
    contract: int = 1
    "How many trailing input dimensions are contracted."
    stddev: float = INIT_STD
    use_bias: bool = False

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        shape = (*x.shape[x.ndim - self.contract :], *self.features)
        init = nn.initializers.normal(self.stddev)
        kernel = _param(self, "kernel", init, shape, self.kernel_axes)
        x_dims = tuple(range(x.ndim - self.contract, x.ndim))
        y = lax.dot_general(
            x.astype(kernel.dtype), kernel, ((x_dims, tuple(range(self.contract))), ((), ()))
        )
        if self.use_bias:
            bias_axes = self.kernel_axes[len(self.kernel_axes) - len(self.features) :]
            y = y + _param(self, "bias", nn.initializers.zeros, self.features, bias_axes).astype(
                y.dtype
            )
        return y


class Norm(nn.Module):
    """RMSNorm or LayerNorm; statistics in fp32, output in the input's dtype."""

    kind: str
    eps: float = 1e-6
    offset: float = 0.0
    "Added to the learned scale (Gemma's 1 + w); the scale starts at 1 - offset."
    axis_name: str = NORM

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        width = (x.shape[-1],)
        init = nn.initializers.constant(1.0 - self.offset) if self.offset else nn.initializers.ones
        scale = _param(self, "scale", init, width, (self.axis_name,))
        y = x.astype(jnp.float32)
        if self.kind == "layernorm":
            y = y - y.mean(-1, keepdims=True)
        y = y * lax.rsqrt(jnp.mean(y * y, -1, keepdims=True) + self.eps)
        scale = scale.astype(jnp.float32)
        y = y * (scale + self.offset if self.offset else scale)
        if self.kind == "layernorm":
            y = y + _param(self, "bias", nn.initializers.zeros, width, (NORM,)).astype(jnp.float32)
        return y.astype(x.dtype)


def llama3_scaled(inv_freq: jax.Array, cfg: ModelConfig) -> jax.Array:
    """Llama 3.1's long-context rope rescaling of the inverse frequencies.

    Wavelengths shorter than ``original / high_freq_factor`` are kept, those longer than
    ``original / low_freq_factor`` are slowed down by ``factor``, and the band between is
    blended linearly in ``original / wavelength`` (Meta's llama-models ``apply_scaling``).
    """
    factor, original = cfg.rope_scaling_factor, cfg.rope_original_max_positions
    low, high = cfg.rope_low_freq_factor, cfg.rope_high_freq_factor
    wavelength = 2 * math.pi / inv_freq
    smooth = (original / wavelength - low) / (high - low)
    blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    return jnp.where(
        wavelength < original / high,
        inv_freq,
        jnp.where(wavelength > original / low, inv_freq / factor, blended),
    )


def rope_inv_freq(dim: int, base: float, cfg: ModelConfig | None = None) -> jax.Array:
    """The ``dim / 2`` rotary inverse frequencies, rescaled as ``cfg.rope_scaling`` says."""
    inv_freq = base ** (-jnp.arange(0, dim, 2, dtype=jnp.float32) / dim)
    if cfg is not None and cfg.rope_scaling == "llama3":
        inv_freq = llama3_scaled(inv_freq, cfg)
    if cfg is not None and cfg.rope_scaling == "linear":
        inv_freq = inv_freq / cfg.rope_scaling_factor
    return inv_freq


def rotate(x: jax.Array, inv_freq: jax.Array, positions: jax.Array | None = None) -> jax.Array:
    """Rotary position embedding on [batch, seq, heads, head_dim] (rotate-half form) with the
    inverse frequencies ``inv_freq`` (``rope_inv_freq``; they may differ from layer to layer).

    ``positions`` [batch, seq]: each token's position (packed examples restart at 0);
    None = 0 .. seq - 1.
    """
    seq = x.shape[-3]
    if positions is None:
        positions = jnp.arange(seq)[None, :]
    angles = positions.astype(jnp.float32)[..., None] * inv_freq  # [batch or 1, seq, dim/2]
    sin, cos = jnp.sin(angles)[..., None, :], jnp.cos(angles)[..., None, :]
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


def segment_mask(segment_ids: jax.Array) -> jax.Array:
    """[B, S] segment ids -> [B, 1, S, S] bool: query i may see key j of its own segment."""
    return (segment_ids[:, :, None] == segment_ids[:, None, :])[:, None]


def causal_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    implementation: str,
    window: int = 0,
    segment_ids: jax.Array | None = None,
) -> jax.Array:
    """q [B, S, H, D], k/v [B, S, KV, D] with H a multiple of KV -> [B, S, H, D].

    ``window > 0`` lets each query see only the ``window`` most recent keys, itself included.
    ``segment_ids`` [B, S] (packed examples): a query sees only keys of its own segment.
    """
    check_implementation(implementation, q.dtype, q.shape[-1])
    if implementation == "pallas":
        return pallas_kernel("flash_attention", "attention='pallas'")(
            q,
            k,
            v,
            causal=True,
            segment_ids=segment_ids,
            window=(window - 1, 0) if window else None,
        )
    # The xla path computes the scores with fp32 accumulation and the softmax in fp32.
    local = (window - 1, 0) if window else None
    # Both paths take the segments as a boolean mask (cuDNN turns it into a bias).
    mask = None if segment_ids is None else segment_mask(segment_ids)
    jax_kind = cast(Literal["xla", "cudnn"], implementation)  # "pallas" returned above
    return jax.nn.dot_product_attention(
        q, k, v, mask=mask, is_causal=True, local_window_size=local, implementation=jax_kind
    )


PALLAS_MAX_HEAD_DIM = 128
"The largest head dim of the Pallas flash attention kernel (padded inside to 64 or 128)."

HOPPER = re.compile(r"\bG?H(100|200|800|20)\b")
"Device kinds with sm_90 (Hopper), where the Mosaic GPU kernel's wgmma exists."


def check_implementation(implementation: str, dtype, head_dim: int = 0) -> None:
    """One line where the attention implementation cannot run on the step's devices (for
    cuDNN: heads of ``head_dim`` on GPUs of the traced step's compute capability)."""
    traits = backend.current()
    if implementation == "cudnn" and head_dim and traits.has_cudnn:
        problem = cudnn_attention_problem(head_dim, traits.compute_capability, traits.device_kind)
        if problem:
            raise ValueError(problem)
    if implementation == "pallas" and traits.platform == "gpu":
        _check_pallas_gpu(traits.device_kind, dtype)
    elif implementation == "pallas":  # interpreted, by the same backend's interpreter
        check_mosaic_gpu("attention='pallas'", "", "attention='xla'")
    if implementation == "cudnn" and not traits.has_cudnn:
        raise ValueError(
            f"model.attention='cudnn' needs a GPU (cuDNN flash attention), but the step is "
            f"compiled for {traits.platform!r} devices; use attention='xla' here"
        )
    if implementation == "cudnn" and dtype not in (jnp.bfloat16, jnp.float16):
        raise ValueError(
            f"model.attention='cudnn' needs bf16 or fp16 params, got {dtype}; "
            "set precision.params to bf16/fp16 or use attention='xla'"
        )


def softcapped_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    cap: float,
    window: int = 0,
    segment_ids: jax.Array | None = None,
) -> jax.Array:
    """``causal_attention`` (xla) with the scores soft-capped to ``cap * tanh(s / cap)`` before
    the mask and softmax (Gemma 2), which ``jax.nn.dot_product_attention`` cannot take."""
    b, s, h, d = q.shape
    kv = k.shape[2]
    grouped = q.reshape(b, s, kv, h // kv, d)
    scores = jnp.einsum("bqkgd,bskd->bkgqs", grouped, k, preferred_element_type=jnp.float32)
    scores = cap * jnp.tanh(scores / (math.sqrt(d) * cap))
    at = jnp.arange(s)
    keep = at[None, :] <= at[:, None]
    if window:
        keep = keep & (at[:, None] - at[None, :] < window)
    keep = keep[None, None, None]
    if segment_ids is not None:
        keep = keep & segment_mask(segment_ids)[:, :, None]
    probs = jax.nn.softmax(jnp.where(keep, scores, -jnp.inf), axis=-1).astype(v.dtype)
    out = jnp.einsum("bkgqs,bskd->bqkgd", probs, v, preferred_element_type=jnp.float32)
    return out.reshape(b, s, h, d).astype(q.dtype)


def is_local_layer(cfg: ModelConfig, layer: jax.Array | None) -> jax.Array | bool:
    """Whether a layer uses ``cfg.sliding_window``: every layer without ``global_every``, else
    all but every ``global_every``-th (``layer`` traced: the scan's index)."""
    if not cfg.global_every or layer is None:
        return bool(cfg.sliding_window)
    return (layer + 1) % cfg.global_every != 0


def _layer_inv_freq(cfg: ModelConfig, dim: int, local: jax.Array | bool) -> jax.Array:
    """The rotary frequencies of a layer: sliding-window layers of a ``global_every`` model take
    ``local_rope_base`` without scaling, the others ``rope_base`` with ``rope_scaling``."""
    global_freq = rope_inv_freq(dim, cfg.rope_base, cfg)
    if not cfg.global_every:
        return global_freq
    local_freq = rope_inv_freq(dim, cfg.local_rope_base or cfg.rope_base)
    return jnp.where(local, local_freq, global_freq)


def _check_pallas_gpu(device_kind: str, dtype) -> None:
    """The Pallas kernel compiled for a GPU: Mosaic GPU present, sm_90, bf16/fp16."""
    check_mosaic_gpu("attention='pallas'", device_kind, "attention='cudnn' or 'xla'")
    if dtype not in (jnp.bfloat16, jnp.float16):
        raise ValueError(
            f"model.attention='pallas' on a GPU needs bf16 or fp16 params, got {dtype}; "
            "set precision.params to bf16/fp16 or use attention='xla'"
        )


def check_mosaic_gpu(setting: str, device_kind: str, instead: str) -> None:
    """One line where ``model.<setting>``'s Mosaic GPU kernel cannot be compiled for the step's
    GPU: not sm_90 (wgmma and TMA are Hopper's), or this jax has no Mosaic GPU backend."""
    if device_kind and not HOPPER.search(device_kind):
        raise ValueError(
            f"model.{setting} compiles a Mosaic GPU kernel for sm_90 GPUs (H100, H200), "
            f"but the step is compiled for {device_kind!r}; use {instead} there"
        )
    problem = pallas_kernel("mosaic_gpu_problem", setting)()
    if problem:
        raise ValueError(f"model.{setting}: {problem}")


class Attention(nn.Module):
    """Grouped-query attention in three steps a chunked layer (``model.layer_chunk``) can also
    call one at a time: ``project`` (q, k, v with their norms and rotation), ``attend`` (the
    attention core) and ``output`` (the output projection)."""

    cfg: ModelConfig

    def setup(self):
        cfg = self.cfg
        heads, kv_heads, dim = cfg.num_heads, num_kv_heads(cfg), head_dim(cfg)
        qkv_bias = cfg.attn_bias in ("qkv", "all")
        self.query = Dense((heads, dim), (EMBED, HEADS, HEAD_DIM), use_bias=qkv_bias)
        self.key = Dense((kv_heads, dim), (EMBED, KV_HEADS, HEAD_DIM), use_bias=qkv_bias)
        self.value = Dense((kv_heads, dim), (EMBED, KV_HEADS, HEAD_DIM), use_bias=qkv_bias)
        if cfg.qk_norm:  # per head, over head_dim (Qwen3, Gemma 3)
            self.query_norm = self._head_norm()
            self.key_norm = self._head_norm()
        # Row-parallel output projection, init scaled down so the residual stream does not grow
        # with depth.
        self.out = Dense(
            (cfg.embed_dim,),
            (HEADS, HEAD_DIM, EMBED),
            contract=2,
            stddev=_output_std(cfg),
            use_bias=cfg.attn_bias == "all",
        )

    def __call__(
        self,
        x: jax.Array,
        segment_ids: jax.Array | None = None,
        positions: jax.Array | None = None,
        layer: jax.Array | None = None,
    ) -> jax.Array:
        q, k, v = self.project(x, positions, layer)
        return self.output(self.attend(q, k, v, segment_ids, layer))

    def project(self, x: jax.Array, positions: jax.Array | None, layer: jax.Array | None):
        """``(q, k, v)`` of the normed input ``x`` [B, S, embed], rotated and scaled."""
        cfg = self.cfg
        q, k, v = self.query(x), self.key(x), self.value(x)
        q, k, v = (saved_output(cfg, t, n) for t, n in zip((q, k, v), MATMUL_OUTPUTS))
        if cfg.qk_norm:
            q, k = self.query_norm(q), self.key_norm(k)
        if cfg.positions == "rope":
            inv_freq = _layer_inv_freq(cfg, head_dim(cfg), is_local_layer(cfg, layer))
            q, k = rotate(q, inv_freq, positions), rotate(k, inv_freq, positions)
        dim = head_dim(cfg)
        if cfg.query_pre_attn_scalar and cfg.query_pre_attn_scalar != dim:
            # Every attention path scales by 1 / sqrt(head_dim): fold the rest into q.
            q = (q * math.sqrt(dim / cfg.query_pre_attn_scalar)).astype(q.dtype)
        return q, k, v

    def attend(self, q, k, v, segment_ids, layer) -> jax.Array:
        """The attention core over the whole row: [B, S, heads, head_dim]."""
        cfg = self.cfg
        local = is_local_layer(cfg, layer)
        # Initialisation only needs shapes (and runs on fp32 params, on any backend): use the
        # portable path there so a cuDNN/Pallas config can be initialised and inspected anywhere.
        implementation = "xla" if self.is_initializing() else cfg.attention
        if isinstance(local, bool):
            return self._attend(
                q, k, v, implementation, cfg.sliding_window if local else 0, segment_ids
            )
        # A layer index traced by the scan: both windows compiled, one run per layer.
        return lax.cond(
            local,
            lambda: self._attend(q, k, v, implementation, cfg.sliding_window, segment_ids),
            lambda: self._attend(q, k, v, implementation, 0, segment_ids),
        )

    def output(self, out: jax.Array) -> jax.Array:
        """The output projection of the attention core's ``out``."""
        return saved_output(self.cfg, self.out(out), "attn_out")

    def _head_norm(self) -> Norm:
        cfg = self.cfg
        return Norm("rmsnorm", cfg.norm_eps, cfg.norm_offset, HEAD_DIM)

    def _attend(self, q, k, v, implementation: str, window: int, segment_ids) -> jax.Array:
        cfg = self.cfg
        if context_size() > 1:  # inside the step, this device holds a part of every row
            if cfg.attn_softcap:
                raise ValueError(
                    f"model.attn_softcap={cfg.attn_softcap} cannot run with a context axis "
                    "(parallel.context > 1): its attention has no score soft-capping"
                )
            check_implementation(implementation, q.dtype, q.shape[-1])
            return context_attention(
                q, k, v, cfg.context_attention, implementation, window, segment_ids
            )
        if cfg.attn_softcap:
            return softcapped_attention(q, k, v, cfg.attn_softcap, window, segment_ids)
        return causal_attention(q, k, v, implementation, window, segment_ids)


def _output_std(cfg: ModelConfig) -> float:
    return INIT_STD / math.sqrt(2 * cfg.num_layers)


class Mlp(nn.Module):
    cfg: ModelConfig

    def _projection(self, features: int, kernel_axes, stddev: float, name: str, layout_seed: int):
        if self.cfg.mlp == "block_sparse":
            traits = backend.current()
            if traits.platform == "gpu":
                check_mosaic_gpu("mlp='block_sparse'", traits.device_kind, "mlp='dense'")
            block_sparse_dense = pallas_kernel("BlockSparseDense", "mlp='block_sparse'")
            return block_sparse_dense(
                features,
                block_size=self.cfg.mlp_block_size,
                density=self.cfg.mlp_density,
                layout_seed=layout_seed,
                kernel_axes=kernel_axes,
                stddev=stddev,
                name=name,
            )
        return Dense((features,), kernel_axes, stddev=stddev, use_bias=self.cfg.mlp_bias, name=name)

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        cfg = self.cfg
        up = self._projection(cfg.mlp_dim, (EMBED, MLP), INIT_STD, "up", layout_seed=0)(x)
        up = saved_output(cfg, up, "mlp_up")
        if cfg.mlp_activation in GATED:
            gate = self._projection(cfg.mlp_dim, (EMBED, MLP), INIT_STD, "gate", layout_seed=1)(x)
            gate = saved_output(cfg, gate, "mlp_gate")
            if cfg.mlp_activation == "swiglu":
                hidden = nn.silu(gate) * up
            else:  # geglu: Gemma's gelu_pytorch_tanh gate
                hidden = nn.gelu(gate, approximate=True) * up
        else:  # 'gelu' is the tanh approximation (GPT-2's gelu_new), 'gelu_exact' the erf form
            hidden = nn.gelu(up, approximate=cfg.mlp_activation == "gelu")
        down = self._projection(
            cfg.embed_dim, (MLP, EMBED), _output_std(cfg), "down", layout_seed=2
        )(hidden)
        return saved_output(cfg, down, "mlp_down")


def _mlp_chunk(mlp: Mlp, carry, x):
    return carry, mlp(x)


def tiled_mlp(mlp: Mlp, x: jax.Array, chunk: int) -> jax.Array:
    """``mlp`` on [B, S, D] in sequence chunks of ``chunk`` positions, each under remat: the
    backward pass recomputes one chunk's [B, chunk, mlp_dim] intermediates at a time, so they
    are never held for the whole sequence. The weights are the same for every chunk (broadcast
    into the loop); a sequence that ``chunk`` does not divide is padded with zero rows, whose
    outputs are dropped."""
    batch, seq, width = x.shape
    chunks = -(-seq // chunk)
    padded = jnp.pad(x, ((0, 0), (0, chunks * chunk - seq), (0, 0)))
    over_chunks = nn.scan(
        nn.remat(_mlp_chunk, prevent_cse=False),
        variable_broadcast="params",
        split_rngs={"params": False},
        in_axes=1,
        out_axes=1,
    )
    _, y = over_chunks(mlp, None, padded.reshape(batch, chunks, chunk, width))
    return y.reshape(batch, chunks * chunk, width)[:, :seq]


def _pieces(cfg: ModelConfig, chunk: int, context) -> layer_chunk.Pieces:
    positions, segment_ids, layer = context
    fp8 = cfg.remat_dtype == "fp8" and cfg.remat in FP8_INPUT_REMATS

    def read(x, saved, i):
        if not fp8:
            return layer_chunk.chunk_of(x, i, chunk)
        q_bytes, scale = saved  # the e4m3 bytes of the whole input, its one scale
        return fp8_saved.dequantized(layer_chunk.chunk_of(q_bytes, i, chunk), scale, x.dtype)

    def norm(p, name, y):
        return Norm(cfg.norm, cfg.norm_eps, cfg.norm_offset).apply({"params": p[name]}, y)

    def attn(p, *args, method):
        return Attention(cfg).apply({"params": p["attn"]}, *args, method=method)

    def qkv(p, read_c, i):
        normed = norm(p, "attn_norm", read_c)
        return attn(
            p, normed, layer_chunk.chunk_of(positions, i, chunk), layer, method=Attention.project
        )

    def attend(p, q, k, v):
        return attn(p, q, k, v, segment_ids, layer, method=Attention.attend)

    def project_out(p, out_c):
        return attn(p, out_c, method=Attention.output)

    def after_projection(p, attn_out, read_c):
        if cfg.post_norms:
            attn_out = norm(p, "attn_post_norm", attn_out)
        # As in Block: the MLP's norm reads the input (rounded, with FP8 inputs) + attn_out.
        mlp_out = Mlp(cfg).apply({"params": p["mlp"]}, norm(p, "mlp_norm", read_c + attn_out))
        if cfg.post_norms:
            mlp_out = norm(p, "mlp_post_norm", mlp_out)
        return attn_out, mlp_out

    def branches(p, out_c, read_c):
        return after_projection(p, project_out(p, out_c), read_c)

    return layer_chunk.Pieces(read, qkv, attend, branches, project_out, after_projection)


class Block(nn.Module):
    """Pre-norm decoder block; ``(x, None)`` out so nn.scan can stack it. ``segment_ids`` and
    ``positions`` (packed examples, or None) are the same for every layer; ``layer`` (the
    scan's index) is passed only where layers differ (``global_every``)."""

    cfg: ModelConfig
    deterministic: bool = True

    @nn.compact
    def __call__(
        self,
        x: jax.Array,
        segment_ids: jax.Array | None = None,
        positions: jax.Array | None = None,
        layer: jax.Array | None = None,
    ) -> tuple[jax.Array, None]:
        cfg = self.cfg
        x = checkpoint_name(x, LAYER_INPUT)
        if layer_chunk.chunks_layer(cfg, x.shape[1]) and not self.is_initializing():
            params = self.variables["params"]
            pieces = functools.partial(_pieces, cfg, cfg.layer_chunk)
            return layer_chunk.chunked_block(
                cfg, pieces, params, x, segment_ids, positions, layer
            ), None
        read = layer_input_read(cfg, x)
        drop = functools.partial(nn.Dropout(cfg.dropout), deterministic=self.deterministic)
        attn_in = self._norm("attn_norm")(read)
        attn_out = Attention(cfg, name="attn")(attn_in, segment_ids, positions, layer)
        if cfg.post_norms:
            attn_out = self._norm("attn_post_norm")(attn_out)
        attn_out = drop(attn_out)
        # The residual stream stays exact; with FP8 layer inputs the MLP's norm reads the
        # rounded input too, so the backward pass needs nothing but the rounded input's bytes.
        exact = read is x
        x = x + attn_out
        mlp_norm_in = x if exact else read + attn_out
        mlp, mlp_in = Mlp(cfg, name="mlp"), self._norm("mlp_norm")(mlp_norm_in)
        if 0 < cfg.mlp_chunk < x.shape[1] and not self.is_initializing():
            mlp_out = tiled_mlp(mlp, mlp_in, cfg.mlp_chunk)
        else:
            mlp_out = mlp(mlp_in)
        if cfg.post_norms:
            mlp_out = self._norm("mlp_post_norm")(mlp_out)
        return x + drop(mlp_out), None

    def _norm(self, name: str) -> Norm:
        return Norm(self.cfg.norm, self.cfg.norm_eps, self.cfg.norm_offset, name=name)


def _rematted(
    block: type[nn.Module], remat: str, fetched: bool, remat_dtype: str = "compute"
) -> type[nn.Module]:
    """``block`` under the ``remat`` policy. ``fetched``: the engine fetches each layer's
    weights inside the block (``layer_transform``); they are then never kept for the backward
    pass, even with remat "none" (the engine fetches them again, see ``zeroflow.engine.grads``).
    ``remat_dtype='fp8'``: only the e4m3 bytes and scales of the matmul outputs
    (``saved_output``) or of the layer input (``layer_input_read``) are kept (``fp8_policy``)."""
    # prevent_cse=False is safe (and faster) because the block runs inside a scan.
    # remat 'none' with fp8 (refused by the config) runs as 'none': nothing is saved by a
    # policy there, and sweeps over remat policies (zeroflow.memory) keep the model's dtype.
    if remat_dtype == "fp8" and remat in FP8_REMATS:
        return nn.remat(block, prevent_cse=False, policy=fp8_policy(remat))
    if remat == "full":
        return nn.remat(block, prevent_cse=False)
    if remat == "save_dots":
        # Keep the projection matmul outputs; recompute attention scores, which are O(seq^2).
        # Fetched weights are no dot outputs, so they are recomputed too.
        return nn.remat(
            block,
            prevent_cse=False,
            policy=jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
        )
    if remat in OFFLOADED:
        policy = offload_policy(backend.current(), remat)
        return nn.remat(block, prevent_cse=False, policy=policy)
    if fetched:
        return nn.remat(block, prevent_cse=False, policy=save_all_but_fetched)
    return block


def fp8_policy(remat: str):
    """The policy of ``remat_dtype='fp8'``: only the e4m3 bytes and scales, the matmul outputs'
    (save_dots, offload_dots) or the layer inputs' (full, offload_input), kept in device memory
    or, for the offloading policies, in pinned host memory (in device memory where host memory
    is the device's)."""
    if remat not in OFFLOADED:
        return fp8_saved.policy()
    return fp8_saved.policy(offload=_host_memory_for(backend.current(), remat, "FP8 "))


def _host_memory_for(traits: backend.Traits, remat: str, kind: str = "") -> bool:
    """Whether ``traits``' devices have host memory of their own to offload ``remat``'s values
    to; where they do not (XLA:CPU), a warning says they stay in device memory."""
    if not traits.separate_host_memory:
        what = "matmul outputs" if remat == "offload_dots" else "layer inputs"
        warnings.warn(
            f"model.remat={remat!r}: {traits.platform} has no separate host memory; "
            f"the {kind}{what} are kept in device memory instead",
            stacklevel=3,
        )
    return traits.separate_host_memory


def offload_policy(traits: backend.Traits, remat: str = "offload_dots"):
    """An offloading remat policy: the values it names (``OFFLOADED[remat]``) are copied to
    pinned host memory in the forward pass and back for the backward pass; everything else is
    recomputed. 'offload_dots': the block's matmul outputs (``MATMUL_OUTPUTS``), norms, attention
    scores and fetched weights recomputed; 'offload_input': only the block's input (as remat
    'full', whose one saved activation it is). Where host memory is the device's own (XLA:CPU)
    the copies would save nothing: the values stay in device memory ('save_dots' and 'full')."""
    names = OFFLOADED[remat]
    if not _host_memory_for(traits, remat):
        return jax.checkpoint_policies.save_only_these_names(*names)
    return jax.checkpoint_policies.save_and_offload_only_these_names(
        names_which_can_be_saved=[],
        names_which_can_be_offloaded=list(names),
        offload_src="device",
        offload_dst="pinned_host",
    )


def unembed_vocab_axis(cfg: ModelConfig) -> int:
    """The vocabulary axis of the output projection: 0 for the tied embedding [vocab, embed],
    1 for ``lm_head`` [embed, vocab]."""
    return 0 if cfg.tie_embeddings else 1


LAYER_STACK = "layers"
"Top-level params key of the scanned blocks (leading layer axis): ``gather_per_layer`` of the engine."


class GPT(nn.Module):
    """``tokens [B, S] int32 -> logits [B, S, vocab] float32``.

    Packed rows pass ``segment_ids`` [B, S] (attention stays inside a segment) and
    ``positions`` [B, S] (restarting at 0 in every segment). ``return_hidden=True``: instead of
    the logits, ``(hidden, unembed)``, the final-norm hidden states [B, S, embed] in the
    unembedding's dtype and the output projection, [embed, vocab] or, with tied embeddings,
    [vocab, embed] (``unembed_vocab_axis``), for a loss that projects them itself (the chunked
    cross-entropy).
    """

    cfg: ModelConfig
    layer_transform: Callable[[Any], Any] | None = None
    "Applied to each layer's params inside the scan: ZeRO-3 gathers one layer at a time with it."

    @nn.compact
    def __call__(
        self,
        tokens: jax.Array,
        *,
        deterministic: bool = True,
        segment_ids: jax.Array | None = None,
        positions: jax.Array | None = None,
        return_hidden: bool = False,
    ) -> jax.Array | tuple[jax.Array, jax.Array]:
        cfg = self.cfg
        check_config(cfg)
        block = Block
        if self.layer_transform is not None and not self.is_initializing():
            transform = self.layer_transform
            block = nn.map_variables(
                Block, "params", trans_in_fn=lambda v: {**v, "params": transform(v["params"])}
            )
        embedding = _param(
            self,
            "embedding",
            nn.initializers.normal(INIT_STD),
            (cfg.vocab_size, cfg.embed_dim),
            (VOCAB, EMBED),
        )
        x = jnp.take(embedding, tokens, axis=0)
        if cfg.scale_embeddings:  # Gemma: sqrt(width) rounded to the compute dtype first
            x = x * jnp.asarray(math.sqrt(cfg.embed_dim), x.dtype)
        if positions is None and context_size() > 1:  # each token's place in the whole row
            positions = token_index(tokens.shape[-1], cfg.context_attention)[None]
        if cfg.positions == "learned":
            x = x + self._learned_positions(tokens.shape[-1], positions).astype(x.dtype)
        x = nn.Dropout(cfg.dropout)(x, deterministic=deterministic)
        # Initialising needs only shapes: no backend to ask where activations may go.
        remat = INIT_REMAT.get(cfg.remat, cfg.remat) if self.is_initializing() else cfg.remat
        # Layers that differ (global_every) get their index as a scanned input.
        per_layer = (jnp.arange(cfg.num_layers),) if cfg.global_every else ()
        stack = nn.scan(
            _rematted(block, remat, fetched=block is not Block, remat_dtype=cfg.remat_dtype),
            variable_axes={"params": 0},
            split_rngs={"params": True, "dropout": True},
            in_axes=(nn.broadcast, nn.broadcast, *(0 for _ in per_layer)),
            length=cfg.num_layers,
            metadata_params={nn.PARTITION_NAME: LAYERS},
        )
        x, _ = stack(cfg, deterministic, name=LAYER_STACK)(x, segment_ids, positions, *per_layer)
        x = Norm(cfg.norm, cfg.norm_eps, cfg.norm_offset, name="final_norm")(x)
        if cfg.tie_embeddings:
            unembed, spec = embedding, "bsd,vd->bsv"
        else:
            unembed = _param(
                self,
                "lm_head",
                nn.initializers.normal(INIT_STD),
                (cfg.embed_dim, cfg.vocab_size),
                (EMBED, VOCAB),
            )
            spec = "bsd,dv->bsv"
        if return_hidden:
            if cfg.logit_softcap:
                raise ValueError("model.logit_softcap: the hidden states alone miss the cap")
            return x.astype(unembed.dtype), unembed
        with jax.named_scope("lm_head"):  # a scope autocast='fp8' keeps bf16 by default
            logits = jnp.einsum(
                spec, x.astype(unembed.dtype), unembed, preferred_element_type=jnp.float32
            )
        if cfg.logit_softcap:  # Gemma 2's final_logit_softcapping
            logits = cfg.logit_softcap * jnp.tanh(logits / cfg.logit_softcap)
        return logits.astype(jnp.float32)

    def _learned_positions(self, length: int, positions: jax.Array | None = None) -> jax.Array:
        """The first ``length`` rows of the learned position table (GPT-2's ``wpe``), or the
        rows ``positions`` names."""
        table = _param(
            self,
            "position_embedding",
            nn.initializers.normal(INIT_STD),
            (max_positions(self.cfg), self.cfg.embed_dim),
            (POSITIONS, EMBED),
        )
        if length > table.shape[0]:
            raise ValueError(
                f"sequence of {length} tokens is longer than the "
                f"{table.shape[0]} learned positions (model.max_positions)"
            )
        return table[:length] if positions is None else jnp.take(table, positions, axis=0)


# ---------------------------------------------------------------------------------------------
# Parameters: init without boxes, shapes without allocation, logical axes.


def _boxed_init(cfg: ModelConfig, rng: jax.Array):
    tokens = jnp.zeros((1, cfg.seq_len), jnp.int32)
    return GPT(cfg).init({"params": rng}, tokens)["params"]


def param_init_fn(cfg: ModelConfig) -> Callable[[jax.Array], Any]:
    """``rng -> plain fp32 params``; jit it with ``out_shardings`` to build sharded params."""
    return lambda rng: nn.unbox(_boxed_init(cfg, rng))


def logical_axes(cfg: ModelConfig):
    """Tree parallel to the params with one tuple of axis names per leaf (no allocation).

    Tuples are pytrees: map over it with ``jax.tree.map(f, params, axes)`` (params first) or
    ``is_leaf=zeroflow.models.axes.is_axis_names``.
    """
    boxed = jax.eval_shape(functools.partial(_boxed_init, cfg), jax.random.key(0))
    return jax.tree.map(
        lambda box: tuple(box.names),
        boxed,
        is_leaf=lambda x: isinstance(x, nn.LogicallyPartitioned),
    )


def init_params(cfg: ModelConfig, rng: jax.Array):
    """``(params, logical_axes)``: plain fp32 arrays and their axis-name tuples."""
    return jax.jit(param_init_fn(cfg))(rng), logical_axes(cfg)


def abstract_params(cfg: ModelConfig):
    """``(ShapeDtypeStruct tree, logical_axes)`` without allocating any parameter. Tracing the
    init takes a fraction of a second; planners ask for the same model many times, so the
    result is kept per model config (a fresh copy of the trees each call)."""
    shapes, axes = _abstract_params(tuple(sorted(vars(cfg).items())))
    return (
        jax.tree.map(lambda x: x, shapes),
        jax.tree.map(lambda x: x, axes, is_leaf=lambda x: isinstance(x, tuple)),
    )


@functools.lru_cache(maxsize=32)
def _abstract_params(fields: tuple):
    cfg = ModelConfig(**dict(fields))
    return jax.eval_shape(param_init_fn(cfg), jax.random.key(0)), logical_axes(cfg)


def count_params(params) -> int:
    """Number of scalars in a params tree (arrays or ShapeDtypeStructs)."""
    return sum(math.prod(leaf.shape) for leaf in jax.tree.leaves(params))


def decay_mask(params):
    """True where AdamW weight decay applies: every parameter except norm scales and biases.

    Decided by the leaf's name, not its rank: stacked norm scales are 2-D [layers, embed].
    """

    def decays(path, _):
        return getattr(path[-1], "key", None) not in ("scale", "bias")

    return jax.tree_util.tree_map_with_path(decays, params)
