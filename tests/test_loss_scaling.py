"""Loss-scaling bookkeeping: skipped steps, optax's count and the schedule, consecutive skips,
static scales across checkpoints, and Precision's validation."""
import json
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import optax
import pytest

import zeroflow as zf
from zeroflow.config.io import load_config
from zeroflow.trainer import TrainingDiverged, train
from zeroflow.trainer.optim import lr_schedule
from fixtures import TINY_TRAINER, linear_loss

pytestmark = pytest.mark.fast

REPO = Path(__file__).resolve().parents[1]
SHRUNK = TINY_TRAINER + ["data.max_bytes=200000", "train.eval_every=0"]


def run_steps(loss, prec, tx, steps, state=None):
    plan = zf.ZeroPlan(zf.make_mesh(), stage=2)
    if state is None:
        state = zf.init_train_state({"w": jnp.ones((64,), jnp.float32)}, tx, plan, prec)
    step = zf.make_train_step(loss, tx, plan, prec)
    metrics = []
    for _ in range(steps):
        state, m = step(state, {"x": np.ones((16, 64), np.float32)})
        metrics.append({k: float(v) for k, v in m.items()})
    return state, metrics


def test_skipped_steps_do_not_advance_the_schedule():
    # Gradient 10 per element; fp16 holds 10 * 2**12 but not 10 * 2**13 and up, so the first
    # three steps (scales 2**15, 2**14, 2**13) overflow and are skipped.
    schedule = lambda count: 0.1 * (count + 1)  # noqa: E731
    tx = optax.sgd(schedule)
    prec = zf.Precision(params="fp16", loss_scale="dynamic", growth_interval=1000)
    state, ms = run_steps(linear_loss(10.0), prec, tx, steps=6)
    assert [m["skipped"] for m in ms] == [1, 1, 1, 0, 0, 0]
    assert [m["consecutive_skips"] for m in ms] == [1, 2, 3, 0, 0, 0]
    assert [m["applied"] for m in ms] == [0, 0, 0, 1, 2, 3]
    assert int(state.step) == 6 and int(state.applied) == 3
    assert int(state.opt_state[1].count) == 3  # optax's own count (ScaleByScheduleState)
    # The three updates used schedule(0), (1), (2): w = 1 - 10 * (0.1 + 0.2 + 0.3). Had the
    # schedule read the step count (3, 4, 5) it would be 1 - 10 * (0.4 + 0.5 + 0.6).
    np.testing.assert_allclose(np.asarray(state.master["w"]), 1 - 10 * (0.1 + 0.2 + 0.3), rtol=1e-6)


def test_non_finite_gradient_without_loss_scaling_is_reported_and_skipped():
    def loss(params, batch):  # finite loss (0 at w = 1), infinite gradient of sqrt at 0
        return jnp.sum(jnp.sqrt(params["w"] - 1.0)) * batch["x"].mean()
    state, [m] = run_steps(loss, zf.Precision(), optax.sgd(0.1), steps=1)
    assert m["loss"] == 0.0 and m["skipped"] == 1 and m["consecutive_skips"] == 1
    assert int(state.applied) == 0 and int(state.step) == 1
    np.testing.assert_array_equal(np.asarray(state.master["w"]), 1.0)


def test_restoring_with_another_static_scale_uses_the_configured_one(tmp_path):
    tx = optax.sgd(0.1)
    state, _ = run_steps(linear_loss(1.0), zf.Precision(params="fp16", loss_scale=128.0), tx, steps=1)
    zf.save_checkpoint(tmp_path / "static", state)
    plan = zf.ZeroPlan(zf.make_mesh(), stage=2)
    prec = zf.Precision(params="fp16", loss_scale=256.0)
    like = zf.init_train_state({"w": jnp.ones((64,), jnp.float32)}, tx, plan, prec)
    restored = zf.restore_checkpoint(tmp_path / "static", like)
    assert float(restored.loss_scale.scale) == 256.0
    _, [m] = run_steps(linear_loss(1.0), prec, tx, steps=1, state=restored)
    assert m["loss_scale"] == 256.0

    # A dynamic scale is the run's own state: it is restored as saved.
    dyn = zf.Precision(params="fp16", loss_scale="dynamic")
    state, _ = run_steps(linear_loss(10.0), dyn, tx, steps=2)  # two overflows: 2**15 -> 2**13
    zf.save_checkpoint(tmp_path / "dynamic", state)
    like = zf.init_train_state({"w": jnp.ones((64,), jnp.float32)}, tx, plan, dyn)
    restored = zf.restore_checkpoint(tmp_path / "dynamic", like)
    assert float(restored.loss_scale.scale) == 2.0 ** 13
    assert int(restored.loss_scale.skips) == 2 and int(restored.applied) == 0
    # And into a run without loss scaling: the saved scale is read and dropped.
    like = zf.init_train_state({"w": jnp.ones((64,), jnp.float32)}, tx, plan, zf.Precision())
    restored = zf.restore_checkpoint(tmp_path / "dynamic", like)
    assert restored.loss_scale is None and int(restored.step) == 2


@pytest.mark.parametrize("kwargs,needle", [
    (dict(growth_interval="10"), "growth_interval must be a positive int, got '10'"),
    (dict(growth_interval=0), "growth_interval must be a positive int, got 0"),
    (dict(init_scale=-1), "init_scale must be a positive finite number, got -1"),
    (dict(min_scale=0), "min_scale must be a positive finite number, got 0"),
    (dict(min_scale=2.0 ** 16), "min_scale (65536) must not exceed init_scale (32768)"),
    (dict(loss_scale=float("inf")), "a static loss_scale must be a positive finite number, got inf"),
    (dict(loss_scale="nan"), "a static loss_scale must be a positive finite number, got nan"),
    (dict(loss_scale=True), "loss_scale must be 'none', 'dynamic' or a positive number, got True"),
    (dict(max_consecutive_skips=0), "max_consecutive_skips must be a positive int, got 0"),
    (dict(params=["bf16"]), "unknown params dtype ['bf16']"),
])
def test_every_precision_field_is_validated_in_one_line(kwargs, needle):
    with pytest.raises(ValueError) as err:
        zf.Precision(**kwargs)
    assert needle in str(err.value) and "\n" not in str(err.value)


# ----------------------------------------------------------------------------- the trainer
def _cfg(tmp_path, *extra):
    return load_config(REPO / "configs/tiny.yaml", SHRUNK + [f"run.dir={tmp_path}", *extra])


def test_trainer_logs_the_rate_optax_applied_after_skipped_steps(tmp_path):
    # A start scale so large that even fp32's range overflows (the GPT cannot run fp16 matmuls
    # on XLA:CPU, so bf16 compute with its fp32 exponent range): the first steps are skipped
    # while the scale halves down. The logged lr of each step must be the schedule at the number
    # of updates applied before it (optax's count), and the checkpoint must agree.
    cfg = _cfg(tmp_path, "train.steps=12", "train.warmup_steps=4", "precision.params=bf16",
               "precision.loss_scale=dynamic", "precision.init_scale=1e38")
    result = train(cfg)
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "lr" in r]
    skipped = [int(r["skipped"]) for r in rows]
    assert 0 < sum(skipped) < len(rows)  # some skipped, then it trained
    schedule = lr_schedule(cfg.train)
    applied_before = np.cumsum([0] + [1 - s for s in skipped])[:-1]
    np.testing.assert_allclose([r["lr"] for r in rows], [float(schedule(c)) for c in applied_before],
                               rtol=1e-6)
    from zeroflow.trainer import build_run
    from zeroflow.trainer.checkpoints import RunCheckpoints
    state, _ = RunCheckpoints(tmp_path / "checkpoints", 3).restore_latest(build_run(cfg).init_state())
    count = int(state.opt_state[1][-1].count)  # what adamw's schedule reads (ScaleByScheduleState)
    assert int(state.applied) == count == len(rows) - sum(skipped)
    assert result.step == int(state.step) == 12


def test_trainer_stops_when_the_minimum_scale_still_overflows(tmp_path):
    cfg = _cfg(tmp_path, "train.steps=10", "precision.params=bf16", "precision.loss_scale=dynamic",
               "precision.init_scale=1e38", "precision.min_scale=1e38",
               "precision.max_consecutive_skips=3", "train.on_divergence=stop")
    with pytest.raises(TrainingDiverged, match=r"step 3: 3 steps in a row skipped for non-finite "
                                               r"gradients .* loss scale is 1e\+38"):
        train(cfg)
