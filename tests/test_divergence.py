"""Divergence recovery: a run made to diverge on purpose (a learning-rate spike at a known update,
tests/spike.py) rolls back to its newest healthy checkpoint, skips the batches that led there and
finishes; with train.on_divergence=stop it names that checkpoint, never the poisoned one; a run
killed with kill -9 in the middle of its recovery ends where the uninterrupted one ends."""
import json
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest

from zeroflow.config.io import ConfigError, load_config
from zeroflow.trainer import Run, TrainingDiverged, build_run, loop, optim, train
from zeroflow.trainer.checkpoints import RunCheckpoints
from zeroflow.trainer.divergence import MIN_HISTORY, Health, diagnose, rollback_target
from zeroflow.trainer.reporting import trim_metrics
from zeroflow.autocast.precision import Precision
from zeroflow.config.schema import TrainConfig
from fixtures import TINY_TRAINER
from spike import spiked
from helpers import one_cpu_env

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
# No plot.png: drawing it costs about a second of CPU per run and a matplotlib import per
# process, and no test here reads it.
SMALL = TINY_TRAINER + ["data.max_bytes=100000", "train.warmup_steps=2", "train.eval_every=0",
                        "run.plot=false"]
# The spike: the update after 5 applied ones (step 6) at 1000 times the rate. Its weights give
# step 7 a loss over 3 times the median of the steps before (measured: 74.4 against 5.27).
AT, TIMES = 5, 1000.0
# Lowered 10 times, the spike is 100 times the rate: the run trains through it (measured).
RECOVERING = ["train.steps=12", "checkpoint.every=2", "train.rollback_lr_factor=0.1"]


def config(run_dir, *overrides):
    return load_config(REPO / "configs/tiny.yaml", SMALL + [f"run.dir={run_dir}", *overrides])


def rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def step_rows(run_dir: Path) -> list[dict]:
    return [r for r in rows(run_dir) if "loss" in r and "step" in r]


def rollback_rows(run_dir: Path) -> list[dict]:
    return [r for r in rows(run_dir) if r.get("event") == "rollback"]


def stored_weights(step_dir: Path) -> list[np.ndarray]:
    """The master weights of a saved step, read by Orbax without our code."""
    with ocp.StandardCheckpointer() as ckptr:
        return [np.asarray(x) for x in jax.tree.leaves(ckptr.restore(step_dir / "state")["master"])]


# --- the rules, against hand-computed values ------------------------------------------------------

def _metrics(loss, grad_norm=1.0, skipped=0, consecutive=0):
    return {"loss": loss, "grad_norm": grad_norm, "skipped": skipped,
            "consecutive_skips": consecutive, "loss_scale": 1.0}


def test_a_spike_is_judged_against_the_median_of_the_recent_losses():
    train_cfg = TrainConfig(spike_factor=2.0, spike_window=4)
    prec = Precision()
    health = Health()
    for loss in [9.0, 4.0, 5.0, 6.0, 7.0]:  # the window keeps the last 4: 4, 5, 6, 7
        health = health.after(loss, train_cfg.spike_window)
    assert health.recent_losses == (4.0, 5.0, 6.0, 7.0)
    limit = 2.0 * float(np.median([4.0, 5.0, 6.0, 7.0]))  # 11.0
    assert diagnose(9, _metrics(limit), health, train_cfg, prec) is None
    found = diagnose(9, _metrics(limit + 0.01), health, train_cfg, prec)
    assert found is not None and found.first_bad == 9 and "train.spike_factor=2" in found.reason
    # Too few losses to judge, or the check off: no spike.
    short = Health(recent_losses=(1.0,) * (MIN_HISTORY - 1))
    assert diagnose(9, _metrics(100.0), short, train_cfg, prec) is None
    off = TrainConfig(spike_factor=0.0)
    assert diagnose(9, _metrics(100.0), health, off, prec) is None


def test_the_other_divergences_and_where_each_began():
    bounded, prec = TrainConfig(max_grad_norm=2.0), Precision()
    assert diagnose(3, _metrics(5.0, grad_norm=2.0), Health(), bounded, prec) is None
    assert "train.max_grad_norm=2" in diagnose(3, _metrics(5.0, grad_norm=2.5), Health(), bounded,
                                               prec).reason
    assert "loss is nan" in diagnose(3, _metrics(float("nan")), Health(), TrainConfig(), prec).reason
    assert "non-finite gradients" in diagnose(3, _metrics(5.0, float("inf"), skipped=1), Health(),
                                              TrainConfig(), prec).reason
    dynamic = Precision(loss_scale="dynamic", max_consecutive_skips=4)
    # A dynamic scale's skipped update is no divergence, and its overflowing norm is not judged.
    assert diagnose(3, _metrics(5.0, float("inf"), 1, 1), Health(), bounded, dynamic) is None
    found = diagnose(10, _metrics(5.0, float("inf"), 1, 4), Health(), TrainConfig(), dynamic)
    assert found.first_bad == 7  # skipped at steps 7, 8, 9, 10


def test_the_checkpoint_before_the_first_bad_step_is_not_healthy():
    # Step f's loss is the loss of the weights saved at f - 1.
    assert rollback_target([2, 4, 6], first_bad=7) == 4
    assert rollback_target([2, 4, 6], first_bad=8) == 6
    assert rollback_target([2, 4, 6], first_bad=3) == 0  # the initial state


def test_health_survives_the_json_meta():
    health = Health(recent_losses=(5.123456789012345, 4.0), rollbacks=2, lr_factor=0.25,
                    data_offset=7)
    assert Health.from_meta(json.loads(json.dumps(health.to_meta()))) == health
    assert Health.from_meta({"step": 3, "seed": 0}) == Health()  # saved before health existed


def test_a_resume_drops_the_rollback_rows_its_checkpoint_had_not_seen(tmp_path):
    path = tmp_path / "metrics.jsonl"
    lines = [{"step": 4, "loss": 1.0}, {"event": "rollback", "rollback": 1, "to_step": 2},
             {"step": 3, "loss": 1.0}, {"event": "rollback", "rollback": 2, "to_step": 2},
             {"event": "resume", "resumed_from_step": 2}]
    path.write_text("".join(json.dumps(r) + "\n" for r in lines))
    assert trim_metrics(path, 3, rollbacks=1) == 2
    kept = [json.loads(line) for line in path.read_text().splitlines()]
    assert kept == [lines[1], lines[2], lines[4]]


@pytest.mark.parametrize("override,needle", [
    ("train.on_divergence=retry", "train.on_divergence must be one of rollback, stop"),
    ("train.spike_factor=0.5", "train.spike_factor must be 0 (off) or above 1"),
    ("train.spike_window=0", "train.spike_window must be positive"),
    ("train.max_grad_norm=-1", "train.max_grad_norm must be >= 0"),
    ("train.rollback_lr_factor=0", "train.rollback_lr_factor must be in (0, 1]"),
    ("train.rollback_lr_factor=2", "train.rollback_lr_factor must be in (0, 1]"),
    ("train.max_rollbacks=-1", "train.max_rollbacks must be >= 0"),
    ("train.max_rollbacks=1.5", "train.max_rollbacks: expected int"),
])
def test_bad_recovery_settings_are_one_line(override, needle):
    with pytest.raises(ConfigError) as caught:
        load_config(None, [override])
    assert needle in str(caught.value) and "\n" not in str(caught.value)


# --- runs ---------------------------------------------------------------------------------------

def _reference_rate(cfg, count: int) -> float:
    """The configured schedule from optax itself, with the test's spike."""
    schedule = optax.warmup_cosine_decay_schedule(
        0.0, cfg.train.lr, cfg.train.warmup_steps, cfg.train.steps,
        cfg.train.lr * cfg.train.min_lr_ratio)
    return float(schedule(count)) * (TIMES if count == AT else 1.0)


def test_rollback_recovers_from_a_learning_rate_spike(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(optim, "lr_schedule", spiked(AT, TIMES))
    drawn = []  # the token-stream batch index of every step, in the order drawn
    plain_batch = loop.train_batch
    monkeypatch.setattr(loop, "train_batch",
                        lambda tokens, index, **kw: drawn.append(index) or plain_batch(tokens, index, **kw))
    cfg = config(tmp_path, *RECOVERING)
    result = train(cfg)

    assert result.step == 12 and np.isfinite(result.losses[12])
    [row] = rollback_rows(tmp_path)
    assert {k: row[k] for k in ("rollback", "from_step", "to_step", "batches_skipped", "lr_factor")} \
        == {"rollback": 1, "from_step": 7, "to_step": 4, "batches_skipped": 3, "lr_factor": 0.1}
    assert re.fullmatch(r"loss [\d.]+ is over train.spike_factor=3 times the median [\d.]+ of the "
                        r"last 6 losses", row["reason"])
    kept = [r["loss"] for r in step_rows(tmp_path) if r["step"] <= 4]  # steps 5 and 6 were redone
    assert row["loss"] > 3 * np.median(kept) and np.isfinite(row["grad_norm"])
    assert "rolled back to step 4 (rollback 1 of at most 3), skipping 3 batches, learning rate x0.1" \
        in capsys.readouterr().out
    # Steps 1-4 drew batches 0-3, the spike's steps 5-7 batches 4-6 (and step 8 batch 7, in
    # flight when step 7 was judged); from step 4 the run goes on with batch 7.
    assert drawn == list(range(8)) + list(range(7, 15))
    logged = step_rows(tmp_path)
    assert [r["step"] for r in logged] == list(range(1, 13))  # each step once
    for r in logged:  # every update after the rollback at a tenth of the configured rate
        factor = 0.1 if r["step"] > 4 else 1.0
        assert r["lr"] == pytest.approx(factor * _reference_rate(cfg, r["step"] - 1), rel=1e-6)
    # The weights of step 6 gave step 7 its loss: moved aside, never used again.
    assert (tmp_path / "checkpoints" / "6.diverged").is_dir()
    assert RunCheckpoints(tmp_path / "checkpoints", 3).steps() == [8, 10, 12]


def test_stop_names_the_newest_healthy_checkpoint_and_a_resume_starts_there(tmp_path, monkeypatch):
    monkeypatch.setattr(optim, "lr_schedule", spiked(AT, TIMES))
    cfg = config(tmp_path, "train.steps=8", "checkpoint.every=1", "train.on_divergence=stop")
    with pytest.raises(TrainingDiverged) as caught:
        train(cfg)
    message = str(caught.value)
    assert "\n" not in message
    assert re.match(r"step 7: loss [\d.]+ is over train.spike_factor=3 times the median", message)
    assert ("stopped without saving (train.on_divergence=stop). Newest healthy checkpoint: "
            f"step 5 in {tmp_path / 'checkpoints'} (step 6, whose weights gave this step, moved to "
            "checkpoints/6.diverged)") in message
    ckpts = tmp_path / "checkpoints"
    assert RunCheckpoints(ckpts, 3).steps() == [4, 5]  # keep=3 had dropped step 3 at step 6
    w4, w5, w6 = (stored_weights(ckpts / name) for name in ("4", "5", "6.diverged"))
    def biggest_change(a, b):
        return max(np.abs(x - y).max() for x, y in zip(a, b, strict=True))
    assert biggest_change(w6, w5) > 100 * biggest_change(w5, w4)  # the spike's update
    assert not rollback_rows(tmp_path)

    # Without the spike, the same command resumes from the healthy step and trains on.
    monkeypatch.undo()
    result = train(cfg)
    assert min(result.losses) == 6 and result.step == 8
    assert all(np.isfinite(loss) and loss < 6 for loss in result.losses.values())


def test_the_run_gives_up_after_max_rollbacks_in_one_line(tmp_path):
    # Every step's gradient norm (about 1-2 here) is over the bound: step 1 diverges, goes back
    # to the initial state past its batch, and diverges again.
    cfg = config(tmp_path, "train.steps=4", "train.max_grad_norm=0.1", "train.max_rollbacks=1")
    with pytest.raises(TrainingDiverged) as caught:
        train(cfg)
    message = str(caught.value)
    assert "\n" not in message
    assert message.startswith("step 1: gradient norm ")
    assert ("exceeds train.max_grad_norm=0.1; gave up after 1 rollback (train.max_rollbacks=1). "
            "Newest healthy checkpoint: none.") in message
    [row] = rollback_rows(tmp_path)
    assert (row["from_step"], row["to_step"], row["batches_skipped"], row["lr_factor"]) == (1, 0, 1, 1.0)


def test_rollback_on_packed_records_moves_the_grain_loader_past_the_skipped_batches(
        tmp_path, monkeypatch):
    # Short text records, packed: the data position is the Grain loader's, saved in each
    # checkpoint; the rollback restores step 4's and moves it on past the batches drawn since.
    source = tmp_path / "records.jsonl"
    lines = [line for line in Path(json.__file__).read_text().splitlines() if 8 <= len(line) <= 30]
    source.write_text("".join(json.dumps({"text": line}) + "\n" for line in lines))
    monkeypatch.setattr(optim, "lr_schedule", spiked(AT, TIMES))
    drawn = []  # every training batch, in the order the trainer drew them
    plain_batch = Run.global_batch
    monkeypatch.setattr(Run, "global_batch", lambda run, local: drawn.append(local) or plain_batch(run, local))
    cfg = config(tmp_path / "run", *RECOVERING, f"data.source={source}", "data.format=text",
                 "data.train_on=all", "train.eval_batches=0")
    result = train(cfg)

    assert result.step == 12 and np.isfinite(result.losses[12])
    [row] = rollback_rows(tmp_path / "run")
    assert (row["from_step"], row["to_step"], row["batches_skipped"]) == (7, 4, 3)
    # The reference: Grain's own order of the batches, from a fresh loader.
    fresh = iter(build_run(cfg).data.train_batches(batch_size=cfg.train.batch_size, seed=cfg.train.seed))
    order = [next(fresh) for _ in range(15)]
    want = order[:8] + order[7:15]  # as on a token stream: batches 4-6 skipped
    assert len(drawn) == len(want)
    for got, expected in zip(drawn, want):
        assert got.keys() == expected.keys()
        for key in expected:
            np.testing.assert_array_equal(got[key], expected[key])


# --- kill -9 in the middle of the recovery --------------------------------------------------

def _spawn(run_dir: Path, cache: Path):
    # One CPU device; every start reuses the first one's compiled programs (jax's persistent
    # cache), so the second and third runs cost seconds.
    env = one_cpu_env(cache_every_program=True, JAX_COMPILATION_CACHE_DIR=str(cache))
    args = ["--config", str(REPO / "configs/tiny.yaml"), *SMALL, *RECOVERING, f"run.dir={run_dir}"]
    return subprocess.Popen([sys.executable, str(REPO / "tests" / "spike.py"), str(AT), str(TIMES),
                             *args], cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def _rolled_back(run_dir: Path) -> bool:
    try:
        return '"event": "rollback"' in (run_dir / "metrics.jsonl").read_text()
    except FileNotFoundError:
        return False


def test_kill_9_in_the_middle_of_the_recovery_resumes_to_the_same_result(tmp_path):
    cache = tmp_path / "compiled"
    straight = _spawn(tmp_path / "straight", cache)
    _, err = straight.communicate(timeout=900)
    assert straight.returncode == 0, err

    faulty = tmp_path / "faulty"
    killed = _spawn(faulty, cache)
    while killed.poll() is None and not _rolled_back(faulty):
        time.sleep(0.005)
    killed.send_signal(signal.SIGKILL)
    killed.communicate(timeout=600)
    assert killed.returncode == -signal.SIGKILL
    # Killed mid-recovery: rolled back to step 4, nothing saved since (the resume must roll back
    # again from step 4's checkpoint and its health record).
    assert _rolled_back(faulty) and RunCheckpoints(faulty / "checkpoints", 3).steps() == [2, 4]

    resumed = _spawn(faulty, cache)
    out, err = resumed.communicate(timeout=900)
    assert resumed.returncode == 0, err
    want = {r["step"]: r["loss"] for r in step_rows(tmp_path / "straight")}
    got = {r["step"]: r["loss"] for r in step_rows(faulty)}
    assert got == want and np.isfinite(got[12])  # every step's loss, the final one included
    assert [r["step"] for r in step_rows(faulty)] == list(range(1, 13))
    assert rollback_rows(faulty) == rollback_rows(tmp_path / "straight")  # recorded once
    assert any(r.get("event") == "resume" for r in rows(faulty))
    for a, b in zip(stored_weights(tmp_path / "straight" / "checkpoints" / "12"),
                    stored_weights(faulty / "checkpoints" / "12"), strict=True):
        np.testing.assert_array_equal(a, b)
