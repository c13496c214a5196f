"""The context axis: each row's sequence split over devices, attention across the split
(all-gathered keys and values, or a ring in the load-balanced layout), ZeRO over data x context.

The reference is the model on whole rows without any split: ``jax.value_and_grad`` of the loss
on one device (averaged over the data devices' rows, as data parallelism averages), and plain
optax for training. Everything is fp32 on packed rows (segment ids, restarting positions, a
loss mask), so the split must reproduce causal attention inside each segment exactly.
"""
import dataclasses
import functools
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import zeroflow as zf
from zeroflow.config.io import ConfigError, load_config
from zeroflow.config.schema import ModelConfig
from zeroflow.engine import padding
from zeroflow.models import init_params, make_loss_fn
from zeroflow.models.context import balanced_order, context_batch
from zeroflow.models.rules import gpt_tensor_rules
from zeroflow.trainer import build_run, train
from fixtures import TINY_TRAINER


REPO = Path(__file__).resolve().parents[1]
ROWS, LENGTH, VOCAB = 4, 32, 64
CFG = ModelConfig(vocab_size=VOCAB, seq_len=LENGTH, num_layers=1, embed_dim=32, num_heads=4,
                  num_kv_heads=2, mlp_dim=64)


def packed_batch(seed=0):
    """Rows of up to three segments each; positions restart in every segment; about a third
    of the targets masked out."""
    rng = np.random.default_rng(seed)
    segments = np.sort(rng.integers(1, 4, (ROWS, LENGTH)), axis=1).astype(np.int32)
    starts = np.concatenate([np.ones((ROWS, 1), bool), segments[:, 1:] != segments[:, :-1]], 1)
    index = np.arange(LENGTH)[None]
    positions = index - np.maximum.accumulate(np.where(starts, index, 0), axis=1)
    return {
        "tokens": rng.integers(0, VOCAB, (ROWS, LENGTH)).astype(np.int32),
        "targets": rng.integers(0, VOCAB, (ROWS, LENGTH)).astype(np.int32),
        "loss_mask": (rng.random((ROWS, LENGTH)) > 0.3).astype(np.int32),
        "segment_ids": segments,
        "positions": positions.astype(np.int32),
    }


def reference(cfg, params, batch, data):
    """Loss, aux and gradients of whole rows on one device: the mean over the ``data`` devices'
    rows of each one's loss, as the data axis averages."""
    loss_fn = make_loss_fn(dataclasses.replace(cfg, attention="xla"))
    rows = ROWS // data

    def mean_over_data(p):
        outs = [loss_fn(p, {k: v[d * rows:(d + 1) * rows] for k, v in batch.items()})
                for d in range(data)]
        return (sum(o[0] for o in outs) / data,
                jax.tree.map(lambda *a: sum(a) / data, *[o[1] for o in outs]))

    return jax.value_and_grad(mean_over_data, has_aux=True)(params)


@functools.cache
def reference_program(data):
    """``reference`` of ``CFG`` jitted, ``(params, batch) -> (loss, aux), grads``: compiled once
    per ``data`` and reused for every batch and parameters (op by op it took several times the
    CPU). On whole rows there is no split, so neither the context strategy nor the attention
    kernel of a case enters it: the cases of any ``context_attention`` share it."""
    return jax.jit(functools.partial(reference, CFG, data=data))


@functools.cache
def reference_at_init(data):
    """The initial parameters and ``reference`` on ``packed_batch()`` at them, shared by the
    cases of one ``data``."""
    params, _ = init_params(CFG, jax.random.key(0))
    return params, reference_program(data)(params, packed_batch())


def whole_rows(params, data):
    """``reference_at_init(data)``'s loss, aux and gradients, after checking that the engine
    started from its parameters."""
    start, result = reference_at_init(data)
    jax.tree.map(np.testing.assert_array_equal, params, start)
    return result


def recording_tx():
    """An optimizer that changes nothing and keeps the last gradient as its state."""
    return optax.GradientTransformation(
        lambda p: jax.tree.map(jnp.zeros_like, p),
        lambda g, state, params=None: (jax.tree.map(jnp.zeros_like, g), g))


def assert_grads_close(got, want, rtol):
    for path, (a, b) in zip(jax.tree_util.tree_leaves_with_path(want),
                            zip(jax.tree.leaves(got), jax.tree.leaves(want))):
        b = np.asarray(b)
        np.testing.assert_allclose(np.asarray(a), b, rtol=rtol, atol=rtol * np.abs(b).max(),
                                   err_msg=jax.tree_util.keystr(path[0]))


def one_step(cfg, *, context, data, stage, model=1, prec="fp32", **plan_options):
    """The engine's loss, aux and gradients of one step on ``packed_batch`` over a mesh of
    ``data x context x model`` devices, the batch laid out as ``cfg`` attends across the split."""
    params, _ = init_params(cfg, jax.random.key(0))
    mesh = zf.make_mesh(data=data, context=context, model=model,
                        devices=jax.devices()[:data * context * model])
    rules = gpt_tensor_rules(cfg, model) if model > 1 else ()
    plan = zf.ZeroPlan(mesh, stage=stage, tensor_rules=rules, **plan_options)
    precision, tx = zf.Precision(params=prec), recording_tx()
    state = zf.init_train_state(params, tx, plan, precision)
    step = zf.make_train_step(make_loss_fn(cfg), tx, plan, precision)
    state, metrics = step(state, context_batch(packed_batch(), context, cfg.context_attention))
    grads = padding.unpad(state.opt_state, state.padding.opt_state)
    return params, metrics, grads, state


CASES = [  # (strategy, attention, context, data, stage); the interpreted Mosaic kernels are slow
    pytest.param("allgather", "xla", 2, 2, 3, marks=pytest.mark.fast),
    pytest.param("allgather", "xla", 4, 2, 3, marks=pytest.mark.fast),
    pytest.param("ring", "xla", 2, 2, 3, marks=pytest.mark.fast),
    pytest.param("ring", "xla", 4, 2, 1, marks=pytest.mark.fast),
    pytest.param("allgather", "pallas", 2, 1, 2, marks=pytest.mark.slow),
    pytest.param("allgather", "pallas", 4, 1, 0, marks=pytest.mark.slow),
    pytest.param("ring", "pallas", 2, 1, 2, marks=pytest.mark.slow),
    pytest.param("ring", "pallas", 4, 1, 0, marks=pytest.mark.slow),
]


@pytest.mark.parametrize("strategy,attention,context,data,stage", CASES)
def test_split_sequence_matches_whole_rows(strategy, attention, context, data, stage):
    cfg = dataclasses.replace(CFG, context_attention=strategy, attention=attention)
    params, metrics, grads, _ = one_step(cfg, context=context, data=data, stage=stage)
    (loss, aux), want = whole_rows(params, data)
    np.testing.assert_allclose(float(metrics["loss"]), float(loss), rtol=1e-6)
    np.testing.assert_allclose(float(metrics["accuracy"]), float(aux["accuracy"]), rtol=1e-6)
    assert float(metrics["trained_tokens"]) == float(aux["trained_tokens"])
    assert_grads_close(grads, want, rtol=2e-5)


@pytest.mark.fast
def test_context_composes_with_tensor_parallelism():
    cfg = dataclasses.replace(CFG, context_attention="ring")
    params, metrics, grads, state = one_step(cfg, context=2, data=2, model=2, stage=3)
    (loss, _), want = whole_rows(params, 2)
    np.testing.assert_allclose(float(metrics["loss"]), float(loss), rtol=1e-6)
    assert_grads_close(grads, want, rtol=2e-5)
    query = state.master["layers"]["attn"]["query"]["kernel"]  # [layers, embed, heads, dim]
    assert query.sharding.spec[2] == "model"  # heads on the model axis, ZeRO on the rest
    assert query.sharding.shard_shape(query.shape)[1] == query.shape[1] // 4


@pytest.mark.fast
def test_context_composes_with_zeropp():
    """hpZ (a weight copy per host) and qgZ (int8 gradient reduce-scatter) over data x context:
    bf16 weights and int8 gradients in transit, held to the fp32 reference at their precision."""
    cfg = dataclasses.replace(CFG, context_attention="ring")
    params, metrics, grads, _ = one_step(cfg, context=2, data=4, stage=3, prec="bf16", hosts=2,
                                         hierarchical=True, quantize_grads="int8")
    (loss, _), want = whole_rows(params, 4)
    np.testing.assert_allclose(float(metrics["loss"]), float(loss), rtol=1e-3)
    for got, ref in zip(jax.tree.leaves(grads), jax.tree.leaves(want)):
        scale = np.abs(np.asarray(ref)).max()
        assert np.abs(np.asarray(got) - np.asarray(ref)).max() <= 0.05 * scale


@pytest.mark.fast
def test_stage3_context2_data2_trains_like_optax():
    cfg = dataclasses.replace(CFG, context_attention="ring")
    params, _ = init_params(cfg, jax.random.key(0))
    tx = optax.adamw(1e-2, weight_decay=0.01)
    batches = [packed_batch(seed) for seed in range(3)]
    plan = zf.ZeroPlan(zf.make_mesh(data=2, context=2, devices=jax.devices()[:4]), stage=3)
    prec = zf.Precision(params="fp32")
    state = zf.init_train_state(params, tx, plan, prec)
    # Every device holds a quarter of the master: ZeRO's shards span data x context.
    mlp_up = state.master["layers"]["mlp"]["up"]["kernel"]
    assert np.prod(mlp_up.sharding.shard_shape(mlp_up.shape)) == mlp_up.size // 4
    step = zf.make_train_step(make_loss_fn(cfg), tx, plan, prec)
    losses = []
    for batch in batches:
        state, metrics = step(state, context_batch(batch, 2, "ring"))
        losses.append(float(metrics["loss"]))

    want_losses, opt_state = [], tx.init(params)
    for i, batch in enumerate(batches):  # the first: packed_batch() at the initial parameters
        (loss, _), grads = whole_rows(params, 2) if i == 0 else reference_program(2)(params, batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        want_losses.append(float(loss))
    np.testing.assert_allclose(losses, want_losses, rtol=1e-5)
    # Adam divides by the gradient's size: where a gradient is near zero, a rounding of it moves
    # the weight by a sizeable part of the learning rate, so weights agree to 1% of it.
    for got, want in zip(jax.tree.leaves(state.params), jax.tree.leaves(params)):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-4, atol=1e-4)


@pytest.mark.fast
def test_balanced_layout_holds_chunks_i_and_mirror_with_even_causal_work():
    order = balanced_order(16, 2)  # 4 chunks of 4: device 0 holds chunks 0, 3; device 1: 1, 2
    assert order.tolist() == [0, 1, 2, 3, 12, 13, 14, 15, 4, 5, 6, 7, 8, 9, 10, 11]
    for context in (2, 4):
        parts = balanced_order(64, context).reshape(context, -1)
        # causal work of a device: the keys its queries see (token t sees t + 1 keys)
        work = [(part + 1).sum() for part in parts]
        assert len(set(work)) == 1
        contiguous = [(part + 1).sum() for part in np.arange(64).reshape(context, -1)]
        assert len(set(contiguous)) == context
    batch = context_batch(packed_batch(), 2, "ring")
    order = balanced_order(LENGTH, 2)
    for key, value in packed_batch().items():
        np.testing.assert_array_equal(batch[key], value[:, order])  # positions follow tokens


@pytest.mark.fast
def test_token_windows_become_targets_for_the_split():
    tokens = np.arange(2 * 9, dtype=np.int32).reshape(2, 9)
    batch = context_batch({"tokens": tokens}, 2, "allgather")
    np.testing.assert_array_equal(batch["tokens"], tokens[:, :-1])
    np.testing.assert_array_equal(batch["targets"], tokens[:, 1:])
    np.testing.assert_array_equal(batch["positions"], np.tile(np.arange(8), (2, 1)))
    assert batch["loss_mask"].all() and (batch["segment_ids"] == batch["segment_ids"][0, 0]).all()


@pytest.mark.fast
def test_mesh_with_a_context_axis():
    mesh = zf.make_mesh(data=2, context=2, model=2)
    assert mesh.axis_names == ("data", "context", "model")
    assert dict(mesh.shape) == {"data": 2, "context": 2, "model": 2}
    assert zf.make_mesh(4, 2).axis_names == ("data", "model")  # the old signature
    assert dict(zf.make_mesh(context=4).shape) == {"data": 2, "context": 4, "model": 1}
    assert dict(zf.planning_mesh(4, context=2).shape) == {"data": 4, "context": 2, "model": 1}
    with pytest.raises(ValueError, match="8 devices do not divide by context=3"):
        zf.make_mesh(context=3)
    plan = zf.ZeroPlan(zf.planning_mesh(4, context=2), stage=1)
    assert (plan.data_size, plan.batch_split, plan.context_size) == (8, 4, 2)


@pytest.mark.fast
def test_bad_context_settings_are_one_line(tmp_path):
    base = TINY_TRAINER + [f"run.dir={tmp_path}"]
    cases = [
        (["parallel.context=2", "model.seq_len=30", "model.context_attention=ring"],
         "model.seq_len 30 does not split into parallel.context 2 equal parts x 2 chunks"),
        (["parallel.context=2", "model.context_attention=ring", "model.attention=cudnn"],
         "model.context_attention=ring needs model.attention xla or pallas"),
        (["parallel.context=0"], "parallel.context must be positive"),
        (["parallel.context=2", "model.context_attention=allgather", "model.attention=pallas",
          "model.sliding_window=8"],
         "model.sliding_window with model.context_attention=allgather needs model.attention xla"),
    ]
    for overrides, message in cases:
        with pytest.raises(ConfigError, match=message):
            load_config(REPO / "configs/tiny.yaml", base + overrides)
    with pytest.raises(ValueError, match="8 devices do not divide by context=3"):
        build_run(load_config(REPO / "configs/tiny.yaml",
                              base + ["parallel.context=3", "model.seq_len=48"]),
                  with_data=False)


@pytest.mark.fast
def test_batch_that_does_not_split_is_one_line():
    params, _ = init_params(CFG, jax.random.key(0))
    plan = zf.ZeroPlan(zf.make_mesh(data=1, context=2, devices=jax.devices()[:2]), stage=0)
    prec = zf.Precision(params="fp32")
    state = zf.init_train_state(params, optax.sgd(0.1), plan, prec)
    step = zf.make_train_step(make_loss_fn(CFG), optax.sgd(0.1), plan, prec)
    windows = {"tokens": np.zeros((2, LENGTH + 1), np.int32)}
    with pytest.raises(ValueError, match="batch leaf tokens: sequence length 33 does not split"):
        step(state, windows)
    with pytest.raises(ValueError, match="needs 'targets' beside 'tokens'"):
        step(state, {"tokens": np.zeros((2, LENGTH), np.int32)})


@pytest.mark.fast
def test_trainer_with_a_context_axis_trains_as_without(tmp_path):
    base = TINY_TRAINER + ["data.max_bytes=400000", "train.warmup_steps=2", "train.steps=3",
                           "parallel.zero_stage=3", "run.tensorboard=false", "run.plot=false"]
    runs = {}
    for name, extra in (("whole", []), ("ring", ["parallel.context=2",
                                                 "model.context_attention=ring"])):
        cfg = load_config(REPO / "configs/tiny.yaml", base + extra + [f"run.dir={tmp_path / name}"])
        runs[name] = train(cfg)
    assert runs["ring"].losses == pytest.approx(runs["whole"].losses, rel=1e-5)
    assert runs["ring"].eval["eval_loss"] == pytest.approx(runs["whole"].eval["eval_loss"],
                                                           rel=1e-5)
