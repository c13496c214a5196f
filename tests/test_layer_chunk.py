"""``model.layer_chunk``: each decoder layer's per-position work (norms, q/k/v and output
projections, the MLP) in chunks of positions, with its own backward pass and the attention per
key/value head group. The option must be exact: its loss and gradients are checked against the
same GPT in one piece (float32), with grouped-query attention, packed rows, FP8 layer inputs,
the Gemma/Qwen options and sliding windows on every other layer; and what the chunks hold: no
value of the step has the MLP width over more than one chunk."""
import dataclasses
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from zeroflow.config.schema import ModelConfig
from zeroflow.models import init_params, make_loss_fn
from helpers import walk

pytestmark = pytest.mark.fast

CFG = ModelConfig(vocab_size=61, seq_len=24, num_layers=2, embed_dim=32, num_heads=4,
                  num_kv_heads=2, mlp_dim=48, remat="full", rope_base=500.0)
CHUNK = 8
"Three chunks of the 24 positions: a chunk that starts at 0 would hide a wrong offset."


def batch(cfg, packed: bool, rows=2, seed=0):
    """A row of random tokens, or (``packed``) two examples per row: segments 1 and 2 with
    positions restarting at the 10th token, across a chunk boundary."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, cfg.vocab_size, (rows, cfg.seq_len + 1)).astype(np.int32)
    if not packed:
        return {"tokens": tokens}
    seq, cut = cfg.seq_len, 10
    at = np.arange(seq)
    return {"tokens": tokens[:, :-1], "targets": tokens[:, 1:],
            "loss_mask": np.ones((rows, seq), bool),
            "segment_ids": np.where(at < cut, 1, 2)[None].repeat(rows, 0).astype(np.int32),
            "positions": np.where(at < cut, at, at - cut)[None].repeat(rows, 0).astype(np.int32)}


def loss_and_grads(cfg, params, data):
    with warnings.catch_warnings():  # XLA:CPU keeps "offloaded" values on the device
        warnings.filterwarnings("ignore", "model.remat=")
        fn = jax.jit(jax.value_and_grad(make_loss_fn(cfg), has_aux=True))
        (loss, _), grads = fn(params, data)
    return loss, grads


@pytest.mark.parametrize("packed", [False, True], ids=["row", "packed"])
@pytest.mark.parametrize("variant", [
    dict(),
    dict(remat="offload_input", remat_dtype="fp8"),
    dict(remat="none", qk_norm=True, post_norms=True, attn_bias="all", norm="layernorm"),
    dict(sliding_window=6, global_every=2, num_kv_heads=4),
], ids=["full", "fp8-inputs", "qknorm-postnorms-bias", "windows-every-other-layer-mha"])
def test_the_chunked_layer_gives_the_loss_and_gradients_of_the_layer_in_one_piece(packed,
                                                                                   variant):
    plain = dataclasses.replace(CFG, **variant)
    chunked = dataclasses.replace(plain, layer_chunk=CHUNK)
    params, _ = init_params(plain, jax.random.key(0, impl="rbg"))
    # Weights far from their init scale, so every branch moves the residual stream.
    params = jax.tree.map(lambda p: p * 5.0 if p.ndim > 1 else p + 0.3, params)
    data = batch(plain, packed)
    want_loss, want = loss_and_grads(plain, params, data)
    got_loss, got = loss_and_grads(chunked, params, data)
    np.testing.assert_allclose(got_loss, want_loss, rtol=1e-5)
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for (path, g), w in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(want)):
        scale = float(jnp.abs(w).max())
        assert scale > 0, path
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5 * scale, err_msg=str(path))


def test_the_chunked_layer_has_the_params_of_the_layer_in_one_piece():
    plain, _ = init_params(CFG, jax.random.key(0, impl="rbg"))
    chunked, _ = init_params(dataclasses.replace(CFG, layer_chunk=CHUNK), jax.random.key(0, impl="rbg"))
    assert jax.tree.structure(chunked) == jax.tree.structure(plain)
    for a, b in zip(jax.tree.leaves(chunked), jax.tree.leaves(plain)):
        np.testing.assert_array_equal(a, b)


def test_no_value_of_the_chunked_step_holds_the_mlp_width_over_more_than_a_chunk():
    """The MLP's intermediates ([rows, positions, mlp_dim]) of one chunk at a time, forward
    and backward, loops' bodies included; the check sees the whole row's without the option."""
    params, _ = init_params(CFG, jax.random.key(0, impl="rbg"))
    rows = 5  # a size no other axis has
    data = batch(CFG, packed=False, rows=rows)

    def widest(cfg):
        jaxpr = jax.make_jaxpr(jax.grad(make_loss_fn(cfg), has_aux=True))(params, data)
        return max(int(np.prod(v.aval.shape)) for e in walk(jaxpr) for v in e.outvars
                   if getattr(v.aval, "shape", ())[-1:] == (CFG.mlp_dim,)
                   and rows in v.aval.shape[:-1])

    assert widest(CFG) >= rows * CFG.seq_len * CFG.mlp_dim
    assert widest(dataclasses.replace(CFG, layer_chunk=CHUNK)) == rows * CHUNK * CFG.mlp_dim


@pytest.mark.parametrize("change, named", [
    (dict(layer_chunk=5), "model.layer_chunk=5 must divide the row's 24 positions"),
    (dict(layer_chunk=8, remat="save_dots"), "needs model.remat 'none', 'full' or"),
    (dict(layer_chunk=8, dropout=0.1), "needs model.dropout=0"),
    (dict(layer_chunk=-1), "model.layer_chunk=-1 must be >= 0"),
])
def test_what_the_chunked_layer_cannot_do_is_one_line_naming_it(change, named):
    cfg = dataclasses.replace(CFG, **change)
    params, _ = init_params(dataclasses.replace(cfg, layer_chunk=0), jax.random.key(0, impl="rbg"))
    with pytest.raises(ValueError, match=named) as caught:
        loss_and_grads(cfg, params, batch(cfg, packed=False))
    assert "\n" not in str(caught.value)


@pytest.mark.parametrize("strategy", ["allgather", "ring"])
def test_the_chunked_layer_with_the_row_split_over_devices_matches_whole_rows(strategy):
    """parallel.context=2 (each device holds half of every row: 16 of 32 positions, two
    chunks of 8) against the plain model on whole rows on one device (packed rows, fp32)."""
    from test_context_parallel import CFG as SPLIT, assert_grads_close, one_step, whole_rows

    cfg = dataclasses.replace(SPLIT, context_attention=strategy, layer_chunk=CHUNK)
    params, metrics, grads, _ = one_step(cfg, context=2, data=2, stage=3)
    (loss, _), want = whole_rows(params, 2)
    np.testing.assert_allclose(float(metrics["loss"]), float(loss), rtol=1e-6)
    assert_grads_close(grads, want, rtol=2e-5)
