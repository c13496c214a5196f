"""Host offload on 8 emulated CPU devices: numerics and memory kinds, not speed.

Offloaded runs must give bit-for-bit the losses and weights of the same run without offload,
and after every step the fp32 master weights and optimizer state must live in pinned_host
memory, sharded over ``data`` as the stage says.
"""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import zeroflow as zf
from zeroflow import offload
from zeroflow.state import state_shardings

STEPS = 2


def loss_fn(params, batch):
    hidden = jnp.tanh(batch["x"].astype(params["w_in"].dtype) @ params["w_in"])
    pred = (hidden @ params["w_out"]).astype(jnp.float32) + params["bias"].astype(jnp.float32)
    return jnp.mean((pred - batch["y"]) ** 2)


def init_params():
    rng = np.random.default_rng(0)
    # bias (10,) does not divide by 8 devices: it is stored padded, and must still be offloaded.
    return {"w_in": rng.normal(size=(16, 64)).astype(np.float32) * 0.3,
            "w_out": rng.normal(size=(64, 10)).astype(np.float32) * 0.3,
            "bias": np.zeros(10, np.float32)}


def make_tx():
    # Global-norm clipping needs a reduction over every shard inside the (host) update.
    return optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-2, weight_decay=0.01))


BATCHES = [{"x": np.random.default_rng(s).normal(size=(16, 16)).astype(np.float32),
            "y": np.random.default_rng(100 + s).normal(size=(16, 10)).astype(np.float32)}
           for s in range(STEPS)]
PREC = zf.Precision(params="bf16")


def run(stage, offload_kind="none", update_on="device", check=None):
    plan = zf.ZeroPlan(zf.make_mesh(), stage=stage, offload=offload_kind, update_on=update_on)
    tx = make_tx()
    state = zf.init_train_state(init_params(), tx, plan, PREC)
    step = zf.make_train_step(loss_fn, tx, plan, PREC)
    losses = []
    for raw in BATCHES:
        batch = jax.device_put(raw, plan.batch_sharding())
        # Every host<->device move must be explicit inside the step: no implicit transfers.
        with jax.transfer_guard("disallow"):
            state, metrics = step(state, batch)
        if check:
            check(state, plan)
        losses.append(float(jax.device_get(metrics["loss"])))
    return np.array(losses), jax.device_get(state)


@pytest.fixture(scope="module")
def baselines():
    return {stage: run(stage) for stage in (1, 3)}


def _assert_same(got, want):
    (losses, state), (ref_losses, ref_state) = got, want
    np.testing.assert_array_equal(losses, ref_losses)
    for part in ("master", "compute", "opt_state"):
        for a, b in zip(jax.tree.leaves(getattr(state, part)), jax.tree.leaves(getattr(ref_state, part))):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def _check_placement(state, plan):
    # Master + optimizer state: pinned_host, and sharded over data as the stage says.
    shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), state.master_params)
    expected = state_shardings(shapes, make_tx(), plan, PREC)
    for part in ("master", "opt_state"):
        for arr, want in zip(jax.tree.leaves(getattr(state, part)), jax.tree.leaves(getattr(expected, part))):
            assert arr.sharding.memory_kind == "pinned_host", (part, arr.sharding)
            assert arr.sharding.is_equivalent_to(want, arr.ndim), (part, arr.sharding, want)
    compute_kind = "pinned_host" if plan.offload == "optimizer+params" else "device"
    assert offload.memory_kinds(state.compute) == {compute_kind}
    assert offload.memory_kinds(state.step) == {"device"}


@pytest.mark.parametrize("stage,offload_kind,update_on", [
    (1, "optimizer", "device"),
    (1, "optimizer", "host"),
    (3, "optimizer", "device"),
    (3, "optimizer", "host"),
    (1, "optimizer+params", "host"),
    (3, "optimizer+params", "device"),
])
def test_offloaded_run_matches_plain_run(stage, offload_kind, update_on, baselines):
    got = run(stage, offload_kind, update_on, check=_check_placement)
    _assert_same(got, baselines[stage])


def test_host_update_runs_on_host_in_lowered_step():
    """update_on='host' marks the optimizer update for the host (compute_on('device_host'))."""
    plan = zf.ZeroPlan(zf.make_mesh(), stage=2, offload="optimizer", update_on="host")
    tx = make_tx()
    state = zf.init_train_state(init_params(), tx, plan, PREC)
    step = zf.make_train_step(loss_fn, tx, plan, PREC)
    text = step.lower(state, BATCHES[0]).as_text()
    assert '_xla_compute_type = "host"' in text


def test_fp32_offload_keeps_one_copy_on_host():
    """fp32: the master is the compute copy; offloading it moves the only copy to the host."""
    prec = zf.Precision()
    plan = zf.ZeroPlan(zf.make_mesh(), stage=3, offload="optimizer", update_on="device")
    state = zf.init_train_state(init_params(), make_tx(), plan, prec)
    assert state.compute is None
    assert offload.memory_kinds((state.master, state.opt_state)) == {"pinned_host"}


def test_to_memory_rejects_unknown_kind():
    with pytest.raises(ValueError, match="unknown memory kind 'gpu'"):
        offload.to_memory(jnp.ones(8), zf.ZeroPlan(zf.make_mesh()).replicated(), "gpu")


def test_host_update_needs_offload():
    with pytest.raises(ValueError, match="update_on='host' needs offload"):
        zf.ZeroPlan(zf.make_mesh(), stage=1, update_on="host")
