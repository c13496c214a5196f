"""A Llama-shaped loss in plain JAX, the model of ``experiments/vs_gspmd.py``.

RMSNorm, rotary embeddings, grouped-query attention, SwiGLU; the layers' weights are stacked
on a leading axis and run by ``lax.scan`` under ``jax.checkpoint`` (remat "full": only each
layer's input is kept; "dots": matmul outputs without batch dimensions are kept too). Compute
is in bf16 whatever the parameters' dtype (the fp32 masters of a plain ``jax.jit`` step are cast
inside the loss); nothing here knows about zeroflow.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

from zeroflow.cli.common import start_script

start_script()  # before jax: where the CUDA plugin has no driver, a CPU jax without its noise

import jax
import jax.numpy as jnp
import optax

HF_CONFIGS = Path(__file__).resolve().parent.parent / "configs" / "hf"


def hf_shape(name: str) -> dict:
    """A shape from the Hugging Face ``config.json`` the repo ships (``configs/hf/<name>``)."""
    c = json.loads((HF_CONFIGS / name / "config.json").read_text())
    keys = dict(layers="num_hidden_layers", d="hidden_size", ffn="intermediate_size",
                heads="num_attention_heads", kv="num_key_value_heads", vocab="vocab_size")
    return {k: c[v] for k, v in keys.items()}


SHAPES = {
    "tiny": dict(layers=4, d=256, ffn=512, heads=4, kv=2, vocab=1024),
    "1b": dict(layers=16, d=2048, ffn=8192, heads=16, kv=8, vocab=32000),
    "8b": hf_shape("llama-3.1-8b"),
    "70b": hf_shape("llama-3.1-70b"),
}
"Llama-3-8B and -70B shapes (Llama 3.1's configs: the same shapes), a ~1B one with Llama-2's"
" vocabulary, and a tiny one for CPU runs."

POLICIES = {"full": None, "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable}


def abstract_params(shape: dict, dtype=jnp.float32) -> dict:
    """The parameter tree as ``jax.ShapeDtypeStruct``s (nothing allocated)."""
    layers, d, ffn, vocab = shape["layers"], shape["d"], shape["ffn"], shape["vocab"]
    head_dim = d // shape["heads"]
    kv_width = shape["kv"] * head_dim

    def leaf(*dims):
        return jax.ShapeDtypeStruct(dims, dtype)

    return {"embed": leaf(vocab, d), "head": leaf(d, vocab), "norm": leaf(d),
            "layers": {"attn_norm": leaf(layers, d), "mlp_norm": leaf(layers, d),
                       "wq": leaf(layers, d, d), "wk": leaf(layers, d, kv_width),
                       "wv": leaf(layers, d, kv_width), "wo": leaf(layers, d, d),
                       "w1": leaf(layers, d, ffn), "w3": leaf(layers, d, ffn),
                       "w2": leaf(layers, ffn, d)}}


def init_params(shape: dict, seed: int = 0) -> dict:
    """Real fp32 parameters (for the small CPU run): normal(0, 0.02), norms' gains at 0
    (the norm multiplies by ``1 + gain``)."""
    leaves, tree = jax.tree.flatten(abstract_params(shape))
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    return jax.tree.unflatten(tree, [0.02 * jax.random.normal(k, s.shape, s.dtype)
                                     for k, s in zip(keys, leaves)])


def num_params(shape: dict) -> int:
    return sum(math.prod(s.shape) for s in jax.tree.leaves(abstract_params(shape)))


def _rms_norm(x, gain):
    x32 = x.astype(jnp.float32)
    scale = jax.lax.rsqrt(jnp.mean(x32 * x32, -1, keepdims=True) + 1e-6)
    return (x32 * scale).astype(x.dtype) * (1 + gain)


def _rotary(x):
    """Rotary position embedding of ``[batch, time, heads, head_dim]``."""
    time, head_dim = x.shape[1], x.shape[-1]
    freq = 1.0 / (10000 ** (jnp.arange(0, head_dim, 2) / head_dim))
    angle = jnp.arange(time)[:, None] * freq[None]
    cos, sin = jnp.cos(angle)[:, None, :], jnp.sin(angle)[:, None, :]
    even, odd = x[..., ::2], x[..., 1::2]
    return jnp.concatenate([even * cos - odd * sin, even * sin + odd * cos], -1).astype(x.dtype)


def _matmul(x, w, name):
    """A layer's weight matmul (``name``: the weight's key, for callers that swap it)."""
    del name
    return x @ w


def _layer(shape, dtype, x, p, constrain=lambda a: a, attention="xla", matmul=_matmul):
    """One decoder layer; ``constrain`` is applied to every activation (the identity unless a
    caller pins the activations' sharding, as MaxText's logical axis rules do); ``matmul(x, w,
    name)`` runs each weight matmul (``x @ w``; experiments/gspmd_fp8.py puts Flax's FP8 dot
    there)."""
    heads, kv = shape["heads"], shape["kv"]
    batch, time, d = x.shape
    head_dim = d // heads
    w = jax.tree.map(lambda a: a.astype(dtype), p)
    x = constrain(x)
    y = constrain(_rms_norm(x, w["attn_norm"]))
    q = constrain(_rotary((matmul(y, w["wq"], "wq")).reshape(batch, time, heads, head_dim)))
    k = constrain(_rotary((matmul(y, w["wk"], "wk")).reshape(batch, time, kv, head_dim)))
    v = constrain((matmul(y, w["wv"], "wv")).reshape(batch, time, kv, head_dim))
    o = constrain(jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation=attention))
    x = constrain(x + matmul(o.reshape(batch, time, d), w["wo"], "wo"))
    y = constrain(_rms_norm(x, w["mlp_norm"]))
    h = constrain(jax.nn.silu(matmul(y, w["w1"], "w1")) * matmul(y, w["w3"], "w3"))
    return constrain(x + matmul(h, w["w2"], "w2")), None


def make_loss(shape: dict, remat: str = "full", dtype=jnp.bfloat16, constrain=None,
              attention: str = "xla"):
    """``loss(params, batch)``: next-token cross-entropy of ``batch["tokens"]`` ([B, T+1]).
    ``constrain``: applied to every activation (e.g. ``batch_constraint``); ``attention``:
    ``jax.nn.dot_product_attention``'s implementation ("xla" or "cudnn")."""
    constrain = constrain or (lambda a: a)
    body = jax.checkpoint(lambda x, p: _layer(shape, dtype, x, p, constrain, attention),
                          policy=POLICIES[remat])

    def loss(params, batch):
        tokens = batch["tokens"]
        x = constrain(params["embed"].astype(dtype)[tokens[:, :-1]])
        x, _ = jax.lax.scan(body, x, params["layers"])
        x = constrain(_rms_norm(x, params["norm"].astype(dtype)))
        logits = constrain((x @ params["head"].astype(dtype)).astype(jnp.float32))
        return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()
    return loss


def batch_constraint(mesh, axis: str = "data"):
    """What MaxText's logical axis rules do to activations under FSDP: every activation's
    leading (batch) dimension pinned to ``axis``, the rest replicated, so GSPMD never reshards
    a ``[batch, time, ...]`` activation along another dimension."""
    def constrain(x):
        spec = jax.sharding.PartitionSpec(axis, *[None] * (x.ndim - 1))
        return jax.lax.with_sharding_constraint(x, jax.sharding.NamedSharding(mesh, spec))
    return constrain
