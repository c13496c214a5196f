"""Leaves no dimension of which divides by the data axis: stored padded and sharded anyway,
invisibly to the loss, the optimizer and checkpoints."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import zeroflow as zf
from helpers import assert_leaves_close, assert_leaves_equal, bytes_on, optax_losses, train_losses

pytestmark = pytest.mark.fast

VOCAB, WIDTH = 50257, 100  # GPT-2's vocabulary: prime factors 29 x 1733; 100 = 4 x 25


def init_params():
    k1, k2 = jax.random.split(jax.random.key(0))
    return {"embedding": jax.random.normal(k1, (VOCAB, WIDTH)) * 0.02,
            "out_bias": jax.random.normal(k2, (VOCAB,)) * 0.01}


def loss_fn(params, batch):
    """Tied-embedding next-token loss: the whole table is read (and gets a gradient)."""
    h = params["embedding"][batch["tokens"]]
    logits = h @ params["embedding"].T + params["out_bias"]
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"]).mean()


def make_batches(count=3, size=16):
    rng = np.random.default_rng(0)
    return [{"tokens": rng.integers(0, VOCAB, size).astype(np.int32),
             "targets": rng.integers(0, VOCAB, size).astype(np.int32)} for _ in range(count)]


BATCHES = make_batches()
TX = optax.adamw(1e-2, weight_decay=0.1)


def test_embedding_at_stage3_holds_an_eighth_per_device_and_trains_like_one_device():
    plan, prec = zf.ZeroPlan(zf.make_mesh(), stage=3), zf.Precision()
    state = zf.init_train_state(init_params(), TX, plan, prec)
    whole = 4 * (VOCAB * WIDTH + VOCAB)
    for part in (state.master, state.opt_state[0].mu, state.opt_state[0].nu):
        assert bytes_on(jax.devices()[0], part) == pytest.approx(whole / 8, rel=1e-3)
    assert state.master["embedding"].shape == (50264, WIDTH)  # stored padded: 6283 rows each

    step = zf.make_train_step(loss_fn, TX, plan, prec)
    losses, state, _ = train_losses(step, state, BATCHES)

    one = zf.make_mesh(devices=jax.devices()[:1])  # the unsharded run
    ref = zf.init_train_state(init_params(), TX, zf.ZeroPlan(one, stage=0), prec)
    ref_step = zf.make_train_step(loss_fn, TX, zf.ZeroPlan(one, stage=0), prec)
    ref_losses, ref, _ = train_losses(ref_step, ref, BATCHES)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    got, want = state.master_params, ref.master
    assert jax.tree.map(jnp.shape, got) == jax.tree.map(jnp.shape, want)
    assert_leaves_close(got, want, rtol=1e-5, atol=1e-6)
    # The padding rows stay zero: in the weights and in Adam's moments.
    for x in (state.master["embedding"], state.opt_state[0].mu["embedding"],
              state.opt_state[0].nu["embedding"]):
        assert not np.asarray(x)[VOCAB:].any()


@pytest.mark.parametrize("stage", [1, 2])
def test_padded_leaves_at_stages_1_and_2_match_plain_optax(stage):
    """A small odd table (1001 x 12), two micro-batches, fp32: at stage 1 the gradient is
    all-reduced whole and padded into the master's form, at stage 2 it is padded and
    reduce-scattered; both against plain optax on one device."""
    def small():
        return {"embedding": jax.random.normal(jax.random.key(1), (1001, 12)) * 0.1,
                "out_bias": jnp.zeros((1001,))}
    rng = np.random.default_rng(3)
    batches = [{"tokens": rng.integers(0, 1001, 16).astype(np.int32),
                "targets": rng.integers(0, 1001, 16).astype(np.int32)} for _ in range(3)]
    ref_losses, params, _ = optax_losses(loss_fn, TX, small(), batches)
    plan, prec = zf.ZeroPlan(zf.make_mesh(), stage=stage), zf.Precision()
    state = zf.init_train_state(small(), TX, plan, prec)
    step = zf.make_train_step(loss_fn, TX, plan, prec, grad_accum=2)
    losses, state, _ = train_losses(step, state, batches)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    assert_leaves_close(state.master_params, params, rtol=1e-5, atol=1e-6)
    assert state.master["embedding"].shape == (1008, 12)


def test_checkpoints_hold_the_unpadded_arrays_and_restore_onto_other_meshes(tmp_path):
    import orbax.checkpoint as ocp

    def small():
        return {"table": jax.random.normal(jax.random.key(2), (1001, 12)), "bias": jnp.ones((13,))}
    plan8 = zf.ZeroPlan(zf.make_mesh(), stage=3)
    state = zf.init_train_state(small(), TX, plan8, zf.Precision(params="bf16"))
    assert state.master["table"].shape == (1008, 12)
    zf.save_checkpoint(tmp_path / "ckpt", state)
    meta = ocp.StandardCheckpointer().metadata(tmp_path / "ckpt")
    tree = getattr(getattr(meta, "item_metadata", meta), "tree", meta)
    assert tuple(tree["master"]["table"].shape) == (1001, 12)  # portable: no padding saved
    assert tuple(tree["opt_state"][0]["mu"]["bias"].shape) == (13,)

    for plan in (zf.ZeroPlan(zf.make_mesh(data=4, model=2), stage=1),  # 1001 -> 1004 on 4
                 zf.ZeroPlan(zf.make_mesh(devices=jax.devices()[:1]), stage=0)):
        like = zf.init_train_state(small(), TX, plan, zf.Precision())
        restored = zf.restore_checkpoint(tmp_path / "ckpt", like)
        assert restored.master["table"].shape == like.master["table"].shape
        assert_leaves_equal(restored.master_params, state.master_params)


def test_describe_reports_bytes_padding_and_what_stays_whole():
    plan = zf.ZeroPlan(zf.make_mesh(), stage=3)
    params = {"table": jax.ShapeDtypeStruct((1001, 12), jnp.float32),
              "scale": jax.ShapeDtypeStruct((3,), jnp.float32)}
    d = plan.describe(params)
    assert d.param_bytes == 4 * (1001 * 12 + 3)
    assert d.master_bytes_per_device == 4 * (126 * 12 + 3)  # 1008 / 8 rows, and the whole (3,)
    assert d.padding_bytes == 4 * 7 * 12
    assert d.padded == ("table",) and d.replicated == ("scale",)
    assert d.replicated_fraction == pytest.approx(3 / (1001 * 12 + 3))
    assert "padding 336 bytes in all (1 leaf)" in str(d) and "whole on every device" in str(d)


def test_warns_once_when_much_stays_replicated():
    plan = zf.ZeroPlan(zf.make_mesh(), stage=2)
    params = {"w": jnp.ones((4, 5)), "v": jnp.ones((64,))}  # (4, 5): no dimension reaches 8
    with pytest.warns(UserWarning, match=r"keeps 23\.8% of the parameters whole on each of 8 devices.*w"):
        zf.init_train_state(params, optax.sgd(0.1), plan, zf.Precision())


GPT_ODD = dict(vocab_size=251, seq_len=16, num_layers=3, embed_dim=36, num_heads=2, mlp_dim=60,
               remat="full")


def _gpt_run(stage, offload="none"):
    from zeroflow.config.schema import ModelConfig
    from zeroflow.models import init_params, make_layerwise_loss_fn
    cfg = ModelConfig(**GPT_ODD)
    params, _ = init_params(cfg, jax.random.key(0))
    plan = zf.ZeroPlan(zf.make_mesh(), stage=stage, offload=offload)
    prec, tx = zf.Precision(), optax.adam(1e-3)
    state = zf.init_train_state(params, tx, plan, prec)
    step = zf.make_train_step(make_layerwise_loss_fn(cfg), tx, plan, prec, grad_accum=2,
                              gather_per_layer="layers")
    rng = np.random.default_rng(5)
    losses = []
    for _ in range(2):
        state, m = step(state, {"tokens": rng.integers(0, 251, (16, 17)).astype(np.int32)})
        losses.append(float(m["loss"]))
    return np.array(losses), state


@pytest.fixture(scope="module")
def gpt_reference():
    return _gpt_run(0)


@pytest.mark.parametrize("stage,offload", [(2, "none"), (3, "none"), (3, "optimizer+params")])
def test_gpt_with_odd_widths_gathers_layer_by_layer_like_stage0(stage, offload, gpt_reference):
    """Widths 36 / 60 and vocabulary 251 on 8 devices: the layer stack is padded inside each
    layer (reduce-scattered per layer at stage 2, gathered per layer at stage 3, streamed from
    the host with optimizer+params) and trains like stage 0."""
    ref_losses, ref_state = gpt_reference
    losses, state = _gpt_run(stage, offload)
    assert state.master["layers"]["mlp"]["up"]["kernel"].shape[-1] == 64  # 60 padded
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    assert_leaves_close(state.master_params, ref_state.master_params, rtol=1e-5, atol=1e-6)
