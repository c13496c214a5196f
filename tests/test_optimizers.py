"""Optimizers whose state is not shaped like the parameters, at ZeRO stage 3 on 8 devices,
against plain optax on one device (fp32)."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import zeroflow as zf
from helpers import assert_leaves_close, optax_losses, train_losses

pytestmark = pytest.mark.fast


def init_params():
    k = jax.random.split(jax.random.key(0), 4)
    return {
        "inp": jax.random.normal(k[0], (24, 256)) * 0.2,
        "hidden": jax.random.normal(k[1], (256, 132)) * 0.06,  # factored by Adafactor (both >= 128)
        "odd": jax.random.normal(k[2], (132, 13)) * 0.08,  # neither divides by 8: stored padded
        "bias": jnp.zeros((13,)),  # padded too
        "scale": jnp.ones((3,)),  # every dimension < 8: kept whole
    }


def loss_fn(params, batch):
    h = jnp.tanh(batch["x"] @ params["inp"])
    h = jnp.tanh(h @ params["hidden"])
    out = h @ params["odd"] + params["bias"]
    pred = out[:, :3] * params["scale"]
    return jnp.mean((pred - batch["y"]) ** 2)


def make_batches(count=4, size=32):
    rng = np.random.default_rng(1)
    return [{"x": rng.normal(size=(size, 24)).astype(np.float32),
             "y": rng.normal(size=(size, 3)).astype(np.float32)} for _ in range(count)]


BATCHES = make_batches()
OPTIMIZERS = {
    "adafactor": lambda: optax.adafactor(1e-2),
    "lion": lambda: optax.lion(1e-3, weight_decay=0.1),
    "schedule_free_adamw": lambda: optax.contrib.schedule_free_adamw(1e-2, warmup_steps=2),
    # Momentum SGD inside: with Adam, an element whose two accumulated gradients nearly cancel
    # (3.1e-4 - 3.1e-4 here) has g / (|g| + eps) decided by the last bits of the sums, which
    # 8 devices add in another order than one.
    "multi_steps": lambda: optax.MultiSteps(optax.sgd(0.5, momentum=0.9), every_k_schedule=2),
}


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_stage3_matches_plain_optax(name):
    tx = OPTIMIZERS[name]()
    ref_losses, ref_params, ref_opt = optax_losses(loss_fn, tx, init_params(), BATCHES, jit=True)
    plan, prec = zf.ZeroPlan(zf.make_mesh(), stage=3), zf.Precision()
    state = zf.init_train_state(init_params(), tx, plan, prec)
    step = zf.make_train_step(loss_fn, tx, plan, prec)
    losses, state, _ = train_losses(step, state, BATCHES)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5, atol=1e-7)
    assert_leaves_close(state.master_params, ref_params, rtol=1e-5, atol=1e-6)
    # The optimizer state itself, unpadded, equals optax's (leaf for leaf, same structure).
    unpadded = zf.padding.unpad(state.opt_state, state.padding.opt_state)
    assert jax.tree.structure(unpadded) == jax.tree.structure(ref_opt)
    assert_leaves_close(unpadded, ref_opt, rtol=1e-5, atol=1e-6)


def test_adafactor_state_is_sharded_where_it_can_be():
    tx = optax.adafactor(1e-2)
    plan = zf.ZeroPlan(zf.make_mesh(), stage=3)
    state = zf.init_train_state(init_params(), tx, plan, zf.Precision())
    factored = state.opt_state[0]
    # The factored second moments of "hidden" (256 x 132) are a 256- and a 132-entry vector (not
    # parameter-shaped): each is split 8 ways on its own, the 132 padded to 136.
    row, col = factored.v_row["hidden"], factored.v_col["hidden"]
    assert sorted([row.shape, col.shape]) == [(136,), (256,)]
    for x in (row, col):
        assert x.addressable_shards[0].data.shape == (x.shape[0] // 8,)
    # The full second moment of the unfactored "odd" mirrors its padded parameter.
    assert factored.v["odd"].sharding.is_equivalent_to(state.master["odd"].sharding, 2)
    assert factored.v["odd"].shape == state.master["odd"].shape == (136, 13)
    assert state.master["odd"].addressable_shards[0].data.shape == (17, 13)
