"""ZeRO++ hpZ (a within-host copy of the stage-3 weights) and qgZ (int8 gradient reduction in
two hops) on 8 emulated CPU devices as 2 hosts of 4, and on the 2 x 8 H100 target."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import zeroflow as zf
from zeroflow.engine import zeropp
from test_zeropp import W, V, _mlp_batches, _mlp_loss, _mlp_params, _stage3_on_two_hosts, numpy_quantize

pytestmark = pytest.mark.fast


def _params_with_padding():
    """The two matrices and a bias of 10 entries, stored padded to 16 on 8 devices."""
    p = _mlp_params()
    return {**p, "b": jnp.linspace(-0.5, 0.5, 10)}


def _loss_with_bias(p, b):
    h = jnp.tanh(b["x"].astype(p["w1"].dtype) @ p["w1"])
    out = (h @ p["w2"]).astype(jnp.float32)
    return jnp.mean((out - b["y"]) ** 2) + jnp.mean(p["b"].astype(jnp.float32) ** 2)


def _reference_losses(params, tx, batches):
    """The mixed-precision loop by hand on one device: fp32 master, bf16 weights for the
    loss, the gradient taken at the bf16 weights and applied to the master by optax."""
    master, opt, losses = params, tx.init(params), []
    for batch in batches:
        seen = jax.tree.map(lambda x: x.astype(jnp.bfloat16), master)
        loss, g = jax.value_and_grad(_loss_with_bias)(seen, batch)
        g = jax.tree.map(lambda x: x.astype(jnp.float32), g)
        updates, opt = tx.update(g, opt, master)
        master = optax.apply_updates(master, updates)
        losses.append(float(loss))
    return np.array(losses)


STEPS = 8


@functools.lru_cache(maxsize=None)
def _trained(**options):
    """``_train(STEPS, **options)``, once per module run: several tests read the same runs."""
    return _train(STEPS, **options)


def _train(steps, **options):
    plan = zf.ZeroPlan(zf.make_mesh(), stage=3, **options)
    prec, tx = zf.Precision(params="bf16"), optax.adam(3e-3)
    state = zf.init_train_state(_params_with_padding(), tx, plan, prec)
    step = zf.make_train_step(_loss_with_bias, tx, plan, prec)
    losses = []
    for batch in _mlp_batches(steps):
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
    return np.array(losses), state


def test_hpz_trains_exactly_like_stage3_from_a_copy_per_host():
    """hpZ changes where the bf16 weights are gathered from, not the arithmetic: 8 Adam steps
    give plain stage 3's losses and master bit for bit, the losses within 1e-3 of the
    hand-written mixed-precision loop's (device sums differ in order; Adam turns that into
    lr-sized differences of near-zero gradients' entries, so the masters are not compared
    with it), and after every update each host's
    4 devices hold between them a whole bf16 copy of the new master, padding included."""
    plain_losses, plain = _trained()
    losses, state = _trained(hierarchical=True, hosts=2)
    np.testing.assert_array_equal(losses, plain_losses)
    for k in plain.master:
        np.testing.assert_array_equal(np.asarray(state.master_params[k]),
                                      np.asarray(plain.master_params[k]))
    want = _reference_losses(_params_with_padding(), optax.adam(3e-3), _mlp_batches(STEPS))
    np.testing.assert_allclose(losses, want, rtol=1e-3)
    for k, lay in zf.ZeroPlan(zf.make_mesh(), stage=3).layouts(_params_with_padding()).items():
        cast = np.asarray(state.master_params[k].astype(jnp.bfloat16), np.float32)
        stored = np.asarray(state.compute[k], np.float32)
        padded = np.zeros(lay.stored_shape(True), np.float32)
        padded[tuple(slice(0, s) for s in cast.shape)] = cast
        np.testing.assert_array_equal(stored, np.concatenate([padded, padded], axis=lay.zero_dim))
        piece = state.compute[k].sharding.shard_shape(stored.shape)[lay.zero_dim]
        assert piece * 4 == padded.shape[lay.zero_dim]  # 1/4 of a copy on each device
        np.testing.assert_array_equal(np.asarray(state.params[k], np.float32), cast)


def numpy_qgz(device_grads, hosts: int, local: int, block: int):
    """The reference two-hop reduction: each device's gradient cut into one slice per
    destination; hop 1 quantizes the slices bound for each local index (numpy_quantize) and
    sums what a device receives in fp32; hop 2 requantizes those host sums per destination
    host and sums again in fp32. Returns the summed gradient, slices in device order."""
    def through_int8(row):
        codes, scales, _ = numpy_quantize(row, block)
        return (codes.astype(np.float32) * scales[:, None]).reshape(-1)[:row.size]
    slices = [np.asarray(g, np.float32).reshape(hosts, local, -1) for g in device_grads]
    host_sums = {(h, dst): np.sum([through_int8(slices[h * local + src][:, dst].reshape(-1))
                                   for src in range(local)], axis=0, dtype=np.float32)
                 for h in range(hosts) for dst in range(local)}
    mine = [np.sum([through_int8(host_sums[h, dst].reshape(hosts, -1)[to]) for h in range(hosts)],
                   axis=0, dtype=np.float32) for to in range(hosts) for dst in range(local)]
    return np.concatenate(mine).reshape(np.shape(device_grads[0]))


def test_qgz_gradient_is_the_two_hop_int8_reduction_of_the_devices_gradients():
    """One SGD step at stage 3 with qgZ (blocks of 16): the applied gradient equals the numpy
    two-hop reduction of the 8 devices' gradients (each from jax.grad on its rows) to fp32
    rounding, and differs from the exact fp32 sum (the quantization is really applied)."""
    params, batch, lr, block = _mlp_params(), _mlp_batches(1)[0], 0.5, 16
    rows = {k: np.split(np.asarray(v), 8) for k, v in batch.items()}
    per_device = [jax.grad(_mlp_loss)(params, {k: jnp.asarray(v[d]) for k, v in rows.items()})
                  for d in range(8)]
    exact = jax.grad(_mlp_loss)(params, batch)
    plan = zf.ZeroPlan(zf.make_mesh(), stage=3, quantize_grads="int8", hosts=2,
                       quantize_block=block)
    prec, tx = zf.Precision(), optax.sgd(lr)
    state = zf.init_train_state(params, tx, plan, prec)
    state, _ = zf.make_train_step(_mlp_loss, tx, plan, prec)(state, batch)
    for k in params:
        applied = (np.asarray(params[k]) - np.asarray(state.master_params[k])) / lr
        want = numpy_qgz([g[k] for g in per_device], 2, 4, block) / 8
        np.testing.assert_allclose(applied, want, atol=1e-6)
        assert np.abs(applied - np.asarray(exact[k])).max() > 1e-4


def test_all_three_train_like_stage3():
    """8 Adam steps in bf16 with qgZ, and with hpZ + qwZ + qgZ (blocks of 64): the losses stay
    within 1% of plain stage 3's. Each gradient entry is off by at most a 1/254 of its block's
    largest magnitude per hop and sender (two hops), each gathered weight entry by 1/254
    (qwZ): the size of bf16's own rounding (2^-8), which Adam's normalisation does not amplify
    beyond the step it takes."""
    plain, _ = _trained()
    qgz, _ = _trained(quantize_grads="int8", hosts=2, quantize_block=64)
    every, _ = _trained(hierarchical=True, quantize_weights="int8", quantize_grads="int8",
                        hosts=2, quantize_block=64)
    assert plain[-3:].mean() < 0.95 * plain[:3].mean()  # it trains
    np.testing.assert_allclose(qgz, plain, rtol=0.01)
    np.testing.assert_allclose(every, plain, rtol=0.01)
    assert np.abs(qgz - plain).max() > 0  # the gradients did go through int8


def test_checkpoint_restores_the_copy_per_host_and_moves_between_plans(tmp_path):
    """The within-host copy is not saved: restoring onto an hpZ state rebuilds it from the
    master (a copy per host, as the step left it), and the same checkpoint restores onto
    plain stage 3, whose weights are the same bf16 values."""
    _, state = _trained(hierarchical=True, hosts=2)
    zf.save_checkpoint(tmp_path / "ckpt", state)
    prec, tx = zf.Precision(params="bf16"), optax.adam(3e-3)
    for options in ({"hierarchical": True, "hosts": 2}, {}):
        plan = zf.ZeroPlan(zf.make_mesh(), stage=3, **options)
        like = zf.init_train_state(_params_with_padding(), tx, plan, prec)
        back = zf.restore_checkpoint(tmp_path / "ckpt", like=like)
        for k in state.master:
            want = state.compute[k] if options else state.params[k]
            got = back.compute[k] if options else back.params[k]
            np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))


# --- the 2 x 8 H100 target ---------------------------------------------------------------

@pytest.fixture(scope="module")
def hpz_on_two_hosts():
    return _stage3_on_two_hosts(hierarchical=True, quantize_grads="int8")


def test_hpz_gathers_stay_in_the_host_and_qgz_sends_int8_sums_across(hpz_on_two_hosts):
    """With hpZ and qgZ on 2 x 8 H100s: the only all-gathers that cross hosts are the copy's
    refresh after the update (each device gathers its 1/8 piece from its peer on the other host:
    1/16 of the bf16 weights, where plain stage 3's forward and backward gathers move 8/16 of
    them twice); the gradients leave as all-to-alls, none as a reduce-scatter, and across hosts
    each device sends one int8 slice of host sums with its scales: transit_bytes of 1/16 of
    each weight (plain stage 3: 8/16 of the fp32 gradient)."""
    colls = hpz_on_two_hosts
    moved = zf.memory.traffic(colls)
    assert moved["all-gather"]["cross_host"] == 2 * (W + V) // 16
    assert moved["collective-permute"]["cross_host"] == 2 * (W + V) // 16
    gathers_in_host = [c for c in colls if c.kind == "all-gather" and c.cross_host == 0]
    assert sum(c.within_host for c in gathers_in_host) > 0
    assert moved["reduce-scatter"]["count"] == 0
    assert moved["all-to-all"]["cross_host"] == (zeropp.transit_bytes((W // 16,), 256)
                                                 + zeropp.transit_bytes((V // 16,), 256))


@pytest.mark.parametrize("options, message", [
    ({"stage": 3, "hierarchical": True}, "hierarchical=True needs a data axis spanning two or more"),
    ({"stage": 2, "hierarchical": True, "hosts": 2}, "hierarchical=True keeps a within-host copy of stage-3 weights; stage is 2"),
    ({"stage": 3, "hierarchical": True, "hosts": 2, "offload": "optimizer"},
     "does not combine with offload='optimizer'"),
    ({"stage": 3, "hierarchical": 1, "hosts": 2}, "hierarchical must be a bool"),
    ({"stage": 1, "quantize_grads": "int8"}, "quantize_grads='int8' quantizes the reduction of gathered stage-3"),
    ({"stage": 3, "quantize_grads": "int4"}, "unknown quantize_grads 'int4'"),
    ({"stage": 3, "quantize_grads": "int8", "hosts": 3}, "hosts must be a positive int dividing"),
    ({"stage": 2, "quantize_weights": "int8"}, "quantize_weights='int8' quantizes stage-3 weight gathers; stage is 2"),
    ({"stage": 3, "quantize_weights": "int4"}, "unknown quantize_weights 'int4'"),
    ({"stage": 3, "quantize_weights": "int8", "quantize_block": 0}, "quantize_block must be"),
])
def test_bad_zeropp_plans_are_one_line_errors(options, message):
    with pytest.raises(ValueError, match=message) as e:
        zf.ZeroPlan(zf.make_mesh(), **options)
    assert "\n" not in str(e.value)


def test_hpz_without_a_bf16_copy_is_a_one_line_error():
    plan = zf.ZeroPlan(zf.make_mesh(), stage=3, hierarchical=True, hosts=2)
    with pytest.raises(ValueError, match="Precision.params is fp32, which keeps none") as e:
        zf.init_train_state(_mlp_params(), optax.sgd(0.1), plan, zf.Precision())
    assert "\n" not in str(e.value)


def test_the_state_and_the_formula_count_the_copy_per_host():
    """hpZ's copy, 2 bytes per entry of the stored (padded) weights over L=4 devices, where
    plain stage 3 keeps none: the state's device bytes (``zf.memory.state_bytes``, what a
    plan's peak is built on) grow by exactly that, and hierarchical_copy_bytes gives it for
    the unpadded parameter count."""
    params = _params_with_padding()
    tx, prec = optax.adam(1e-3), zf.Precision(params="bf16")

    def states(**options):
        plan = zf.ZeroPlan(zf.make_mesh(), stage=3, **options)
        return zf.memory.state_bytes(zf.init_train_state(params, tx, plan, prec))["device"]
    stored = 64 * 48 + 48 * 8 + 16  # the bias stored padded to 16
    assert states(hierarchical=True, hosts=2) - states() == 2 * stored / 4
    own = 64 * 48 + 48 * 8 + 10
    assert zf.memory.hierarchical_copy_bytes(num_params=own, num_devices=8, hosts=2) == 2 * own / 4


def test_trainer_keys_reach_the_plan_and_bad_combinations_are_one_line():
    from zeroflow.config.io import ConfigError, load_config
    from zeroflow.trainer.setup import build_run
    on = ["parallel.zero_stage=3", "precision.params=bf16", "parallel.hierarchical=true",
          "parallel.quantize_grads=int8", "parallel.hosts=2"]
    plan = build_run(load_config("configs/tiny.yaml", on), with_data=False).plan
    assert (plan.hierarchical, plan.quantize_grads, plan.host_split) == (True, "int8", (2, 4))
    for overrides, message in [
            (["parallel.zero_stage=2", "parallel.quantize_grads=int8"],
             "parallel.quantize_grads=int8 quantizes the reduction of gathered stage-3"),
            (["parallel.zero_stage=2", "parallel.hierarchical=true", "precision.params=bf16"],
             "parallel.hierarchical=true keeps a within-host copy of stage-3 weights"),
            (["parallel.zero_stage=3", "parallel.hierarchical=true"], "precision.params is fp32"),
            (["parallel.quantize_grads=int4", "parallel.zero_stage=3"],
             "parallel.quantize_grads must be one of none, int8")]:
        with pytest.raises(ConfigError, match=message) as e:
            load_config("configs/tiny.yaml", overrides)
        assert "\n" not in str(e.value)
    one_host = load_config("configs/tiny.yaml", on[:3])
    with pytest.raises(ValueError, match="needs a data axis spanning two or more hosts"):
        build_run(one_host, with_data=False)
