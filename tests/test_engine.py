"""The engine on 8 emulated CPU devices, with a small Flax model that is not zeroflow's own."""
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import zeroflow as zf
from fixtures import BATCHES, MLP, MODEL, init_params, linear_loss, loss_fn, make_batch, make_tx
from helpers import assert_leaves_close, bytes_on, optax_losses, train_losses

pytestmark = pytest.mark.fast

N_DEV = 8


def run_zero(stage, batches, prec=None, grad_accum=1, mesh=None):
    mesh = mesh or zf.make_mesh(data=-1, model=1)
    prec = prec or zf.Precision()
    plan = zf.ZeroPlan(mesh, stage=stage)
    tx = make_tx()
    state = zf.init_train_state(init_params(), tx, plan, prec)
    step = zf.make_train_step(loss_fn, tx, plan, prec, grad_accum=grad_accum)
    losses, state, metrics = train_losses(step, state, batches)
    return np.array(losses), state, step, metrics


@pytest.fixture(scope="module")
def reference():
    losses, params, _ = optax_losses(loss_fn, make_tx(), init_params(), BATCHES, has_aux=True)
    return losses, params


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_fp32_stage_matches_plain_optax(stage, reference):
    ref_losses, ref_params = reference
    losses, state, _, metrics = run_zero(stage, BATCHES)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5, atol=1e-6)
    assert_leaves_close(state.master_params, ref_params, rtol=1e-5, atol=1e-6)
    assert state.compute is None and state.stored_params is state.master  # fp32: one copy only
    assert int(state.step) == len(BATCHES)
    assert set(metrics) >= {"loss", "grad_norm", "loss_scale", "skipped", "pred_mean"}
    assert int(metrics["skipped"]) == 0


@pytest.mark.parametrize("grad_accum", [1, 2])
def test_one_device_matches_plain_optax(grad_accum, reference):
    ref_losses, ref_params = reference
    one = zf.make_mesh(devices=jax.devices()[:1])
    losses, state, _, _ = run_zero(0, BATCHES, grad_accum=grad_accum, mesh=one)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5, atol=1e-6)
    assert_leaves_close(state.master_params, ref_params, rtol=1e-5, atol=1e-6)


def test_grad_accumulation_equals_one_big_batch(reference):
    ref_losses, ref_params = reference
    losses, state, _, _ = run_zero(2, BATCHES, grad_accum=2)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5, atol=1e-6)
    assert_leaves_close(state.master_params, ref_params, rtol=1e-5, atol=1e-6)


def _bytes_on_device0(tree):
    return bytes_on(jax.devices()[0], tree)


def _global_bytes(tree):
    return sum(leaf.nbytes for leaf in jax.tree.leaves(tree))


def _wide_params():
    # Wider than MLP() so the unsplittable (10,) bias is a negligible share, as in real models.
    return MLP(hidden=256).init(jax.random.PRNGKey(0), jnp.zeros((1, 24)))["params"]


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_per_device_memory_of_each_stage(stage):
    plan = zf.ZeroPlan(zf.make_mesh(), stage=stage)
    prec = zf.Precision(params="bf16")
    state = zf.init_train_state(_wide_params(), optax.adam(1e-3), plan, prec)
    model_states = (state.master, state.opt_state)
    ratio = _bytes_on_device0(model_states) / _global_bytes(model_states)
    if stage == 0:
        assert ratio == pytest.approx(1.0)
    else:
        assert ratio == pytest.approx(1 / N_DEV, rel=0.05)
    if stage == 3:
        # Every use gathers a shard, so the fp32 master's shard is cast as it is gathered: no
        # bf16 copy is stored (12 bytes per parameter over N, not 14).
        assert state.compute is None
    else:
        compute_ratio = _bytes_on_device0(state.compute) / _global_bytes(state.compute)
        assert compute_ratio == pytest.approx(1.0)
    assert jax.tree.leaves(state.params)[0].dtype == jnp.bfloat16


def _collectives(stage, grad_accum=1):
    _, state, step, _ = run_zero(stage, BATCHES[:1], grad_accum=grad_accum)
    hlo = step.lower(state, BATCHES[0]).compile().as_text()
    return {op for op in ("reduce-scatter", "all-gather", "all-reduce") if op in hlo}


@pytest.mark.parametrize("stage,grad_accum,expected,absent", [
    (0, 1, {"all-reduce"}, {"reduce-scatter", "all-gather"}),
    # Stage 1 reduces once per step: on use with one micro-batch (a reduce-scatter, as stage 2),
    # after accumulating whole gradients with several (an all-reduce).
    (1, 1, {"reduce-scatter", "all-gather"}, set()),
    (1, 2, {"all-reduce", "all-gather"}, {"reduce-scatter"}),
    (2, 1, {"reduce-scatter", "all-gather"}, set()),
    (2, 2, {"reduce-scatter", "all-gather"}, set()),
    (3, 1, {"reduce-scatter", "all-gather"}, set()),
])
def test_compiled_collectives(stage, grad_accum, expected, absent):
    ops = _collectives(stage, grad_accum)
    assert expected <= ops, ops
    assert not (absent & ops), ops


def test_bf16_trains_close_to_fp32(reference):
    ref_losses, _ = reference
    losses, state, _, _ = run_zero(3, BATCHES, prec=zf.Precision(params="bf16"))
    assert jax.tree.leaves(state.master)[0].dtype == jnp.float32
    assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(state.params))
    np.testing.assert_allclose(losses, ref_losses, rtol=3e-2)


def _scaled_run(loss, prec, steps=1, **plan_kw):
    plan = zf.ZeroPlan(zf.make_mesh(), stage=2, **plan_kw)
    tx = optax.sgd(1.0)
    params = {"w": jnp.ones((64,), jnp.float32)}
    state = zf.init_train_state(params, tx, plan, prec)
    step = zf.make_train_step(loss, tx, plan, prec)
    batch = {"x": np.ones((16, 64), np.float32)}
    history = []
    for _ in range(steps):
        before = np.asarray(state.master["w"])
        state, m = step(state, batch)
        history.append((before, m))
    return state, history


def test_fp16_overflow_skips_update_and_halves_scale():
    # d(loss)/dw = 10 per element; scaled by 2**15 that is 327680 > fp16 max (65504): inf.
    prec = zf.Precision(params="fp16", loss_scale="dynamic")
    state, [(before, m)] = _scaled_run(linear_loss(10.0), prec)
    assert int(m["skipped"]) == 1
    assert float(m["loss_scale"]) == 2.0 ** 15
    assert float(state.loss_scale.scale) == 2.0 ** 14
    np.testing.assert_array_equal(np.asarray(state.master["w"]), before)


def test_fp16_scale_recovers_and_grows():
    prec = zf.Precision(params="fp16", loss_scale="dynamic", growth_interval=2)
    state, hist = _scaled_run(linear_loss(10.0), prec, steps=5)
    skipped = [int(m["skipped"]) for _, m in hist]
    scales = [float(m["loss_scale"]) for _, m in hist]
    # 2**15 and 2**14 overflow (327680, 163840), 2**13 * 10 = 81920 still does; 2**12 fits.
    assert skipped == [1, 1, 1, 0, 0]
    assert scales == [2.0 ** 15, 2.0 ** 14, 2.0 ** 13, 2.0 ** 12, 2.0 ** 12]
    assert float(state.loss_scale.scale) == 2.0 ** 13  # doubled after 2 clean steps
    assert not np.allclose(np.asarray(state.master["w"]), hist[2][0])  # clean steps updated


def test_fp16_small_gradients_survive_only_with_dynamic_scaling():
    # d(loss)/dw = 1e-8 per element: below fp16's smallest subnormal (~6e-8), so it flushes to
    # zero unless the loss is scaled up first.
    tiny = linear_loss(1e-8)
    _, [(_, m_dyn)] = _scaled_run(tiny, zf.Precision(params="fp16", loss_scale="dynamic"))
    _, [(_, m_none)] = _scaled_run(tiny, zf.Precision(params="fp16", loss_scale="none"))
    expected_norm = 1e-8 * np.sqrt(64)
    assert float(m_dyn["grad_norm"]) == pytest.approx(expected_norm, rel=1e-2)
    assert float(m_none["grad_norm"]) == 0.0


@pytest.mark.parametrize("stage", [2, 3])
def test_gradient_sum_over_devices_is_not_rounded_to_fp16(stage):
    # Each device's scaled gradient, 1 * 2**15, fits fp16 (max 65504); their sum over 8 devices
    # does not. Every stage must sum in fp32 and take the step.
    def loss(params, batch):
        return jnp.sum(params["w"].astype(jnp.float32) * batch["x"].astype(jnp.float32).mean(0))
    plan = zf.ZeroPlan(zf.make_mesh(), stage=stage)
    prec, tx = zf.Precision(params="fp16", loss_scale="dynamic"), optax.sgd(0.1)
    state = zf.init_train_state({"w": jnp.ones((64,), jnp.float32)}, tx, plan, prec)
    state, m = zf.make_train_step(loss, tx, plan, prec)(state, {"x": np.ones((16, 64), np.float32)})
    assert int(m["skipped"]) == 0 and float(m["grad_norm"]) == pytest.approx(8.0)
    np.testing.assert_allclose(np.asarray(state.master["w"]), 0.9)


def test_static_loss_scale():
    prec = zf.Precision(params="fp16", loss_scale=128.0)
    state, [(_, m)] = _scaled_run(linear_loss(1.0), prec)
    assert float(m["loss_scale"]) == 128.0 and float(state.loss_scale.scale) == 128.0
    assert float(m["grad_norm"]) == pytest.approx(8.0, rel=1e-3)


@pytest.mark.parametrize("stage", [1, 3])
def test_state_keeps_its_layout_and_compiles_once(stage):
    plan, prec, tx = zf.ZeroPlan(zf.make_mesh(), stage=stage), zf.Precision(params="bf16"), make_tx()
    state = zf.init_train_state(init_params(), tx, plan, prec)
    want = zf.state_shardings(init_params(), tx, plan, prec)
    step = zf.make_train_step(loss_fn, tx, plan, prec)
    for b in BATCHES[:3]:
        state, _ = step(state, b)
    for got, expected in zip(jax.tree.leaves(state), jax.tree.leaves(want)):
        assert got.sharding.is_equivalent_to(expected, got.ndim)
    assert step.jitted(state)._cache_size() == 1  # no recompile after the first step


def test_step_compiles_to_the_state_layout_and_donates_state():
    """One XLA program whose new state has the shardings ``state_shardings`` documents, and
    in which every buffer of the old state is an alias of an output (donation XLA takes up)."""
    _, state, step, _ = run_zero(1, BATCHES[:1])
    compiled = step.lower(state, BATCHES[1]).compile()
    new_state, _ = compiled.output_shardings
    want = zf.state_shardings(init_params(), make_tx(), zf.ZeroPlan(zf.make_mesh(), stage=1),
                              zf.Precision())
    assert jax.tree.structure(new_state) == jax.tree.structure(want)
    shards = [(g, w, x) for g, w, x in zip(jax.tree.leaves(new_state), jax.tree.leaves(want),
                                           jax.tree.leaves(state), strict=True)]
    assert any(not w.is_fully_replicated for _, w, _ in shards)  # stage 1 splits the master
    for got, expected, x in shards:
        assert got.is_equivalent_to(expected, x.ndim), (got, expected)
    # HLO parameters are the flattened (state, batch): the state's come first
    aliased = re.findall(r"\(\s*(\d+),\s*\{[^}]*\},\s*(?:may|must)-alias\)", compiled.as_text())
    assert sorted(map(int, aliased)) == list(range(len(jax.tree.leaves(state))))
    old_master = jax.tree.leaves(state.master)[0]
    step(state, BATCHES[1])
    assert old_master.is_deleted()


# ----------------------------------------------------------------------------- bad input
def test_mesh_must_match_device_count():
    with pytest.raises(ValueError, match="needs 3 devices, but 8"):
        zf.make_mesh(data=3, model=1)
    with pytest.raises(ValueError, match="do not divide"):
        zf.make_mesh(data=-1, model=3)


def test_stage_outside_range():
    with pytest.raises(ValueError, match="stage must be 0, 1, 2 or 3"):
        zf.ZeroPlan(zf.make_mesh(), stage=4)


def test_unknown_dtype():
    with pytest.raises(ValueError, match="unknown params dtype 'fp8'"):
        zf.Precision(params="fp8")
    with pytest.raises(ValueError, match="loss_scale"):
        zf.Precision(loss_scale="sometimes")


def test_batch_not_divisible():
    plan = zf.ZeroPlan(zf.make_mesh(), stage=1)
    prec, tx = zf.Precision(), make_tx()
    state = zf.init_train_state(init_params(), tx, plan, prec)
    step = zf.make_train_step(loss_fn, tx, plan, prec, grad_accum=2)
    with pytest.raises(ValueError, match="batch size 24 does not divide by data axis size 8 x grad_accum 2"):
        step(state, make_batch(n=24))


def test_non_float_params():
    plan = zf.ZeroPlan(zf.make_mesh(), stage=1)
    params = {"w": jnp.ones((8, 8)), "ids": jnp.arange(8)}
    with pytest.raises(ValueError, match="non-float leaves: ids"):
        zf.init_train_state(params, make_tx(), plan, zf.Precision())


def test_loss_must_be_scalar():
    plan = zf.ZeroPlan(zf.make_mesh(), stage=0)
    prec, tx = zf.Precision(), make_tx()
    state = zf.init_train_state(init_params(), tx, plan, prec)
    step = zf.make_train_step(lambda p, b: (MODEL.apply({"params": p}, b["x"]) - b["y"]) ** 2,
                              tx, plan, prec)
    with pytest.raises(ValueError, match="scalar loss"):
        step(state, make_batch())


def test_flax_nnx_model_at_stage3_matches_plain_optax():
    from flax import nnx

    class NnxMLP(nnx.Module):
        def __init__(self, rngs):
            self.l1, self.l2 = nnx.Linear(24, 32, rngs=rngs), nnx.Linear(32, 10, rngs=rngs)

        def __call__(self, x):
            return self.l2(nnx.gelu(self.l1(x)))

    graphdef, params = nnx.split(NnxMLP(nnx.Rngs(0)), nnx.Param)

    def nnx_loss(p, batch):
        return jnp.mean((nnx.merge(graphdef, p)(batch["x"]) - batch["y"]) ** 2)

    tx = optax.adam(1e-2)
    ref, _, _ = optax_losses(nnx_loss, tx, params, BATCHES)
    plan, prec = zf.ZeroPlan(zf.make_mesh(), stage=3), zf.Precision()
    state = zf.init_train_state(params, tx, plan, prec)
    step = zf.make_train_step(nnx_loss, tx, plan, prec)
    losses, state, _ = train_losses(step, state, BATCHES)
    np.testing.assert_allclose(losses, ref, rtol=1e-5, atol=1e-6)
    assert type(state.master) is type(params)  # the nnx State tree comes back as such


@pytest.mark.parametrize("stage,scanned", [(0, False), (2, False), (3, False), (3, True)])
def test_gradients_are_summed_in_the_reduce_dtype(stage, scanned):
    """``Precision(reduce=...)``: what each device's gradient is summed over devices in. Device 0
    contributes 1 + 2**-7 to every element and the other seven 1 (all exact in bf16). Their sum,
    8.0078125, lies between bf16's neighbours 8 and 8.0625: summed in bf16 it is 8, summed in
    fp32 (the default) it is exact. SGD with rate 1 from zero weights makes the master weights
    minus the averaged gradient. ``scanned``: a stack of two layers walked by ``lax.scan`` (each
    iteration fetches its slice; the gradient leaves through the gather's transpose)."""
    plan = zf.ZeroPlan(zf.make_mesh(), stage=stage)
    rows = np.ones((N_DEV, 64), np.float32)
    rows[0] += 2.0 ** -7
    batch = {"x": rows}
    shape = (2, 64) if scanned else (64,)

    def loss(params, batch):
        x = batch["x"].mean(0).astype(params["w"].dtype)
        if scanned:
            # (the carry starts from the data: a constant start fails shard_map's varying-type
            # check, a limitation of zeroflow's any-model path of its own)
            total, _ = jax.lax.scan(lambda t, w: (t + jnp.sum(w * x), None), x[0] * 0,
                                    params["w"])
            return total.astype(jnp.float32)
        return jnp.sum(params["w"] * x).astype(jnp.float32)

    got = {}
    for reduce in ("fp32", "bf16"):
        prec = zf.Precision(params="bf16", reduce=reduce)
        tx = optax.sgd(1.0)
        state = zf.init_train_state({"w": jnp.zeros(shape, jnp.float32)}, tx, plan, prec)
        state, _ = zf.make_train_step(loss, tx, plan, prec)(state, batch)
        got[reduce] = np.asarray(state.master_params["w"])
    np.testing.assert_array_equal(got["fp32"], np.full(shape, -8.0078125 / N_DEV))
    np.testing.assert_array_equal(got["bf16"], np.full(shape, -8.0 / N_DEV))
