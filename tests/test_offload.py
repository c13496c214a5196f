"""Host offload on 8 emulated CPU devices: numerics and memory kinds, not speed.

Offloaded runs must give bit-for-bit the losses and weights of the same run without offload,
and after every step the fp32 master weights and optimizer state must live in pinned_host
memory, sharded over ``data`` as the stage says.
"""
import dataclasses

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import zeroflow as zf
from zeroflow.engine import offload, update
from zeroflow.engine.state import state_shardings

pytestmark = pytest.mark.fast

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


# -- update_on="device": the offloaded state streamed through the device one parameter at a time


def separate_host_memory():
    """The traits of the CPU mesh, but with host memory separate, as on a GPU: on XLA:CPU host
    and device memory are one, so the engine does not stream there (it would only add copies)."""
    return dataclasses.replace(zf.backend.of(zf.make_mesh()), separate_host_memory=True)


@pytest.mark.parametrize("tx", [make_tx(), optax.lion(1e-3), optax.sgd(1e-2, momentum=0.9)],
                         ids=["clip+adamw", "lion", "momentum"])
def test_streamed_update_equals_the_whole_update(tx):
    plan = zf.ZeroPlan(zf.make_mesh(), stage=3, offload="optimizer")
    state = zf.init_train_state(init_params(), tx, plan, zf.Precision())
    rng = np.random.default_rng(0)
    grads = jax.tree.map(lambda x: jnp.asarray(rng.normal(size=x.shape), jnp.float32), state.master)
    shard = state_shardings(state.master, tx, plan, zf.Precision())
    for finite in (True, False):
        streamed = jax.jit(lambda g, m, o, f: update.streamed(
            g, m, o, f, tx=tx, compute_dtype=jnp.bfloat16, shardings=shard))(
            grads, state.master, state.opt_state, finite)
        device = lambda t: offload.to_memory(t, jax.tree.map(  # noqa: E731
            lambda s: s.with_memory_kind("device"), shard.master), "device")
        whole = jax.jit(lambda g, m, o, f: update.apply(
            g, m, o, f, tx=tx, compute_dtype=jnp.bfloat16))(
            grads, device(state.master), jax.tree.map(lambda x: jax.device_put(
                x, x.sharding.with_memory_kind("device")), state.opt_state), finite)
        for got, want in zip(jax.tree.leaves(streamed), jax.tree.leaves(whole)):
            np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
        assert offload.memory_kinds(streamed[:2]) == {"pinned_host"}  # back on the host


def test_streamed_update_waits_for_the_previous_parameter():
    """Each parameter's offloaded state is copied in only after the previous parameter's
    results have been copied back to the host, so the device holds one parameter's state at a
    time (XLA:GPU otherwise copies every result out at the end of the step)."""
    tx = make_tx()
    plan = zf.ZeroPlan(zf.make_mesh(), stage=3, offload="optimizer")
    state = zf.init_train_state(init_params(), tx, plan, zf.Precision())
    shard = state_shardings(state.master, tx, plan, zf.Precision())
    grads = jax.tree.map(lambda x: jax.device_put(np.zeros(x.shape, np.float32),
                                                  x.sharding.with_memory_kind("device")), state.master)
    jaxpr = jax.make_jaxpr(lambda g, m, o: update.streamed(
        g, m, o, jnp.bool_(True), tx=tx, compute_dtype=None, shardings=shard))(
        grads, state.master, state.opt_state).jaxpr
    # Every copy of fp32 state to the device, in program order, and what each one's first
    # use depends on.
    copies = [e for e in jaxpr.eqns if e.primitive.name == "device_put"
              and any(getattr(d, "memory_kind", None) == "device" for d in e.params["devices"])]
    made = {v: e for e in jaxpr.eqns for v in e.outvars}

    def ancestors(var, seen=None):
        seen = set() if seen is None else seen
        eqn = made.get(var)
        if eqn is None or id(eqn) in seen:
            return seen
        seen.add(id(eqn))
        for v in eqn.invars:
            if not isinstance(v, jax.extend.core.Literal):
                ancestors(v, seen)
        return seen

    n_params = len(jax.tree.leaves(state.master))
    by_param = [[c for c in copies if c.outvars[0].aval.shape == p.shape] for p in
                jax.tree.leaves(state.master)]
    assert all(by_param) and len(copies) >= n_params
    # The copy in of parameter i's state depends on the copy of parameter i-1's results back
    # to the host, which depends on that parameter's state: the update of i cannot start
    # before i-1's is done and out of device memory.
    sent = {id(e): e for e in jaxpr.eqns if e.primitive.name == "device_put"
            and any(getattr(d, "memory_kind", None) == "pinned_host" for d in e.params["devices"])}
    order = sorted(range(n_params), key=lambda i: jaxpr.eqns.index(by_param[i][0]))
    for before, after in zip(order, order[1:]):
        copy_in = by_param[after][0]
        deps = set().union(*(ancestors(v) for v in copy_in.invars
                             if not isinstance(v, jax.extend.core.Literal)))
        assert id(by_param[before][0]) in deps, (before, after)
        assert any(sent[d].invars[0].aval.shape == by_param[before][0].outvars[0].aval.shape
                   for d in deps & sent.keys()), (before, after)


def test_update_that_mixes_parameters_is_not_streamed():
    """A norm over the updates needs every parameter's optimizer state at once."""
    mixed = optax.chain(optax.adam(1e-3), optax.clip_by_global_norm(1.0))
    params = jax.tree.map(jnp.asarray, init_params())
    assert not update.streamable(mixed, params)
    assert update.streamable(make_tx(), params)


def test_streamed_update_lowers_for_cuda_one_copy_per_state_leaf():
    """The step with the streamed update lowers for CUDA (real memory kinds there), and each
    leaf of master and optimizer state crosses to the device on its own: no copy moves more
    than one leaf, and every leaf is copied in."""
    import re
    tx = make_tx()
    plan = zf.ZeroPlan(zf.make_mesh(), stage=3, offload="optimizer",
                       traits=separate_host_memory())
    state = zf.init_train_state(init_params(), tx, plan, zf.Precision())
    step = zf.make_train_step(loss_fn, tx, plan, zf.Precision())
    text = step.trace(state, BATCHES[0]).lower(lowering_platforms=("cuda",)).as_text()
    copied = [re.search(r": \((tensor<[^>]*>)\)", line).group(1) for line in text.splitlines()
              if '_xla_buffer_placement = "device"' in line]
    fp32_state = [x for x in jax.tree.leaves((state.master, state.opt_state))
                  if x.dtype == jnp.float32 and x.ndim]
    # (global shapes: the update runs outside shard_map, before SPMD partitioning)
    want = {"tensor<" + "x".join(map(str, x.shape)) + "xf32>" for x in fp32_state}
    assert want <= set(copied), (want, copied)
    assert len([c for c in copied if c in want]) >= len(fp32_state)


def _moved_to_host(closed) -> list:
    """The avals of the device arrays ``closed`` moves to pinned host memory."""
    from zeroflow.util import jaxprs
    found = []

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "device_put":
                found.extend(v.aval for v, d in zip(eqn.invars, eqn.params["devices"])
                             if getattr(d, "memory_kind", None) == "pinned_host"
                             and "host" not in str(v.aval))
            body = jaxprs.call_body(eqn)
            if body is not None:
                walk(jaxprs.open_jaxpr(body)[0])
    walk(closed.jaxpr)
    return found


def test_one_device_host_update_sends_compute_dtype_gradients():
    """One device, one micro-batch, update on the host (ZeRO-Offload's single-GPU case): the
    bf16 gradients go to the host as the backward pass made them and are widened and unscaled
    there (no fp32 copy of them on the device), with the same result as the run without
    offload."""
    one = jax.devices()[:1]

    def one_device_run(offload_kind, update_on):
        plan = zf.ZeroPlan(zf.make_mesh(devices=one), stage=3, offload=offload_kind,
                           update_on=update_on)
        tx = make_tx()
        state = zf.init_train_state(init_params(), tx, plan, PREC)
        step = zf.make_train_step(loss_fn, tx, plan, PREC)
        moved = _moved_to_host(step.trace(state, BATCHES[0]).jaxpr)
        losses = []
        for raw in BATCHES:
            state, metrics = step(state, jax.device_put(raw, plan.batch_sharding()))
            losses.append(float(metrics["loss"]))
        return moved, (np.array(losses), jax.device_get(state))

    moved, got = one_device_run("optimizer", "host")
    shapes = {tuple(x.shape) for x in jax.tree.leaves(init_params())}
    grads = [x for x in moved if tuple(x.shape) in shapes]
    assert len(grads) == len(shapes) and {x.dtype for x in grads} == {jnp.dtype(jnp.bfloat16)}
    _assert_same(got, one_device_run("none", "device")[1])
