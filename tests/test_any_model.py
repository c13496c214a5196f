"""Models and optimizers written elsewhere, through the engine on 8 devices, against a
hand-written jax.jit + optax loop: Equinox modules as parameters (with eqx.partition's None
holes), Flax NNX through nnx.split / nnx.merge with BatchNorm and Dropout, optax.multi_transform
and optax.contrib.muon, and one readable error where jax cannot trace the loss in the step."""
import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import zeroflow as zf
from helpers import optax_losses, train_losses
from model_corpus import (Corpus, EqxTransformer, engine_loss, eqx_transformer,
                          nnx_net)

pytestmark = pytest.mark.fast

N_DEV = 8
KEY = jax.random.key(3)
TX = optax.adamw(1e-2, weight_decay=0.1)


def reference(forward, params, model_state, tx, batches, key):
    """The engine's semantics on one device: each of 8 shards takes the key
    fold_in(fold_in(fold_in(key, step), device), 0) and its own copy of the model state;
    losses and gradients are averaged over the shards, so are the floating model states."""
    def here(params, model_state, batch, key):  # NNX mutates variables made in this trace only
        return forward(params, jax.tree.map(lambda x: x, model_state), batch, key)
    grad_fn = jax.jit(jax.value_and_grad(here, has_aux=True))
    update = jax.jit(tx.update)  # one compile, not an eager dispatch per leaf and operation
    opt, losses = tx.init(params), []
    for step, batch in enumerate(batches):
        total, grads, states = 0.0, None, []
        for d in range(N_DEV):
            shard = jax.tree.map(lambda x: x.reshape(N_DEV, -1, *x.shape[1:])[d], batch)
            k = jax.random.fold_in(jax.random.fold_in(jax.random.fold_in(key, step), d), 0)
            (loss, new_state), g = grad_fn(params, model_state, shard, k)
            total += float(loss)
            grads = g if grads is None else jax.tree.map(jnp.add, grads, g)
            states.append(new_state)
        grads = jax.tree.map(lambda g: g / N_DEV, grads)
        if model_state is not None:
            model_state = jax.tree.map(lambda *s: sum(s) / N_DEV, *states)
        updates, opt = update(grads, opt, params)
        params = optax.apply_updates(params, updates)
        losses.append(total / N_DEV)
    return np.array(losses), params


def run_engine(corpus, stage, tx, batches, **state_kw):
    plan, prec = zf.ZeroPlan(zf.make_mesh(), stage=stage), zf.Precision()
    state = zf.init_train_state(corpus.params, tx, plan, prec, model_state=corpus.model_state,
                                rng=KEY, **state_kw)
    step = zf.make_train_step(engine_loss(corpus.forward, corpus.model_state is not None), tx,
                              plan, prec)
    losses, state, _ = train_losses(step, state, batches)
    return np.array(losses), state


def one_layer_eqx():
    """The corpus's Equinox transformer with one block: its list of blocks and its static
    field (a None hole in the params) are there as with more, at a fraction of the compile."""
    return eqx_transformer(layers=1)


@pytest.fixture(scope="module")
def eqx_reference():
    c = one_layer_eqx()
    return reference(c.forward, c.params, None, TX, c.batches(3), KEY)


def _mask_and_labels(params):
    mask = jax.tree.map(lambda x: x.ndim == 2, params)
    return mask, jax.tree.map(lambda t: "train" if t else "frozen", mask)


@pytest.fixture(scope="module")
def eqx_mask_reference():
    """Plain optax with the frozen leaves' updates set to zero, for the mask test's stages."""
    corpus = one_layer_eqx()
    _, labels = _mask_and_labels(corpus.params)
    # (labels given as a function: optax itself would call a module of labels)
    ref_tx = optax.multi_transform({"train": TX, "frozen": optax.set_to_zero()},
                                   lambda _: labels)
    return reference(corpus.forward, corpus.params, None, ref_tx, corpus.batches(2), KEY)[0]


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_equinox_partition_trains_like_plain_optax(stage, eqx_reference):
    corpus = one_layer_eqx()
    losses, state = run_engine(corpus, stage, TX, corpus.batches(3))
    np.testing.assert_allclose(losses, eqx_reference[0], rtol=1e-5)
    assert isinstance(state.params, EqxTransformer)  # the caller's own tree comes back
    for got, want in zip(jax.tree.leaves(state.master_params), jax.tree.leaves(eqx_reference[1])):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("stage", [0, 3])
def test_equinox_trainable_mask_is_a_module_of_bools(stage, eqx_mask_reference):
    """A mask shaped like the parameters is itself an (Equinox) module, so callable: it is
    read as a mask, not called."""
    corpus = one_layer_eqx()
    mask, _ = _mask_and_labels(corpus.params)
    assert callable(mask)
    losses, state = run_engine(corpus, stage, TX, corpus.batches(2), trainable=mask)
    np.testing.assert_allclose(losses, eqx_mask_reference, rtol=1e-5)
    assert isinstance(state.trainable, EqxTransformer)


class _Norm(eqx.Module):
    lin: eqx.nn.Linear
    bn: eqx.nn.BatchNorm

    def __init__(self, mode):
        # No bias before the norm: its gradient is zero up to rounding, which Adam would turn
        # into lr-sized steps of either sign.
        self.lin = eqx.nn.Linear(4, 8, use_bias=False, key=jax.random.key(0))
        self.bn = eqx.nn.BatchNorm(8, "batch", mode=mode)

    def __call__(self, x, state):
        return self.bn(self.lin(x), state)


def _eqx_norm(mode):
    """A Linear then eqx.nn.BatchNorm, vmapped over the batch as Equinox asks: params, static
    part, model state and ``forward(params, model_state, batch, key) -> (loss, new_state)``."""
    model, state = eqx.nn.make_with_state(_Norm)(mode)
    params, static = eqx.partition(model, eqx.is_inexact_array)

    def forward(p, model_state, batch, key):
        out, new_state = jax.vmap(eqx.combine(p, static), axis_name="batch",
                                  in_axes=(0, None), out_axes=(0, None))(batch["x"], model_state)
        return jnp.mean((out - batch["y"]) ** 2), new_state
    return params, state, forward


def _norm_batches(count):
    return [{"x": np.random.default_rng(s).normal(size=(16, 4)).astype(np.float32),
             "y": np.random.default_rng(60 + s).normal(size=(16, 8)).astype(np.float32)}
            for s in range(count)]


@pytest.mark.parametrize("stage", [0, 3])
def test_equinox_batchnorm_batch_mode_trains_like_plain_optax(stage):
    """eqx.nn.BatchNorm's batch statistics are a pmean over the jax.vmap axis: each device
    normalises its own rows, as the hand-written per-shard loop does."""
    params, state, forward = _eqx_norm("batch")
    batches = _norm_batches(3)
    want, want_params = reference(forward, params, state, TX, batches, KEY)
    corpus = Corpus(params, state, forward, None)
    losses, zstate = run_engine(corpus, stage, TX, batches)
    np.testing.assert_allclose(losses, want, rtol=1e-5)
    for got, ref in zip(jax.tree.leaves(zstate.master_params), jax.tree.leaves(want_params)):
        np.testing.assert_allclose(np.asarray(got), np.asarray(ref), rtol=1e-4, atol=1e-6)


def test_equinox_batchnorm_ema_mode_in_the_step_is_one_readable_error():
    """jax cannot trace eqx.nn.BatchNorm's ema mode inside shard_map (a bare jax.shard_map
    fails the same way): the step says so and names the way around."""
    params, state, forward = _eqx_norm("ema")
    plan, prec = zf.ZeroPlan(zf.make_mesh(), stage=0), zf.Precision()
    zstate = zf.init_train_state(params, TX, plan, prec, model_state=state, rng=KEY)
    step = zf.make_train_step(engine_loss(forward, True), TX, plan, prec)
    with pytest.raises(ValueError, match="eqx.nn.State.set refused"):
        step(zstate, _norm_batches(1)[0])


@pytest.fixture(scope="module")
def nnx_reference():
    c = nnx_net()
    return reference(c.forward, c.params, c.model_state, TX, c.batches(3), KEY)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_flax_nnx_batchnorm_dropout_trains_like_plain_optax(stage, nnx_reference):
    corpus = nnx_net()
    losses, state = run_engine(corpus, stage, TX, corpus.batches(3))
    np.testing.assert_allclose(losses, nnx_reference[0], rtol=1e-5)


def _mlp():
    k = jax.random.split(jax.random.key(0), 3)
    params = {"w1": jax.random.normal(k[0], (12, 24)) * 0.3, "b1": jnp.zeros(24),
              "w2": jax.random.normal(k[1], (24, 16)) * 0.3, "b2": jnp.zeros(16)}
    rng = np.random.default_rng(0)
    batches = [{"x": rng.normal(size=(16, 12)).astype(np.float32),
                "y": rng.normal(size=(16, 16)).astype(np.float32)} for _ in range(3)]
    return params, batches


def _mlp_loss(p, b):
    return jnp.mean((jnp.tanh(b["x"] @ p["w1"] + p["b1"]) @ p["w2"] + p["b2"] - b["y"]) ** 2)


def _groups(p):
    return jax.tree.map(lambda x: "matrix" if x.ndim == 2 else "vector", p)


@pytest.mark.parametrize("name", ["multi_transform_tree", "multi_transform_fn", "muon"])
def test_optimizers_built_from_groups_match_plain_optax_at_stage3(name):
    params, batches = _mlp()
    groups = {"matrix": optax.adamw(1e-2, weight_decay=0.1), "vector": optax.sgd(5e-2)}
    tx = {"multi_transform_tree": lambda: optax.multi_transform(groups, _groups(params)),
          "multi_transform_fn": lambda: optax.multi_transform(groups, _groups),
          "muon": lambda: optax.contrib.muon(2e-2)}[name]()
    want, want_params, _ = optax_losses(_mlp_loss, tx, params, batches, jit=True)
    plan, prec = zf.ZeroPlan(zf.make_mesh(), stage=3), zf.Precision()
    state = zf.init_train_state(params, tx, plan, prec)
    losses, state, _ = train_losses(zf.make_train_step(_mlp_loss, tx, plan, prec), state, batches)
    np.testing.assert_allclose(losses, want, rtol=1e-5)
    for key in params:
        np.testing.assert_allclose(np.asarray(state.master_params[key]), want_params[key],
                                   rtol=1e-5, atol=1e-6)
