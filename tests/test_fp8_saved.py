"""Saved activations in FP8 (``zeroflow/autocast/fp8_saved.py``, ``model.remat_dtype: fp8``) on
XLA:CPU, which computes with the float8 types.

References written here, not taken from zeroflow: the e4m3 rounding from its definition (NumPy
and ml_dtypes), a straight-through fake-quantised layer (``x + stop_gradient(round(x) - x)``,
no remat), and jax's own ``jax.checkpoint`` with ``dots_with_no_batch_dims_saveable`` in bf16.

The bound against bf16 is derived from e4m3's precision: every saved value is rounded once
with relative error at most ``u = 2^-4`` (3 mantissa bits; per-tensor scales keep the values
of these tests far above e4m3's subnormals), and a gradient entry is a sum of products in
which at most two rounded factors meet (silu(gate) * up), so to first order its relative
error is at most ``2u``; the relative L2 error of each gradient is held to ``2u = 0.125``.
Measured: 0.3-4% (rounding errors of random sign partly cancel in the sums).
"""
import contextlib
import dataclasses
import io

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.ad_checkpoint import print_saved_residuals

from zeroflow.autocast import fp8_saved
from zeroflow.config.io import ConfigError, apply_overrides, load_config
from zeroflow.config.schema import ModelConfig
from zeroflow.models.gpt import abstract_params
from zeroflow.models.loss import make_loss_fn

pytestmark = pytest.mark.fast

E4M3_MAX = 448.0
U = 2.0**-4
BOUND = 2 * U
D, F, HEADS = 64, 128, 4


def np_round_e4m3(x):
    """``x`` through e4m3 with one scale, ``amax / 448``, as the recipe defines it."""
    x = np.asarray(x, np.float32)
    amax = np.abs(x).max()
    scale = np.float32(amax / E4M3_MAX) if amax > 0 else np.float32(1.0)
    q = np.clip(x / scale, -E4M3_MAX, E4M3_MAX).astype(ml_dtypes.float8_e4m3fn)
    return q.astype(np.float32) * scale


def test_rounding_matches_e4m3_and_the_gradient_passes_straight_through():
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((32, 48)) * np.logspace(-2, 2, 48)).astype(np.float32)
    got, pullback = jax.vjp(fp8_saved.saved_in_fp8, jnp.asarray(x))
    np.testing.assert_array_equal(np.asarray(got), np_round_e4m3(x))
    assert np.abs(np.asarray(got) - x).max() <= U * np.abs(x).max()
    ct = rng.standard_normal(x.shape).astype(np.float32)
    np.testing.assert_array_equal(np.asarray(pullback(jnp.asarray(ct))[0]), ct)
    for dtype in (jnp.float16, jnp.bfloat16):  # a loss-scaled half gradient is never rounded
        big = jnp.asarray(ct * 2.0**12, dtype)
        _, half_pullback = jax.vjp(fp8_saved.saved_in_fp8, jnp.asarray(x, dtype))
        np.testing.assert_array_equal(np.asarray(half_pullback(big)[0]), np.asarray(big))
    # an overflow is not hidden: one inf makes the rounded tensor NaN (loss scaling skips it)
    assert np.isnan(np.asarray(fp8_saved.saved_in_fp8(jnp.asarray(x).at[0, 0].set(jnp.inf)))).all()


def _rms(x):
    x32 = x.astype(jnp.float32)
    return (x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, -1, keepdims=True) + 1e-6)).astype(x.dtype)


def layer(x, w, rounded=lambda a: a):
    """A Llama-like block in bf16 (attention, SwiGLU); ``rounded`` applied to every weight
    matmul's output (the reference's fake quantisation)."""
    b, t, _ = x.shape
    y = _rms(x)
    q, k, v = (rounded(y @ w[n]).reshape(b, t, HEADS, D // HEADS) for n in ("wq", "wk", "wv"))
    o = jax.nn.dot_product_attention(q, k, v, is_causal=True).reshape(b, t, D)
    x = x + rounded(o @ w["wo"])
    y = _rms(x)
    h = jax.nn.silu(rounded(y @ w["w1"])) * rounded(y @ w["w3"])
    return x + rounded(h @ w["w2"])


def straight_through_e4m3(a):
    """The reference rounding: e4m3 with one scale in the forward pass, identity gradient."""
    frozen = jax.lax.stop_gradient(a).astype(jnp.float32)
    amax = jnp.max(jnp.abs(frozen))
    scale = jnp.where(amax > 0, amax / E4M3_MAX, 1.0)
    r = (jnp.clip(frozen / scale, -E4M3_MAX, E4M3_MAX).astype(jnp.float8_e4m3fn)
         .astype(jnp.float32) * scale).astype(a.dtype)
    return a + jax.lax.stop_gradient(r - a)


def layer_inputs(seed=0):
    keys = jax.random.split(jax.random.key(seed), 8)
    shapes = {"wq": (D, D), "wk": (D, D), "wv": (D, D), "wo": (D, D), "w1": (D, F),
              "w3": (D, F), "w2": (F, D)}
    w = {n: (0.1 * jax.random.normal(k, s)).astype(jnp.bfloat16)
         for k, (n, s) in zip(keys, shapes.items())}
    x = jax.random.normal(keys[-1], (2, 32, D), jnp.bfloat16)
    ct = jax.random.normal(jax.random.key(seed + 1), (2, 32, D), jnp.bfloat16)
    return x, w, ct


def grads(fn, x, w, ct):
    out, pullback = jax.vjp(fn, x, w)
    return out, jax.tree.leaves(pullback(ct))


def rel(a, b):
    a, b = a.astype(jnp.float32), b.astype(jnp.float32)
    return float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b))


def saved(fn, *args) -> list[str]:
    text = io.StringIO()
    with contextlib.redirect_stdout(text):
        print_saved_residuals(fn, *args)
    return [ln for ln in text.getvalue().splitlines() if "from the argument" not in ln]


def test_checkpoint_fp8_dots_matches_a_fake_quantised_reference_and_bf16_within_the_bound():
    x, w, ct = layer_inputs()
    f8 = fp8_saved.checkpoint_fp8_dots(layer)
    out, got = grads(f8, x, w, ct)
    ref_out, ref = grads(lambda x, w: layer(x, w, straight_through_e4m3), x, w, ct)
    dots = jax.checkpoint(layer, policy=jax.checkpoint_policies.dots_with_no_batch_dims_saveable)
    bf16_out, bf16 = grads(dots, x, w, ct)
    assert rel(out, ref_out) < 1e-2  # the same rounding; bf16 reassociation only
    assert rel(out, bf16_out) < BOUND
    for g, r, b in zip(got, ref, bf16):
        assert rel(g, r) < 2e-2, rel(g, r)
        assert rel(g, b) < BOUND, rel(g, b)
    assert max(rel(g, b) for g, b in zip(got, bf16)) > 1e-3  # the rounding did happen
    # what stays for the backward pass: the matmul outputs as bytes and their scales only
    kept = saved(f8, x, w)
    assert kept and all(" named 'fp8_saved" in ln for ln in kept), kept
    assert sum("u8[" in ln for ln in kept) == 6  # q, k, v, o, w1, w3 (w2's is never read)


TINY = dict(vocab_size=64, seq_len=32, num_layers=2, embed_dim=64, num_heads=4, mlp_dim=128,
            remat="save_dots")


def gpt_grads(cfg, params, tokens):
    loss_fn = make_loss_fn(cfg)
    (loss, _), g = jax.jit(jax.value_and_grad(loss_fn, has_aux=True))(params, {"tokens": tokens})
    return loss, jax.tree.leaves(g)


def bf16_params(cfg, seed=0):
    rng = np.random.default_rng(seed)
    shapes, _ = abstract_params(cfg)

    def fill(path, s):
        if path[-1].key == "scale":
            return jnp.ones(s.shape, jnp.bfloat16)
        return jnp.asarray(0.05 * rng.standard_normal(s.shape), jnp.bfloat16)
    return jax.tree_util.tree_map_with_path(fill, shapes)


def test_gpt_remat_dtype_fp8_keeps_only_fp8_matmul_outputs_and_gradients_within_the_bound():
    base = ModelConfig(**TINY)
    f8 = ModelConfig(**TINY, remat_dtype="fp8")
    params = bf16_params(base)
    tokens = jax.random.randint(jax.random.key(3), (2, 33), 0, 64)
    loss, want = gpt_grads(base, params, tokens)
    loss8, got = gpt_grads(f8, params, tokens)
    assert abs(float(loss8) - float(loss)) < BOUND * float(loss)
    errors = [rel(g, b) for g, b in zip(got, want)]
    assert max(errors) < BOUND, errors
    assert max(errors) > 1e-3
    loss_fn = make_loss_fn(f8)
    layers = [ln for ln in saved(lambda p: loss_fn(p, {"tokens": tokens})[0], params)
              if "output of scan" in ln]  # what the scanned blocks keep, stacked over layers
    # q, k, v, attn_out, up, gate as bytes with a scale per layer; in bf16 only the layer input
    assert sum(ln.startswith("u8[2,") for ln in layers) == 6, layers
    assert sum(ln.startswith("f32[2] ") for ln in layers) == 6, layers
    assert [ln.split()[0] for ln in layers if ln.startswith("bf16")] == ["bf16[2,2,32,64]"]


def test_fp8_remat_dtype_needs_a_policy_that_saves_something():
    expected = ("model.remat_dtype='fp8' keeps saved activations in FP8: it needs a model.remat "
                "that saves some (save_dots, offload_dots, full, offload_input); got 'none'")
    with pytest.raises(ConfigError, match=expected.replace("(", r"\(").replace(")", r"\)")) as e:
        apply_overrides(load_config(None), ["model.remat=none", "model.remat_dtype=fp8"])
    assert "\n" not in str(e.value)
    # the model itself runs it as remat none (a sweep over remat policies keeps the dtype)
    params = bf16_params(ModelConfig(**TINY))
    tokens = jax.random.randint(jax.random.key(9), (2, 33), 0, 64)
    none = ModelConfig(**{**TINY, "remat": "none"})
    want = gpt_grads(none, params, tokens)
    got = gpt_grads(dataclasses.replace(none, remat_dtype="fp8"), params, tokens)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


def test_fp8_layer_inputs_keep_only_the_inputs_bytes_and_the_stream_exact():
    """remat full with remat_dtype fp8: the branches of each block read its input rounded
    through e4m3, the residual stream adds the exact input. Reference: the same block written
    here with the rounding as a straight-through fake quantisation, no remat."""
    base = ModelConfig(**{**TINY, "remat": "full"})
    f8 = ModelConfig(**{**TINY, "remat": "full"}, remat_dtype="fp8")
    params = bf16_params(base)
    tokens = jax.random.randint(jax.random.key(5), (2, 33), 0, 64)
    loss, want = gpt_grads(base, params, tokens)
    loss8, got = gpt_grads(f8, params, tokens)
    assert abs(float(loss8) - float(loss)) < BOUND * float(loss)
    errors = [rel(g, b) for g, b in zip(got, want)]
    assert 1e-3 < max(errors) < BOUND, errors
    loss_fn = make_loss_fn(f8)
    layers = [ln.split()[0] for ln in saved(lambda p: loss_fn(p, {"tokens": tokens})[0], params)
              if "output of scan" in ln]
    assert sorted(layers) == ["f32[2]", "u8[2,2,32,64]"], layers  # no bf16 layer-input stack


def test_fp8_layer_inputs_match_a_hand_written_block():
    """One block's output and gradients against the formula: out = x + attn(r) + mlp(norm(r +
    attn(r))) with r = x rounded through e4m3 (straight-through), the GPT's own block run with
    remat_dtype compute on r for the branches."""
    x = jax.random.normal(jax.random.key(6), (2, 32, 64), jnp.bfloat16)
    ct = jax.random.normal(jax.random.key(7), (2, 32, 64), jnp.bfloat16)
    from zeroflow.models.gpt import Block

    f8 = ModelConfig(**{**TINY, "remat": "full"}, remat_dtype="fp8")
    plain = ModelConfig(**{**TINY, "remat": "full"})
    variables = Block(plain).init(jax.random.key(8), x)
    variables = jax.tree.map(lambda a: a.astype(jnp.bfloat16), variables)

    def fp8_block(x):
        return Block(f8).apply(variables, x)[0]

    def reference(x):
        r = straight_through_e4m3(x)
        branches = Block(plain).apply(variables, r)[0] - r  # attn(r) + mlp(norm(r + attn(r)))
        return x + branches

    out, pull = jax.vjp(fp8_block, x)
    ref_out, ref_pull = jax.vjp(reference, x)
    assert rel(out, ref_out) < 1e-2
    assert rel(pull(ct)[0], ref_pull(ct)[0]) < 2e-2


def test_unknown_remat_dtype_is_one_line_naming_the_choices():
    with pytest.raises(ConfigError, match="model.remat_dtype must be one of compute, fp8; got 'e4m3'"):
        apply_overrides(load_config(None), ["model.remat_dtype=e4m3"])


def test_offload_dots_with_fp8_is_save_dots_with_fp8_where_host_memory_is_the_devices():
    params = bf16_params(ModelConfig(**TINY))
    tokens = jax.random.randint(jax.random.key(4), (2, 33), 0, 64)
    want = gpt_grads(ModelConfig(**TINY, remat_dtype="fp8"), params, tokens)
    offloaded = ModelConfig(**{**TINY, "remat": "offload_dots"}, remat_dtype="fp8")
    with pytest.warns(UserWarning, match="no separate host memory; the FP8 matmul outputs"):
        got = gpt_grads(offloaded, params, tokens)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
