"""Where the optimizer update runs is one value, ``UpdatePath``: chosen once per state layout
(``zeroflow.engine.update.update_path``, called by ``step_layout``), dispatched on by the step and
read by whatever plans memory. Here: the path the step takes for each plan of a small grid; and
each path running its own mechanism and giving plain optax's update."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import zeroflow as zf
from zeroflow.engine import offload, update
from zeroflow.engine.state import state_shardings
from zeroflow.engine.step import step_layout
from zeroflow.engine.update import ComputeRefresh, UpdatePath
from test_offload import init_params, loss_fn  # the same small model, one bias stored padded

pytestmark = pytest.mark.slow

IN_PLACE, ON_HOST, STREAMED, WHOLE = (UpdatePath.IN_PLACE, UpdatePath.ON_HOST,
                                      UpdatePath.STREAMED, UpdatePath.BROUGHT_IN_WHOLE)


BATCH = {"x": np.random.default_rng(1).normal(size=(16, 16)).astype(np.float32),
         "y": np.random.default_rng(2).normal(size=(16, 10)).astype(np.float32)}
BF16 = zf.Precision(params="bf16")
TXS = {
    # Splits by parameter: the global norm reads gradients only, then each leaf's own state.
    "clip+adamw": lambda: optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-2)),
    # A norm over the updates reads every parameter's moments at once: cannot be streamed.
    "adamw+clip": lambda: optax.chain(optax.adamw(1e-2), optax.clip_by_global_norm(1.0)),
}


def _mesh(where: str):
    """``cpu``: the 8 emulated devices (host memory is device memory); ``cpu+host``: the same
    with host memory a memory of its own, as on a GPU; ``planning``: 8 GPUs of a planning mesh;
    ``h100``: 8 abstract H100s (``zf.target_mesh``)."""
    if where == "planning":
        return zf.planning_mesh(8), None
    if where == "h100":
        return zf.target_mesh("h100", data=8), None
    mesh = zf.make_mesh()
    traits = zf.backend.of(mesh)
    return mesh, (dataclasses.replace(traits, separate_host_memory=True)
                  if where == "cpu+host" else None)


def _plan(stage, offload_kind, update_on, where):
    mesh, traits = _mesh(where)
    return zf.ZeroPlan(mesh, stage=stage, offload=offload_kind, update_on=update_on,
                       traits=traits)


# offload, update_on, where, tx: the path the step takes (``UpdatePath``'s members say why).
PATHS = [
    ("none", "device", "cpu", "clip+adamw", IN_PLACE),
    ("none", "device", "planning", "adamw+clip", IN_PLACE),
    ("optimizer", "host", "cpu", "clip+adamw", ON_HOST),
    ("optimizer", "host", "planning", "adamw+clip", ON_HOST),
    ("optimizer+params", "host", "planning", "clip+adamw", ON_HOST),
    ("optimizer", "device", "cpu", "clip+adamw", WHOLE),  # XLA:CPU: nothing to stream
    ("optimizer", "device", "cpu+host", "clip+adamw", STREAMED),
    ("optimizer", "device", "cpu+host", "adamw+clip", WHOLE),  # cannot be split
    ("optimizer", "device", "planning", "clip+adamw", STREAMED),
    ("optimizer", "device", "planning", "adamw+clip", WHOLE),
    ("optimizer", "device", "h100", "clip+adamw", STREAMED),
    ("optimizer+params", "device", "cpu", "clip+adamw", WHOLE),
    ("optimizer+params", "device", "planning", "clip+adamw", STREAMED),
]


@pytest.mark.parametrize("stage", [1, 3])
@pytest.mark.parametrize("offload_kind,update_on,where,tx_name,path", PATHS,
                         ids=["-".join(row[:4]) for row in PATHS])
def test_the_step_takes_the_plans_update_path(stage, offload_kind, update_on, where, tx_name,
                                              path):
    plan, tx, prec = _plan(stage, offload_kind, update_on, where), TXS[tx_name](), BF16
    params = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), init_params())
    state = jax.eval_shape(lambda: zf.init_train_state(params, tx, plan, prec))
    step = zf.make_train_step(loss_fn, tx, plan, prec)
    assert step.layout(state).update_path is path


@pytest.mark.parametrize("stage,offload_kind,update_on,where,refresh", [
    (0, "none", "device", "cpu", ComputeRefresh.LEAF_AFTER_LEAF),  # XLA:CPU widens gathers
    (2, "none", "device", "cpu", ComputeRefresh.LEAF_AFTER_LEAF),
    (2, "none", "device", "planning", ComputeRefresh.BY_SLICES),
    (3, "none", "device", "planning", ComputeRefresh.AS_MADE),  # no compute copy
    (2, "optimizer", "device", "cpu", ComputeRefresh.LEAF_AFTER_LEAF),  # brought in whole
    (2, "optimizer+params", "device", "cpu", ComputeRefresh.AS_MADE),  # stored on the host
    (2, "optimizer", "device", "planning", ComputeRefresh.AS_MADE),  # streamed
    (2, "optimizer", "host", "cpu", ComputeRefresh.AS_MADE),
])
def test_compute_refresh_follows_the_update_path(stage, offload_kind, update_on, where, refresh):
    plan, tx, prec = _plan(stage, offload_kind, update_on, where), TXS["clip+adamw"](), BF16
    params = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), init_params())
    assert step_layout(params, tx, plan, prec).compute_refresh is refresh


def _plain_optax(tx):
    """One update of plain optax on the whole batch's gradient: what every path must give."""
    params = init_params()
    grads = jax.grad(loss_fn)(params, BATCH)
    updates, _ = tx.update(grads, tx.init(params), params)
    return optax.apply_updates(params, updates)


def _spy(monkeypatch, calls: list):
    """Record which update mechanisms the step traces (``apply``, ``streamed``, ``on_host`` and
    every explicit move to a memory kind)."""
    def recorded(name, fn, kind_arg=None):
        def spy(*args, **kwargs):
            calls.append(name if kind_arg is None else f"{name}:{args[kind_arg]}")
            return fn(*args, **kwargs)
        return spy
    monkeypatch.setattr(update, "apply", recorded("apply", update.apply))
    monkeypatch.setattr(update, "streamed", recorded("streamed", update.streamed))
    monkeypatch.setattr(offload, "on_host", recorded("on_host", offload.on_host))
    monkeypatch.setattr(offload, "to_memory", recorded("to", offload.to_memory, kind_arg=2))


@pytest.mark.parametrize("offload_kind,update_on,where,path,mechanisms", [
    ("none", "device", "cpu", IN_PLACE, {"apply"}),
    ("optimizer", "host", "cpu", ON_HOST, {"to:pinned_host", "on_host", "apply"}),
    ("optimizer", "device", "cpu", WHOLE, {"to:device", "apply"}),
    ("optimizer", "device", "cpu+host", STREAMED, {"streamed", "to:device", "to:pinned_host"}),
])
def test_each_path_runs_its_own_update_and_gives_plain_optax(monkeypatch, offload_kind,
                                                              update_on, where, path, mechanisms):
    """One fp32 step at stage 2 on the 8 devices: the layout's path, the mechanisms traced for
    it, and the new master weights against plain optax's on the same gradient."""
    plan, tx, prec = _plan(2, offload_kind, update_on, where), TXS["clip+adamw"](), zf.Precision()
    state = zf.init_train_state(init_params(), tx, plan, prec)
    step = zf.make_train_step(loss_fn, tx, plan, prec)
    calls: list[str] = []
    _spy(monkeypatch, calls)
    state, _ = step(state, jax.device_put(BATCH, plan.batch_sharding()))
    assert step.layout(state).update_path is path
    assert set(calls) == mechanisms, calls
    want = _plain_optax(TXS["clip+adamw"]())
    for name, got in jax.device_get(state.master_params).items():
        np.testing.assert_allclose(got, want[name], rtol=1e-5, atol=1e-6, err_msg=name)


def test_a_streamed_update_of_an_optimizer_that_mixes_parameters_is_refused():
    """No silent fallback: ``update.streamed`` is only taken where ``update_path`` found the
    update splits; handed one that does not, it says so."""
    tx = TXS["adamw+clip"]()
    plan = _plan(3, "optimizer", "device", "cpu+host")
    state = zf.init_train_state(init_params(), tx, plan, zf.Precision())
    shard = state_shardings(init_params(), tx, plan, zf.Precision())
    grads = jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), state.master)
    with pytest.raises(ValueError, match="cannot run one parameter at a time"):
        jax.eval_shape(lambda g, m, o: update.streamed(g, m, o, True, tx=tx, compute_dtype=None,
                                                       shardings=shard),
                       grads, state.master, state.opt_state)
