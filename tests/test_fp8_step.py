"""Delayed FP8 scaling in the ZeRO train step (``Precision(autocast="fp8",
fp8_scaling="delayed")``), on the 8 emulated devices, against a hand-written single-device
loop: the FP8 forward and backward of a two-matmul model written out in NumPy with the
recipe's scales (``fp8_reference.NpTensor``) over the whole global batch, plain optax for the
update. The step's amax histories must be those of the *global* batch (each device sees its
own rows: the max over devices and micro-batches), the gradient's those of the loss-scaled
gradient the backward pass casts, and a skipped step must keep the old state."""
import contextlib
import dataclasses
import io
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import zeroflow as zf
from zeroflow.config.io import load_config
from zeroflow.trainer import build_run, train
from zeroflow.trainer.checkpoints import RunCheckpoints
from fixtures import TINY_TRAINER
from fp8_reference import E4M3, E5M2, NpTensor, check_meta, np_bf16

pytestmark = pytest.mark.fast

N_DEV, ROWS, D_IN, D_HID, D_OUT = 8, 16, 32, 64, 32
HISTORY, MARGIN = 3, 1
LR = 0.05


def two_matmuls(params, batch):
    """Mean over rows of ``sum(o * c)``, ``o = (x @ w1) @ w2``: the gradient reaching the
    second matmul is ``c / rows``, known exactly."""
    o = (batch["x"] @ params["w1"]) @ params["w2"]
    return jnp.mean(jnp.sum(o * batch["c"], axis=-1))


def init_params():
    rng = np.random.default_rng(0)
    return {"w1": rng.normal(size=(D_IN, D_HID)).astype(np.float32) * 0.2,
            "w2": rng.normal(size=(D_HID, D_OUT)).astype(np.float32) * 0.2}


def batches(count, rows):
    """Batches whose rows differ in size from device to device (so the per-device amaxes
    differ, and only their max is the global batch's); one multiplier per step."""
    rng = np.random.default_rng(1)
    out = []
    for k in range(count):
        loud = np.repeat(rng.uniform(0.5, 4.0, size=(N_DEV * 2, 1)), rows // (N_DEV * 2), 0)
        x = (rng.normal(size=(rows, D_IN)) * loud).astype(np.float32)
        c = (rng.normal(size=(rows, D_OUT)) * (1 + k)).astype(np.float32)
        out.append({"x": x, "c": c})
    return out


def gemm(a, b, scale_a, scale_b):
    """An FP8 GEMM with a bf16 result: fp32 accumulation times the product of the two (fp32)
    scales, rounded to bf16 once (as a GEMM's epilogue does it; XLA folds the op's
    intermediate bf16 rounding of the accumulator into the one after the scaling)."""
    acc = a.astype(np.float32) @ b.astype(np.float32)
    return np_bf16(acc * (np.float32(scale_a) * np.float32(scale_b)))


class Reference:
    """The step written out: per site (0: ``x @ w1``, 1: ``h @ w2``) the lhs, rhs and incoming
    gradient scaled from their histories; bf16 operands (autocast's). Every shard (a device's
    micro-batch of ``shard_rows`` rows) has its mean as its loss, so the gradient each cast
    sees is ``c / shard_rows`` times the loss scale; each shard's weight gradient is a bf16
    GEMM of its rows, and the update gets their fp32 sum divided by the shard count and the
    loss scale (plain optax)."""

    def __init__(self, shard_rows, shards, loss_scale=1.0):
        self.shard_rows, self.shards, self.loss_scale = shard_rows, shards, loss_scale
        self.t = {(site, name): NpTensor(fmt, HISTORY, MARGIN) for site in (0, 1)
                  for name, fmt in (("lhs", E4M3), ("rhs", E4M3), ("grad", E5M2))}
        self.tx = optax.sgd(LR)
        self.params = init_params()
        self.opt_state = self.tx.init(self.params)

    def weight_grad(self, lhs, g, *scales):
        r = self.shard_rows
        parts = [gemm(lhs[i:i + r].T, g[i:i + r], *scales) for i in range(0, len(lhs), r)]
        return np.sum(parts, axis=0, dtype=np.float32) / np.float32(self.shards * self.loss_scale)

    def step(self, batch):
        t, p = self.t, self.params
        qx, sx = t[0, "lhs"].cast(np_bf16(batch["x"]))
        qw1, sw1 = t[0, "rhs"].cast(np_bf16(p["w1"]))
        h = gemm(qx, qw1, sx, sw1)
        qh, sh = t[1, "lhs"].cast(h)
        qw2, sw2 = t[1, "rhs"].cast(np_bf16(p["w2"]))
        o = gemm(qh, qw2, sh, sw2)
        loss = float(np.sum(o * batch["c"]) / len(o))
        self.loss_size = float(np.sum(np.abs(o * batch["c"])) / len(o))  # its terms' size
        qg2, sg2 = t[1, "grad"].cast(np_bf16(batch["c"] * (self.loss_scale / self.shard_rows)))
        qg1, sg1 = t[0, "grad"].cast(gemm(qg2, qw2.T, sg2, sw2))
        grads = {"w1": self.weight_grad(qx, qg1, sg1, sx),
                 "w2": self.weight_grad(qh, qg2, sg2, sh)}
        updates, self.opt_state = self.tx.update(grads, self.opt_state, self.params)
        self.params = optax.apply_updates(self.params, updates)
        return loss


def check_state(fp8, ref: Reference):
    """Every site's three tensors against the reference. The input ``x`` and the first
    step's weights are cast exactly as the reference casts them; the computed activations
    and gradients (bf16 GEMM results, summed in another order) and later weights (updated
    from such gradients) within two bf16 ulps."""
    assert sorted(fp8) == ["dot_0", "dot_1"]
    approx = 2 * 2.0**-7
    for site, key in enumerate(sorted(fp8)):
        for name in ("lhs", "rhs", "grad"):
            exact = (site, name) == (0, "lhs")
            check_meta(getattr(fp8[key], name), ref.t[site, name], rtol=None if exact else approx)


@pytest.mark.parametrize("stage,accum,loss_scale", [(1, 1, "none"), (3, 2, 256.0)])
def test_the_step_keeps_the_global_batch_amax_history_as_the_hand_written_loop(
        stage, accum, loss_scale):
    """Four steps (history 3: the window wraps), stage 1 and stage 3 (weights gathered on use,
    two micro-batches, a static loss scale), every tensor's scale and history after each step
    as the reference's, the loss and the weights within a stated tolerance."""
    rows = N_DEV * accum * ROWS
    plan = zf.ZeroPlan(zf.make_mesh(), stage=stage)
    prec = zf.Precision(autocast="fp8", fp8_scaling="delayed", fp8_select="all",
                        fp8_history=HISTORY, fp8_margin=MARGIN, loss_scale=loss_scale)
    tx = optax.sgd(LR)
    state = zf.init_train_state(init_params(), tx, plan, prec)
    assert state.fp8 is None  # made by the step, which knows its matmuls
    step = zf.make_train_step(two_matmuls, tx, plan, prec, grad_accum=accum)
    ref = Reference(ROWS, N_DEV * accum, 1.0 if loss_scale == "none" else loss_scale)
    for batch in batches(4, rows):
        state, metrics = step(state, batch)
        want = ref.step(batch)
        # a sum of terms of both signs: within 0.5% of the size of its terms
        assert abs(float(metrics["loss"]) - want) < 5e-3 * ref.loss_size
        check_state(state.fp8, ref)
        # The weights: within 3% (in norm) of how far the reference's have moved. Not closer:
        # an FP8 cast turns a one-ulp difference of the fp32 accumulation order into a whole
        # e4m3/e5m2 step now and then (12-25% of that element), and four steps compound it
        # (measured: 0 after the first step, 0.3%, 0.7%, 1.3% after the next three).
        for name, w in state.master_params.items():
            moved = np.linalg.norm(ref.params[name] - init_params()[name])
            assert np.linalg.norm(np.asarray(w) - ref.params[name]) < 0.03 * moved, name
    for site in state.fp8.values():  # the state is replicated, outside the optimizer's
        assert site.lhs.history.sharding.is_fully_replicated
    assert "fp8" not in str(jax.tree.structure(state.opt_state))


def test_a_skipped_step_keeps_the_old_fp8_state():
    """Dynamic loss scaling: a NaN in the batch makes the gradient non-finite, the step is
    skipped, and the amax histories and scales stay as the step before left them (not NaN);
    the next clean step goes on from them."""
    plan = zf.ZeroPlan(zf.make_mesh(), stage=2)
    prec = zf.Precision(autocast="fp8", fp8_scaling="delayed", fp8_select="all",
                        fp8_history=HISTORY, loss_scale="dynamic")
    tx = optax.sgd(LR)
    state = zf.init_train_state(init_params(), tx, plan, prec)
    step = zf.make_train_step(two_matmuls, tx, plan, prec)
    clean, later = batches(2, N_DEV * ROWS)
    state, m = step(state, clean)
    assert int(m["skipped"]) == 0
    before = jax.tree.map(np.asarray, state.fp8)
    poisoned = dict(clean, x=clean["x"].copy())
    poisoned["x"][3, 5] = np.nan
    state, m = step(state, poisoned)
    assert int(m["skipped"]) == 1
    for a, b in zip(jax.tree.leaves(state.fp8), jax.tree.leaves(before)):
        np.testing.assert_array_equal(np.asarray(a), b)
    state, m = step(state, later)
    assert int(m["skipped"]) == 0
    x_history = np.asarray(state.fp8["dot_0"].lhs.history)
    assert np.max(np.abs(np_bf16(later["x"]))) in x_history  # recorded after the skipped one
    assert np.all(np.isfinite(x_history))


def test_a_checkpoint_with_other_matmul_sites_restores_the_weights_and_starts_the_histories_afresh(
        tmp_path, caplog):
    """Amax histories are keyed by the traced step's matmul sites: a checkpoint of a step
    traced another way (here: the same weights, one matmul reading w1 @ w2 folded first, so
    one site instead of two) restores its weights and optimizer state, and its histories are
    replaced by a first step's (scale 1, empty history), said in a warning."""
    plan = zf.ZeroPlan(zf.make_mesh(), stage=1)
    prec = zf.Precision(autocast="fp8", fp8_scaling="delayed", fp8_select="all",
                        fp8_history=HISTORY)
    tx = optax.adam(LR)
    saved = zf.init_train_state(init_params(), tx, plan, prec)
    saved, _ = zf.make_train_step(two_matmuls, tx, plan, prec)(saved, batches(1, N_DEV * ROWS)[0])
    zf.save_checkpoint(tmp_path / "ck", saved)

    def folded(params, batch):  # the same function of the weights, traced with other sites
        w = jax.lax.stop_gradient(params["w1"]) @ params["w2"]
        return jnp.mean(jnp.sum((batch["x"] @ w + 0 * params["w1"].sum()) * batch["c"], -1))

    like = zf.init_train_state(init_params(), tx, plan, prec)
    like, _ = zf.make_train_step(folded, tx, plan, prec)(like, batches(1, N_DEV * ROWS)[0])
    assert sorted(like.fp8) != sorted(saved.fp8) or jax.tree.map(
        np.shape, like.fp8) != jax.tree.map(np.shape, saved.fp8)
    with caplog.at_level("WARNING"):
        back = zf.restore_checkpoint(tmp_path / "ck", like)
    assert "other matmul sites" in caplog.text
    for name, w in saved.master_params.items():
        np.testing.assert_array_equal(np.asarray(back.master_params[name]), np.asarray(w))
    for a, b in zip(jax.tree.leaves(back.opt_state), jax.tree.leaves(saved.opt_state)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    for site in back.fp8.values():
        for meta in (site.lhs, site.rhs, site.grad):
            assert np.all(np.asarray(meta.scale) == 1.0)
            assert not np.any(np.asarray(meta.history))


def test_a_checkpoint_with_another_history_length_restores_with_fresh_histories(tmp_path):
    """The same sites with a longer ``fp8_history``: the weights come back, the histories start
    afresh in the new length."""
    plan = zf.ZeroPlan(zf.make_mesh(), stage=1)
    tx = optax.sgd(LR)
    batch = batches(1, N_DEV * ROWS)[0]

    def trained(history):
        prec = zf.Precision(autocast="fp8", fp8_scaling="delayed", fp8_select="all",
                            fp8_history=history)
        state = zf.init_train_state(init_params(), tx, plan, prec)
        return zf.make_train_step(two_matmuls, tx, plan, prec)(state, batch)[0]

    saved = trained(HISTORY)
    zf.save_checkpoint(tmp_path / "ck", saved)
    back = zf.restore_checkpoint(tmp_path / "ck", trained(HISTORY + 2))
    for name, w in saved.master_params.items():
        np.testing.assert_array_equal(np.asarray(back.master_params[name]), np.asarray(w))
    for site in back.fp8.values():
        assert np.shape(site.lhs.history)[-1] == HISTORY + 2
        assert not np.any(np.asarray(site.lhs.history))


# --------------------------------------------------------------------------- the trainer
SHRUNK = TINY_TRAINER + ["data.max_bytes=200000", "train.eval_every=0"]
FP8_DELAYED = ["precision.autocast=fp8", "precision.fp8_scaling=delayed",
               "precision.fp8_select=all", "precision.fp8_history=4"]


def _saved(cfg, step):
    """The state the run saved at ``step``, read as the trainer reads it (its abstract state
    as the target)."""
    run = build_run(cfg, with_data=False)
    checkpoints = RunCheckpoints(cfg.run.dir + "/checkpoints", 3, read_only=True)
    state, _ = checkpoints.read(run.abstract_state(), step)
    checkpoints.close()
    return state


def test_a_trainer_run_resumed_from_a_checkpoint_steps_as_the_uninterrupted_one(tmp_path):
    """The tiny GPT at stage 3 (layers gathered one at a time) with delayed scaling, 4 steps,
    a checkpoint every 2: resumed from step 2 it makes steps 3 and 4 bit for bit as the run
    that went on, because the amax histories were saved and restored with the rest."""
    overrides = SHRUNK + FP8_DELAYED + ["parallel.zero_stage=3", "train.steps=4",
                                        "checkpoint.every=2", f"run.dir={tmp_path / 'run'}"]
    cfg = load_config(None, overrides)
    straight = train(cfg)
    at_2 = _saved(cfg, 2).fp8
    assert at_2 and all(np.asarray(m.lhs.history).max() > 0 for m in at_2.values())
    copy = tmp_path / "copy"
    shutil.copytree(tmp_path / "run", copy)
    shutil.rmtree(copy / "checkpoints" / "4")
    resumed_cfg = dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, dir=str(copy)))
    shown = io.StringIO()
    with contextlib.redirect_stdout(shown):
        resumed = train(resumed_cfg)
    assert "resumed from step 2" in shown.getvalue()
    assert [resumed.losses[k] for k in (3, 4)] == [straight.losses[k] for k in (3, 4)]
    want, got = _saved(cfg, 4), _saved(resumed_cfg, 4)
    for part in ("fp8", "master", "opt_state"):
        for a, b in zip(jax.tree.leaves(getattr(got, part)), jax.tree.leaves(getattr(want, part))):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=part)
