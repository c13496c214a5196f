"""What a run leaves to look at: TensorBoard events and plot.png by default, W&B (offline) and
trackio (local) when asked, evaluation without training, and interactive sampling. One shrunk
run is trained once for the module; nothing here needs a network."""
import io
import json
import math
import sqlite3
import struct
import sys

import matplotlib.image
import numpy as np
import pytest

from fixtures import TINY_TRAINER
from helpers import REPO
from zeroflow.config.io import apply_overrides, load_config
from zeroflow.trainer import plot as plot_module
from zeroflow.trainer import reporting, train

pytestmark = pytest.mark.slow

STEPS, EVAL_EVERY = 6, 3
SHRUNK = TINY_TRAINER + ["data.max_bytes=400000", "train.warmup_steps=2", f"train.steps={STEPS}",
                         f"train.eval_every={EVAL_EVERY}"]


def config(*overrides):
    return apply_overrides(load_config(REPO / "configs" / "tiny.yaml"), SHRUNK + list(overrides))


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A run with the default run.* settings plus W&B offline and trackio; the plot's
    redraws are recorded (the real drawing runs)."""
    run_dir = tmp_path_factory.mktemp("run") / "looked-at"
    trackio_dir = tmp_path_factory.mktemp("trackio")
    drawn = []
    real = reporting.write_plot
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TRACKIO_DIR", str(trackio_dir))
        mp.setenv("WANDB_SILENT", "true")
        mp.setattr(reporting, "write_plot",
                   lambda d: drawn.append(len(plot_module.read_series(d / "metrics.jsonl")
                                              .get("eval_loss", []))) or real(d))
        result = train(config(f"run.dir={run_dir}", "run.wandb=offline", "run.trackio=true"))
    return run_dir, trackio_dir, result, drawn


def tensorboard_scalars(folder):
    """{tag: {step: value}} read from the TFRecord event files (length, crc, event, crc)."""
    from tensorboardX.proto import event_pb2
    scalars = {}
    for path in folder.glob("events.out.tfevents.*"):
        data = path.read_bytes()
        at = 0
        while at < len(data):
            (length,) = struct.unpack("<Q", data[at:at + 8])
            event = event_pb2.Event.FromString(data[at + 12:at + 12 + length])
            at += 12 + length + 4
            for value in event.summary.value:
                scalars.setdefault(value.tag, {})[event.step] = value.simple_value
    return scalars


def test_default_run_writes_tensorboard_events_and_a_plot(trained):
    run_dir, _, result, drawn = trained
    scalars = tensorboard_scalars(run_dir / "tb")
    # fp32 loss stored as a float32 scalar: equal to the float32 rounding of what the run returned.
    assert {s: np.float32(v) for s, v in scalars["loss"].items()} == {
        s: np.float32(v) for s, v in result.losses.items()}
    assert sorted(scalars["eval_loss"]) == [EVAL_EVERY, STEPS]
    assert "tokens_per_s" in scalars
    image = matplotlib.image.imread(run_dir / "plot.png")
    assert image.shape[0] >= 300 and image.shape[1] >= 800
    assert image[..., :3].std() > 0.05  # lines and text, not a blank canvas
    # Drawn at the evaluation in the middle (the first picture: 1 evaluation then); the final
    # evaluation comes well within a minute of it, so the picture waits for the close (both).
    assert drawn == [1, 2]


def test_wandb_offline_and_trackio_log_the_run(trained):
    run_dir, trackio_dir, result, _ = trained
    (wandb_file,) = (run_dir / "wandb").glob("offline-run-*/run-*.wandb")
    data = wandb_file.read_bytes()
    assert b"eval_loss" in data and b"tokens_per_s" in data
    (db,) = trackio_dir.glob("*.db")
    rows = sqlite3.connect(db).execute("select step, metrics from metrics").fetchall()
    logged = [(step, json.loads(m)) for step, m in rows]
    assert {s: m["loss"] for s, m in logged if "loss" in m} == pytest.approx(result.losses)
    assert sorted(s for s, m in logged if "eval_loss" in m) == [EVAL_EVERY, STEPS]


def test_a_logger_that_is_not_a_choice_fails_naming_the_choices():
    with pytest.raises(ValueError, match="off, offline, online"):
        config("run.wandb=yes")


def test_eval_only_evaluates_the_checkpoint_and_writes_nothing(trained, capsys):
    run_dir, _, result, _ = trained
    before = {p: p.stat().st_mtime_ns for p in run_dir.rglob("*") if p.is_file()}
    again = train(apply_overrides(load_config(run_dir / "config.yaml"), ["train.eval_only=true"]))
    # The same weights, batches and compiled evaluation as the run's final one: equal.
    assert again.eval == result.eval and again.step == STEPS
    assert f"step {STEPS} of" in capsys.readouterr().out
    assert {p: p.stat().st_mtime_ns for p in run_dir.rglob("*") if p.is_file()} == before


def test_eval_only_without_checkpoint_evaluates_the_initial_weights(tmp_path):
    fresh = tmp_path / "never-trained"
    result = train(config(f"run.dir={fresh}", "train.eval_only=true"))
    # Initial logits are near zero (0.02-scale weights), so the prediction is near uniform over
    # 256 bytes: ln 256 = 5.55 nats, within 0.3 (measured 5.47).
    assert result.step == 0 and abs(result.eval["eval_loss"] - math.log(256)) < 0.3
    assert not fresh.exists()


def test_sample_interactive_loads_once_and_answers_each_line(trained, monkeypatch, capsys):
    from zeroflow.cli import sample
    run_dir = trained[0]
    args = ["--run", str(run_dir), "--tokens", "6", "--temperature", "0"]
    alone = []
    for prompt in ("def ", "class "):
        assert sample.main(args + ["--prompt", prompt]) == 0
        alone.append(capsys.readouterr().out)
    loads = []
    real = sample.load_params
    monkeypatch.setattr(sample, "load_params", lambda *a, **k: loads.append(a) or real(*a, **k))
    monkeypatch.setattr(sys, "stdin", io.StringIO("def \nclass \n\nnot read\n"))
    assert sample.main(args + ["--interactive"]) == 0
    assert len(loads) == 1
    # Greedy, so each answer is what a one-prompt run gives; the empty line ends the loop.
    assert capsys.readouterr().out == "".join(alone)
