"""Frozen weights (``trainable=``): the engine against a hand-written loop of plain optax on the
trainable leaves alone, the step's jaxpr, the state's bytes, checkpoints and bad input."""
import functools
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import zeroflow as zf
from fixtures import BATCHES, init_params, loss_fn, make_tx
from helpers import assert_leaves_close, assert_leaves_equal, bytes_on, walk, require_cuda_plugin
from zeroflow.engine.checkpoint import CheckpointError
from zeroflow.engine.grads.routes import Reduce, is_route, step_routes
from zeroflow.util.tree import path_str

pytestmark = pytest.mark.fast


N_DEV = 8

# The middle layer's kernel is frozen (gradients flow through it to Dense_0) and so is the last
# bias, (10,): stored padded to 16 at stage 3. The rest trains.
FROZEN = {("Dense_1", "kernel"), ("Dense_2", "bias")}
MASK = {layer: {name: (layer, name) not in FROZEN for name in ("kernel", "bias")}
        for layer in ("Dense_0", "Dense_1", "Dense_2")}


def frozen_by_path(path, _leaf):
    return path not in ("Dense_1/kernel", "Dense_2/bias")


def reference_run(params, batches, tx, dtype):
    """The hand-written loop: plain optax on a dict of the trainable leaves alone (fp32), the
    frozen leaves fixed at ``dtype(original)``, the loss reading every weight in ``dtype``."""
    train = {k: {n: v for n, v in layer.items() if (k, n) not in FROZEN} for k, layer in params.items()}
    fixed = {k: {n: v.astype(dtype) for n, v in layer.items() if (k, n) in FROZEN}
             for k, layer in params.items()}

    def loss_of(train, batch):
        whole = {k: {**fixed[k], **{n: v.astype(dtype) for n, v in train[k].items()}} for k in params}
        return loss_fn(whole, batch)[0]

    opt_state, losses = tx.init(train), []
    for batch in batches:
        loss, grads = jax.value_and_grad(loss_of)(train, batch)
        updates, opt_state = tx.update(grads, opt_state, train)
        train = optax.apply_updates(train, updates)
        losses.append(float(loss))
    return np.array(losses), train, fixed


@functools.cache
def reference(dtype):
    """``reference_run`` from the initial parameters over ``BATCHES``: one hand-written run per
    dtype, shared by the tests that compare against it (its arrays are immutable)."""
    return reference_run(init_params(), BATCHES, make_tx(), dtype)


def run(stage, prec, trainable, offload="none", batches=BATCHES, update_on="device", grad_accum=1):
    plan = zf.ZeroPlan(zf.make_mesh(), stage=stage, offload=offload, update_on=update_on)
    tx = make_tx()
    state = zf.init_train_state(init_params(), tx, plan, prec, trainable=trainable)
    step = zf.make_train_step(loss_fn, tx, plan, prec, grad_accum=grad_accum)
    losses = []
    for batch in batches:
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
    return np.array(losses), state


def trained_leaves(tree):
    """The trainable leaves of a tree of the parameters' structure, as the reference's dict."""
    return {k: {n: v for n, v in layer.items() if (k, n) not in FROZEN} for k, layer in tree.items()}


def frozen_leaves(tree):
    return {k: {n: v for n, v in layer.items() if (k, n) in FROZEN} for k, layer in tree.items()}


@pytest.mark.parametrize("stage,grad_accum", [(0, 1), (1, 1), (2, 1), (3, 1), (1, 2), (3, 2)])
def test_fp32_matches_optax_on_the_trainable_subset(stage, grad_accum):
    ref_losses, ref_train, ref_fixed = reference(jnp.float32)
    losses, state = run(stage, zf.Precision(), MASK, grad_accum=grad_accum)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5, atol=1e-6)
    assert_leaves_close(trained_leaves(state.master_params), ref_train, rtol=1e-5, atol=1e-6)
    assert_leaves_equal(frozen_leaves(state.params), ref_fixed)


def test_one_device_matches_optax_on_the_trainable_subset():
    """One device: the step runs without shard_map or collectives."""
    ref_losses, ref_train, ref_fixed = reference(jnp.bfloat16)
    plan = zf.ZeroPlan(zf.make_mesh(devices=jax.devices()[:1]), stage=0)
    prec, tx = zf.Precision(params="bf16"), make_tx()
    state = zf.init_train_state(init_params(), tx, plan, prec, trainable=MASK)
    step = zf.make_train_step(loss_fn, tx, plan, prec)
    losses = []
    for batch in BATCHES:
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
    np.testing.assert_allclose(losses, ref_losses, rtol=2e-2)
    assert_leaves_close(trained_leaves(state.master_params), ref_train, rtol=2e-2, atol=2e-3)
    assert_leaves_equal(frozen_leaves(state.params), ref_fixed)


@pytest.mark.parametrize("stage,offload,update_on", [
    (1, "none", "device"), (3, "none", "device"), (3, "optimizer+params", "device"),
    (1, "optimizer+params", "host")])
def test_bf16_matches_the_hand_written_loop_and_keeps_frozen_bits(stage, offload, update_on):
    ref_losses, ref_train, ref_fixed = reference(jnp.bfloat16)
    losses, state = run(stage, zf.Precision(params="bf16"), frozen_by_path, offload,
                        update_on=update_on)
    np.testing.assert_allclose(losses, ref_losses, rtol=2e-2)
    assert_leaves_close(trained_leaves(state.master_params), ref_train, rtol=2e-2, atol=2e-3)
    # Frozen weights are stored once, as bf16(original), and come back bit for bit.
    assert_leaves_equal(frozen_leaves(state.params), ref_fixed)
    assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(state.frozen))
    want_kind = "pinned_host" if offload == "optimizer+params" else "device"
    assert {x.sharding.memory_kind for x in jax.tree.leaves(state.frozen)} == {want_kind}


def _weight_grad_dots(stage, params, trainable):
    """dot_generals in the step's jaxpr whose result has Dense_1/kernel's shape (64, 64): in
    this MLP only a gradient of that kernel is such a product (activations have 4 rows)."""
    plan = zf.ZeroPlan(zf.make_mesh(), stage=stage)
    prec = zf.Precision(params=params)
    tx = make_tx()
    state = zf.init_train_state(init_params(), tx, plan, prec, trainable=trainable)
    jaxpr = zf.make_train_step(loss_fn, tx, plan, prec).trace(state, BATCHES[0]).jaxpr
    return sum(1 for e in walk(jaxpr) if e.primitive.name == "dot_general"
               and tuple(e.outvars[0].aval.shape) == (64, 64))


# bf16 weights are fetched on use on XLA:CPU (gather_on_use), fp32 ones below stage 3 are
# used as stored: both ways into the loss are checked.
@pytest.mark.parametrize("stage,params", [(0, "bf16"), (3, "bf16"), (0, "fp32"), (2, "fp32")])
def test_no_matmul_computes_a_frozen_weights_gradient(stage, params):
    assert _weight_grad_dots(stage, params, None) >= 1  # the check sees a gradient that exists
    assert _weight_grad_dots(stage, params, MASK) == 0


def _per_device(x, stage) -> int:
    """Elements of ``x`` one device stores: whole below stage 3, 1/N (rounded up: padding)
    at stage 3 (every leaf of this model splits along one dimension)."""
    return math.ceil(x.size / N_DEV) if stage == 3 else x.size


@pytest.mark.parametrize("stage", [0, 1, 3])
def test_state_bytes_hold_no_master_or_optimizer_state_for_frozen_leaves(stage):
    plan = zf.ZeroPlan(zf.make_mesh(), stage=stage)
    prec = zf.Precision(params="bf16")
    params = init_params()
    state = zf.init_train_state(params, optax.adam(1e-3), plan, prec, trainable=MASK)
    train, fixed = trained_leaves(params), frozen_leaves(params)
    stored = (lambda x: math.ceil(x.size / N_DEV)) if stage >= 1 else (lambda x: x.size)
    # fp32 master + Adam's two fp32 moments (1/N from stage 1), a bf16 compute copy below stage
    # 3 (at stage 3 the master's shards are cast as they are gathered) of the trainable leaves;
    # the frozen ones: bf16 only; Adam's int32 count.
    copy = (lambda x: 0) if stage == 3 else (lambda x: 2 * _per_device(x, stage))
    want = (sum(12 * stored(x) + copy(x) for x in jax.tree.leaves(train))
            + sum(2 * _per_device(x, stage) for x in jax.tree.leaves(fixed)) + 4)
    got = bytes_on(jax.devices()[0], (state.master, state.compute, state.opt_state, state.frozen))
    assert got == want
    assert len(jax.tree.leaves(state.master)) == len(jax.tree.leaves(train))
    assert len(jax.tree.leaves(state.opt_state)) == 2 * len(jax.tree.leaves(train)) + 1


def test_optimizer_sees_only_trainable_leaves():
    seen = {"init": [], "update": []}

    def paths(tree):
        return sorted(path_str(p) for p, _ in jax.tree_util.tree_leaves_with_path(tree))

    def init(params):
        seen["init"].append(paths(params))
        return optax.EmptyState()

    def update(updates, state, params=None):
        seen["update"].append(paths(updates))
        return updates, state

    tx = optax.GradientTransformation(init, update)
    plan = zf.ZeroPlan(zf.make_mesh(), stage=2)
    prec = zf.Precision()
    state = zf.init_train_state(init_params(), tx, plan, prec, trainable=frozen_by_path)
    zf.make_train_step(loss_fn, tx, plan, prec)(state, BATCHES[0])
    want = ["Dense_0/bias", "Dense_0/kernel", "Dense_1/bias", "Dense_2/kernel"]
    # init runs with the trainable leaves (optax's tree_map_params may add a call on an empty
    # dummy, to learn the state's shape); the update, traced, with their gradients only.
    inits = [s for s in seen["init"] if s]
    assert inits and all(s == want for s in inits), seen["init"]
    assert seen["update"] and all(s == want for s in seen["update"]), seen["update"]


def test_checkpoint_round_trip_across_stages(tmp_path):
    prec = zf.Precision(params="bf16")
    _, state = run(3, prec, MASK, batches=BATCHES[:1])
    zf.save_checkpoint(tmp_path / "ck", state)
    plan = zf.ZeroPlan(zf.make_mesh(), stage=1)
    like = zf.init_train_state(jax.tree.map(jnp.zeros_like, init_params()), make_tx(), plan, prec,
                               trainable=MASK)
    back = zf.restore_checkpoint(tmp_path / "ck", like)
    assert_leaves_equal(back.master_params, state.master_params)
    assert_leaves_equal(back.params, state.params)
    assert_leaves_equal(back.opt_state, state.opt_state)
    assert back.frozen["Dense_1"]["kernel"].sharding == like.frozen["Dense_1"]["kernel"].sharding


@pytest.mark.parametrize("target", ["other_split", "all_trainable"])
def test_checkpoint_with_another_split_is_one_clear_error(tmp_path, target):
    prec = zf.Precision()
    plan = zf.ZeroPlan(zf.make_mesh(), stage=1)
    state = zf.init_train_state(init_params(), make_tx(), plan, prec, trainable=MASK)
    zf.save_checkpoint(tmp_path / "ck", state)
    other = None if target == "all_trainable" else (lambda path, _: path != "Dense_0/kernel")
    like = zf.init_train_state(init_params(), make_tx(), plan, prec, trainable=other)
    with pytest.raises(CheckpointError, match="trainable") as info:
        zf.restore_checkpoint(tmp_path / "ck", like)
    assert "\n" not in str(info.value) and "Dense_1/kernel" in str(info.value)


@pytest.mark.parametrize("trainable,match", [
    ({"Dense_0": True}, "structure"),
    (jax.tree.map(lambda _: False, init_params()), "every parameter"),
    (lambda path, _: False, "every parameter"),
    (lambda path, _: "yes", "must return a bool"),
    (jax.tree.map(lambda _: 1, init_params()), "bools"),
])
def test_bad_trainable_is_one_readable_error(trainable, match):
    plan = zf.ZeroPlan(zf.make_mesh(), stage=1)
    with pytest.raises(ValueError, match=match) as info:
        zf.init_train_state(init_params(), make_tx(), plan, zf.Precision(), trainable=trainable)
    assert "\n" not in str(info.value)


def test_train_step_trainable_must_match_the_state():
    plan = zf.ZeroPlan(zf.make_mesh(), stage=1)
    prec = zf.Precision()
    state = zf.init_train_state(init_params(), make_tx(), plan, prec, trainable=MASK)
    step = zf.make_train_step(loss_fn, make_tx(), plan, prec, trainable=lambda p, _: True)
    with pytest.raises(ValueError, match="differs from the state"):
        step(state, BATCHES[0])


def test_each_leafs_layout_says_whether_it_trains():
    """The step reads the state's trainable/frozen split into each leaf's layout: ``trains``
    is False exactly at the two frozen leaves, each laid out from its own shape (the frozen
    (10,) bias, stored padded to 16 at stage 3, keeps its 10 entries and 6 of padding), and
    only the frozen leaves' routes reduce no gradient."""
    plan = zf.ZeroPlan(zf.make_mesh(), stage=3)
    prec, tx = zf.Precision(params="bf16"), make_tx()
    state = zf.init_train_state(init_params(), tx, plan, prec, trainable=frozen_by_path)
    assert state.frozen["Dense_2"]["bias"].shape == (16,)
    layouts = zf.make_train_step(loss_fn, tx, plan, prec).layout(state).layouts
    assert jax.tree.map(lambda lay: lay.trains, layouts) == MASK
    bias = layouts["Dense_2"]["bias"]
    assert (bias.shape, bias.zero_dim, bias.pad) == ((10,), 0, 6)
    routes = step_routes(layouts, plan, prec, None)
    assert jax.tree.map(lambda r: r.reduce is not Reduce.NONE, routes, is_leaf=is_route) == MASK


# --- frozen weights in XLA:CPU's compiled memory ---------------------------------------------

# Four hidden layers (three of the five Dense layers frozen, 200k parameters): the peak test
# bounds the saving per frozen parameter, so depth scales both sides of it (measured: the
# saving is 1.2-1.9 times the bound at 4 layers, 1.2-1.7 at 8), and each layer costs compile
# time in all eight compiled steps.
WIDTH, DEPTH, ROWS = 256, 4, 16


class Stack(nn.Module):
    """A plain stack of Dense layers (no scan): the backbone is frozen, the last two train."""

    @nn.compact
    def __call__(self, x):
        for _ in range(DEPTH):
            x = nn.relu(nn.Dense(WIDTH)(x))
        return nn.Dense(10)(x)


def _stack_setup():
    model = Stack()
    params = jax.eval_shape(lambda: model.init(jax.random.key(0), jnp.zeros((1, WIDTH)))["params"])

    def loss(p, b):
        logits = model.apply({"params": p}, b["x"].astype(jax.tree.leaves(p)[0].dtype))
        return optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32),
                                                               b["y"]).mean()
    batch = {"x": jax.ShapeDtypeStruct((ROWS, WIDTH), jnp.float32),
             "y": jax.ShapeDtypeStruct((ROWS,), jnp.int32)}
    return loss, params, batch


def backbone_frozen(path, _leaf):
    return path.split("/")[0] in (f"Dense_{DEPTH - 1}", f"Dense_{DEPTH}")


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_frozen_weights_lower_the_compiled_peak(stage):
    loss, params, batch = _stack_setup()
    tx, prec = optax.adam(1e-3), zf.Precision(params="bf16")
    plan = zf.ZeroPlan(zf.make_mesh(), stage=stage)
    _, measured = zf.memory.measure_step(loss, params, batch, tx, plan, prec,
                                         trainable=backbone_frozen)
    # The saving is real: at least the frozen leaves' fp32 master + Adam moments (12 bytes per
    # parameter, 1/N from stage 1), from the ZeRO paper's accounting.
    _, everything = zf.memory.measure_step(loss, params, batch, tx, plan, prec)
    frozen_params = sum(x.size for p, x in jax.tree_util.tree_leaves_with_path(params)
                        if not backbone_frozen(path_str(p), x))
    assert everything - measured >= 0.75 * 12 * frozen_params / (N_DEV if stage else 1)


# --- the trainer: train.freeze -----------------------------------------------------------------

def test_trainer_freezes_by_regex_at_stage3_with_layerwise_gathers(tmp_path, capsys):
    """The trainer's GPT (layers gathered one at a time at stage 3) with its embedding and
    attention frozen: they come out of the run bit for bit as they went in, the rest trains,
    the banner counts both, and export reads the frozen weights back."""
    from fixtures import TINY_TRAINER

    from zeroflow.cli import export
    from zeroflow.config.io import load_config
    from zeroflow.trainer import build_run, train
    from zeroflow.trainer.checkpoints import RunCheckpoints
    cfg = load_config("configs/tiny.yaml", TINY_TRAINER + [
        "data.max_bytes=400000", "train.steps=2", "train.eval_every=0", "parallel.zero_stage=3",
        "train.freeze=^embedding|layers/attn/", "precision.params=bf16", f"run.dir={tmp_path}"])
    train(cfg)
    banner = capsys.readouterr().out
    run = build_run(cfg)
    start = run.init_state().params
    checkpoints = RunCheckpoints(tmp_path / "checkpoints", 3, read_only=True)
    final, _ = checkpoints.read(run.abstract_state())
    checkpoints.close()
    end = final.params
    is_frozen = lambda path: path == "embedding" or path.startswith("layers/attn/")  # noqa: E731
    frozen = trained = 0
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(start), jax.tree.leaves(end)):
        path = path_str(path)
        if is_frozen(path):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
            frozen += a.size
        else:
            assert not np.array_equal(np.asarray(a), np.asarray(b)), path
            trained += a.size
    assert f"params: {trained:,} trained, {frozen:,} frozen" in banner
    out = tmp_path / "w.safetensors"
    assert export.main(["--run", str(tmp_path), "--out", str(out)]) == 0


@pytest.mark.parametrize("pattern,match", [("nothing_matches", "matches no parameter"),
                                           (".", "matches every parameter"),
                                           ("(", "regular expression")])
def test_trainer_freeze_bad_pattern_is_one_line(pattern, match):
    from fixtures import TINY_TRAINER

    from zeroflow.config.io import load_config
    from zeroflow.trainer import build_run
    with pytest.raises(ValueError, match=match) as info:
        build_run(load_config("configs/tiny.yaml", TINY_TRAINER + [f"train.freeze={pattern}"]),
                  with_data=False)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_analytic_estimate_counts_frozen_parameters_as_compute_bytes_only(stage):
    """``zf.memory.estimate(frozen_params=F)`` against the ZeRO paper's accounting (bf16, Adam:
    2 + 2 + 12 bytes per trainable parameter) with 2 bytes per frozen one, 1/N at stage 3."""
    p, f, n = 8e9, 6e9, 64
    t = p - f
    want = {0: 16 * t + 2 * f, 1: 4 * t + 12 * t / n + 2 * f, 2: 2 * t + 14 * t / n + 2 * f,
            3: 16 * t / n + 2 * f / n}[stage]
    got = zf.memory.estimate(num_params=int(p), frozen_params=int(f), num_devices=n, stage=stage)
    assert got.device.total == pytest.approx(want)
    offloaded = zf.memory.estimate(num_params=int(p), frozen_params=int(f), num_devices=n,
                                   stage=stage, offload="optimizer+params", devices_per_process=1)
    assert offloaded.host.compute_weights == pytest.approx(2 * p / (n if stage == 3 else 1))
    with pytest.raises(ValueError, match="frozen_params"):
        zf.memory.estimate(num_params=10, frozen_params=11, num_devices=n, stage=stage)


@pytest.mark.parametrize("stage", [2, 3])
def test_xla_gpu_peak_drops_by_the_frozen_model_states(stage):
    """Compiled by XLA:GPU for 8 abstract H100s (docs/gpu_compile.md): freezing all but the
    head and the last layer of test_gpu_compile's plain-JAX model, at 4 layers (the embedding
    and three layers, 67% of its parameters), lowers the peak by at least 3/4 of what the ZeRO
    accounting says the frozen parameters stop costing: (2 + 2 + 12) bytes each -> 2 (stage 2:
    (2 + 14/N) -> 2; stage 3: 16/N -> 2/N). Four layers compile in half the time of sixteen
    and free as much per frozen parameter."""
    require_cuda_plugin()
    from test_gpu_compile import BATCH as GPU_BATCH, N, _params, loss_fn as gpu_loss
    layers = 4
    params = _params(layers=layers)
    head_and_last = lambda path, _: path in ("head", f"up{layers - 1}", f"down{layers - 1}")  # noqa: E731
    plan = zf.ZeroPlan(zf.target_mesh("h100", data=N), stage=stage)
    peaks = [zf.memory.measure_step(gpu_loss, params, GPU_BATCH, optax.adamw(1e-3), plan,
                                    zf.Precision(params="bf16"), trainable=t)[1]
             for t in (None, head_and_last)]
    frozen = sum(x.size for p, x in jax.tree_util.tree_leaves_with_path(params)
                 if not head_and_last(path_str(p), x))
    saved = frozen * ((2 + 14 / N - 2) if stage == 2 else (16 / N - 2 / N))
    assert peaks[0] - peaks[1] >= 0.75 * saved, (peaks, saved)
