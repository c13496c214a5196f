"""Mutable model state (BatchNorm statistics) and per-device, per-micro-batch dropout keys
through the engine, against a hand-written single-device jax + optax loop."""
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import zeroflow as zf
from helpers import assert_leaves_close, assert_leaves_equal, train_losses

pytestmark = pytest.mark.fast

N_DEV, ACCUM = 8, 2


class CNN(nn.Module):
    """Conv -> BatchNorm -> ReLU -> mean pool [-> Dropout] -> Dense. 12 channels do not divide
    by 8 devices: the conv kernel, BatchNorm scale/bias and Dense kernel are stored padded."""
    dropout: float = 0.0

    @nn.compact
    def __call__(self, x, train: bool):
        # No conv bias: BatchNorm removes it, so its gradient is rounding noise that Adam would
        # blow up into arbitrary steps (and arbitrary running means).
        x = nn.Conv(12, (3, 3), use_bias=False)(x)
        x = nn.BatchNorm(use_running_average=not train, momentum=0.8)(x)
        x = nn.relu(x).mean(axis=(1, 2))
        if self.dropout:
            x = nn.Dropout(self.dropout, deterministic=not train)(x)
        return nn.Dense(10)(x)


def make_batches(count, size=32, seed=0):
    rng = np.random.default_rng(seed)
    return [{"x": rng.normal(size=(size, 6, 6, 3)).astype(np.float32) * 2 + 0.5,
             "y": rng.integers(0, 10, size).astype(np.int32)} for _ in range(count)]


BATCHES = make_batches(3)
TX = optax.adamw(2e-2, weight_decay=0.1)
KEY = jax.random.key(7)


def init(model):
    variables = model.init(jax.random.key(0), jnp.zeros((1, 6, 6, 3)), train=False)
    return variables["params"], variables["batch_stats"]


def forward(model, params, stats, batch, key):
    """(loss, new batch statistics) of one micro-batch in training mode."""
    rngs = {} if key is None else {"dropout": key}
    logits, updates = model.apply({"params": params, "batch_stats": stats}, batch["x"], train=True,
                                  mutable=["batch_stats"], rngs=rngs)
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()
    return loss, updates["batch_stats"]


def engine_loss(model):
    def loss_fn(params, batch, *, model_state, rng=None):
        loss, stats = forward(model, params, model_state, batch, rng)
        return loss, {}, stats
    return loss_fn


def reference(model, batches, key=None):
    """The semantics written out on one device: each of 8 shards runs its 2 micro-batches in
    order, threading its own batch statistics; gradients and losses are averaged over all 16;
    the statistics of the 8 shards are averaged after the step. Dropout keys per the documented
    contract: fold_in(fold_in(fold_in(rng, step), device), micro_batch)."""
    params, stats = init(model)
    opt = TX.init(params)
    grad_fn = jax.jit(jax.value_and_grad(lambda p, s, b, k: forward(model, p, s, b, k), has_aux=True))
    losses = []
    for step, batch in enumerate(batches):
        shards = [jax.tree.map(lambda x: x.reshape(N_DEV, ACCUM, -1, *x.shape[1:])[d], batch)
                  for d in range(N_DEV)]
        grads, total, new_stats = None, 0.0, []
        for d, shard in enumerate(shards):
            s = stats
            for m in range(ACCUM):
                k = None if key is None else jax.random.fold_in(
                    jax.random.fold_in(jax.random.fold_in(key, step), d), m)
                (loss, s), g = grad_fn(params, s, jax.tree.map(lambda x: x[m], shard), k)
                grads = g if grads is None else jax.tree.map(jnp.add, grads, g)
                total += float(loss)
            new_stats.append(s)
        grads = jax.tree.map(lambda g: g / (N_DEV * ACCUM), grads)
        stats = jax.tree.map(lambda *s: sum(s) / N_DEV, *new_stats)
        updates, opt = TX.update(grads, opt, params)
        params = optax.apply_updates(params, updates)
        losses.append(total / (N_DEV * ACCUM))
    return np.array(losses), params, stats


def run_engine(model, stage, batches, key=None, state=None):
    plan, prec = zf.ZeroPlan(zf.make_mesh(), stage=stage), zf.Precision()
    if state is None:
        params, stats = init(model)
        state = zf.init_train_state(params, TX, plan, prec, model_state=stats, rng=key)
    step = zf.make_train_step(engine_loss(model), TX, plan, prec, grad_accum=ACCUM)
    losses, state, _ = train_losses(step, state, batches)
    return np.array(losses), state


@pytest.fixture(scope="module")
def batchnorm_reference():
    return reference(CNN(), BATCHES)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_batchnorm_statistics_match_per_shard_reference(stage, batchnorm_reference):
    ref_losses, ref_params, ref_stats = batchnorm_reference
    losses, state = run_engine(CNN(), stage, BATCHES)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    assert_leaves_close(state.model_state, ref_stats, rtol=1e-5, atol=1e-7)
    assert_leaves_close(state.master_params, ref_params, rtol=1e-5, atol=1e-6)
    # The statistics moved (the optimizer never touches them, the momentum update does) and
    # are replicated on every device.
    assert not np.allclose(np.asarray(state.model_state["BatchNorm_0"]["var"]), 1.0)
    assert all(x.sharding.is_fully_replicated for x in jax.tree.leaves(state.model_state))
    assert int(state.applied) == len(BATCHES)


@pytest.mark.parametrize("stage", [0, 3])
def test_dropout_trains_like_reference_with_per_device_keys(stage, batchnorm_reference):
    model = CNN(dropout=0.5)
    ref_losses, ref_params, ref_stats = reference(model, BATCHES, KEY)
    losses, state = run_engine(model, stage, BATCHES, key=KEY)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    assert_leaves_close(state.master_params, ref_params, rtol=1e-5, atol=1e-6)
    # Without dropout the same run gives other losses: the masks really are applied.
    assert not np.allclose(losses, batchnorm_reference[0], rtol=1e-3)


def test_dropout_masks_differ_per_device_and_micro_batch_and_repeat_on_resume(tmp_path):
    masks: list[bytes] = []

    def record(mask):
        masks.append(np.asarray(mask).tobytes())

    def probing_loss(params, batch, *, model_state, rng):
        # The mask a 0.5 dropout over 64 units draws from the key this micro-batch was given.
        jax.debug.callback(record, jax.random.bernoulli(rng, 0.5, (64,)))
        return engine_loss(CNN())(params, batch, model_state=model_state)

    plan, prec = zf.ZeroPlan(zf.make_mesh(), stage=3), zf.Precision()
    params, stats = init(CNN())
    step = zf.make_train_step(probing_loss, TX, plan, prec, grad_accum=ACCUM)

    def masks_of(state, batch):
        masks.clear()
        state, _ = step(state, batch)
        jax.effects_barrier()
        return state, set(masks), len(masks)

    state = zf.init_train_state(params, TX, plan, prec, model_state=stats, rng=KEY)
    straight = []
    for i, batch in enumerate(BATCHES):
        state, drawn, calls = masks_of(state, batch)
        assert calls == N_DEV * ACCUM and len(drawn) == N_DEV * ACCUM  # all 16 differ
        straight.append(drawn)
        if i == 0:
            zf.save_checkpoint(tmp_path / "ckpt", state)
    assert not straight[0] & straight[1]  # and they change from step to step

    like = zf.init_train_state(params, TX, plan, prec, model_state=stats, rng=jax.random.key(99))
    resumed = zf.restore_checkpoint(tmp_path / "ckpt", like)
    assert int(resumed.step) == 1
    for batch, want in zip(BATCHES[1:], straight[1:]):
        resumed, drawn, _ = masks_of(resumed, batch)
        assert drawn == want  # the saved key, not like's, and the same per-device folds


def test_model_state_and_key_survive_a_checkpoint_and_a_new_mesh(tmp_path):
    _, state = run_engine(CNN(dropout=0.5), 3, BATCHES[:1], key=KEY)
    zf.save_checkpoint(tmp_path / "ckpt", state)
    params, stats = init(CNN(dropout=0.5))
    # Onto one device, and onto an abstract (4, 2) stage-2 bf16 target (restore targets need
    # no allocated state).
    one = zf.ZeroPlan(zf.make_mesh(devices=jax.devices()[:1]), stage=0)
    other, bf16 = zf.ZeroPlan(zf.make_mesh(data=4, model=2), stage=2), zf.Precision(params="bf16")
    shapes = jax.eval_shape(lambda: zf.init_train_state(params, TX, other, bf16, model_state=stats,
                                                        rng=jax.random.key(0)))
    shardings = zf.state_shardings(params, TX, other, bf16, model_state=stats, rng=KEY)
    abstract = jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                            shapes, shardings)
    for like in (zf.init_train_state(params, TX, one, zf.Precision(), model_state=stats,
                                     rng=jax.random.key(0)), abstract):
        restored = zf.restore_checkpoint(tmp_path / "ckpt", like)
        assert_leaves_equal(restored.model_state, state.model_state)
        assert_leaves_equal(restored.master_params, state.master_params)
        np.testing.assert_array_equal(jax.random.key_data(restored.rng), jax.random.key_data(KEY))
        assert int(restored.step) == int(restored.applied) == 1


# ----------------------------------------------------------------------------- bad input
def _state_and_step(loss_fn, **state_kw):
    plan, prec = zf.ZeroPlan(zf.make_mesh(), stage=1), zf.Precision()
    params, _ = init(CNN())
    state = zf.init_train_state(params, TX, plan, prec, **state_kw)
    return state, zf.make_train_step(loss_fn, TX, plan, prec)


def test_model_state_requires_three_outputs():
    _, stats = init(CNN())
    state, step = _state_and_step(lambda p, b, *, model_state: forward(CNN(), p, model_state, b, None)[0],
                                  model_state=stats)
    with pytest.raises(ValueError, match=r"must return \(loss, aux, new_model_state\)"):
        step(state, BATCHES[0])


def test_new_model_state_without_a_state_slot_is_an_error():
    _, stats = init(CNN())
    state, step = _state_and_step(lambda p, b: (*forward(CNN(), p, stats, b, None)[:1], {}, stats))
    with pytest.raises(ValueError, match="carries no model_state; pass model_state="):
        step(state, BATCHES[0])


def test_aux_key_that_collides_with_an_engine_metric():
    state, step = _state_and_step(lambda p, b: (jnp.mean(p["Dense_0"]["kernel"]), {"grad_norm": 1.0}))
    with pytest.raises(ValueError, match="aux key 'grad_norm' collides"):
        step(state, BATCHES[0])


def test_rng_must_be_a_key():
    with pytest.raises(ValueError, match=r"rng must be a jax random key \(jax.random.key\(seed\)\)"):
        _state_and_step(lambda p, b: 0.0, rng=7)
