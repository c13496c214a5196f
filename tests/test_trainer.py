"""The trainer through its real entry points, on a shrunk config of the embedded corpus."""
import json
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest

from zeroflow.cli import train as train_cli
from zeroflow.config.io import load_config
from zeroflow.trainer import TrainingDiverged, build_run, train
from zeroflow.trainer.checkpoints import RunCheckpoints
from fixtures import TINY_TRAINER
from helpers import one_cpu_env

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
SHRUNK = TINY_TRAINER + ["data.max_bytes=400000", "train.warmup_steps=2"]
# For the in-process runs: no plot.png, which costs about a second of CPU per run to draw and
# which none of them reads (the CLI runs below keep the default, plot included).
NO_PLOT = ["run.plot=false"]


def cli_env() -> dict[str, str]:
    # The CLI must work on a plain single-device CPU. Every program goes to the test run's
    # compilation cache (conftest), however quickly it compiled: the SIGTERM test's runs load
    # the smoke run's programs instead of compiling them again.
    return one_cpu_env(cache_every_program=True)


def cli(*args):
    return subprocess.Popen([sys.executable, "-m", "zeroflow.train", *args], cwd=REPO,
                            env=cli_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


def read_losses(run_dir: Path) -> dict[int, float]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if "loss" in r}


# The smoke run's command: also the uninterrupted run the SIGTERM test resumes to match.
SMOKE = ["--config", "configs/tiny.yaml", *SHRUNK, "train.steps=8", "train.eval_every=4",
         "run.tensorboard=true"]


@pytest.fixture(scope="module")
def smoke_run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("smoke")
    proc = cli(*SMOKE, f"run.dir={run_dir}")
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err
    return run_dir


def test_cli_smoke_trains_and_writes_outputs(smoke_run):
    tmp_path = smoke_run
    losses = read_losses(tmp_path)
    assert sorted(losses) == list(range(1, 9))
    assert losses[8] < losses[1]
    assert load_config(tmp_path / "config.yaml").train.steps == 8
    assert RunCheckpoints(tmp_path / "checkpoints", 3).steps() == [8]
    evals = [json.loads(l) for l in (tmp_path / "metrics.jsonl").read_text().splitlines() if "eval_bpb" in l]
    assert [e["step"] for e in evals] == [4, 8] and all(np.isfinite(e["eval_bpb"]) for e in evals)
    assert list((tmp_path / "tb").glob("events.out.tfevents.*"))  # TensorBoard option


@pytest.mark.parametrize("override,needle", [
    ("train.stpes=3", "did you mean 'train.steps'? valid keys in train: steps"),
    ("train.steps=many", "train.steps"),
    ("model.norm=batchnorm", "rmsnorm, layernorm"),
])
def test_cli_bad_config_is_one_line(override, needle, tmp_path, capsys):
    # In-process: the exit status of ``python -m zeroflow.train`` is main's return value (the
    # mesh test below runs the real entry point).
    assert train_cli.main(["--config", str(REPO / "configs/tiny.yaml"), override,
                           f"run.dir={tmp_path}"]) == 2
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert needle in lines[0] and "Traceback" not in err


def test_cli_mesh_that_does_not_fit_is_one_line(tmp_path):
    proc = cli("--config", "configs/tiny.yaml", "parallel.data=4", f"run.dir={tmp_path}")
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 2 and "Traceback" not in err
    assert err.strip().splitlines()[-1].startswith("zeroflow.train: error: mesh data=4")


def test_sigterm_checkpoints_and_resume_matches_uninterrupted(tmp_path, smoke_run):
    # The smoke run's command, held before its third step until SIGTERM is pending
    # (tests/hold_before_step.py): the signal lands after two steps on any machine. The step
    # in flight then (the third) finishes and is saved.
    stopped, marker = tmp_path / "stopped", tmp_path / "held"
    p = subprocess.Popen([sys.executable, str(REPO / "tests" / "hold_before_step.py"), "2",
                          str(marker), *SMOKE, f"run.dir={stopped}"], cwd=REPO,
                         env=cli_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True)
    while p.poll() is None and not marker.exists():
        time.sleep(0.01)
    p.send_signal(signal.SIGTERM)
    out, err = p.communicate(timeout=600)
    assert p.returncode == 128 + signal.SIGTERM, err
    assert RunCheckpoints(stopped / "checkpoints", 3).steps() == [3]
    assert sorted(read_losses(stopped)) == [1, 2, 3]
    assert "SIGTERM: saved a checkpoint at step 3" in out  # what a person reads is on stdout

    p = cli(*SMOKE, f"run.dir={stopped}")
    out, err = p.communicate(timeout=600)
    assert p.returncode == 0, err
    assert "resumed from step 3" in out
    want, got = read_losses(smoke_run), read_losses(stopped)
    assert sorted(got) == sorted(want) == list(range(1, 9))
    np.testing.assert_allclose([got[s] for s in range(1, 9)], [want[s] for s in range(1, 9)],
                               rtol=1e-6)


def four_steps_config(run_dir):
    return load_config(REPO / "configs/tiny.yaml", SHRUNK + NO_PLOT + [
        "train.steps=4", "checkpoint.every=2", "train.eval_every=0", f"run.dir={run_dir}"])


@pytest.fixture(scope="module")
def four_steps(tmp_path_factory):
    """A finished 4-step run, checkpoints at steps 2 and 4; tests damage or resume copies."""
    run_dir = tmp_path_factory.mktemp("four") / "run"
    train(four_steps_config(run_dir))
    return run_dir


def test_corrupt_latest_checkpoint_falls_back_and_is_moved_aside(four_steps, tmp_path, caplog):
    shutil.copytree(four_steps, tmp_path, dirs_exist_ok=True)
    cfg = four_steps_config(tmp_path)
    ckpts = RunCheckpoints(tmp_path / "checkpoints", 3)
    assert ckpts.steps() == [2, 4]
    # Truncate every data file of the latest checkpoint's state, as a crash mid-copy would.
    for f in (tmp_path / "checkpoints" / "4" / "state").rglob("*"):
        if f.is_file() and f.stat().st_size > 0 and "ocdbt" not in f.name.lower() and f.parent.name == "d":
            f.write_bytes(f.read_bytes()[: f.stat().st_size // 3])
    like = build_run(cfg).init_state()
    with caplog.at_level("WARNING", logger="zeroflow"):
        state, meta = ckpts.restore_latest(like)
    assert int(state.step) == 2 and meta["step"] == 2
    assert "step 4 is unreadable" in caplog.text and "resuming from step 2" in caplog.text
    assert ckpts.steps() == [2] and (tmp_path / "checkpoints" / "4.corrupt").is_dir()


def test_resume_onto_another_zero_stage(tmp_path):
    """parallel.* may change between a run and its resume (the same portable checkpoints)."""
    base = SHRUNK + NO_PLOT + ["train.steps=3", "train.eval_every=0", f"run.dir={tmp_path}"]
    train(load_config(REPO / "configs/tiny.yaml", base))
    cfg = load_config(REPO / "configs/tiny.yaml", base + ["train.steps=5", "parallel.zero_stage=3",
                                                           "precision.params=bf16"])
    result = train(cfg)
    assert result.step == 5 and sorted(result.losses) == [4, 5]
    assert jax.device_count() == 8  # conftest: the resumed run really was sharded 8 ways


def test_offloaded_run_trains_evaluates_and_checkpoints_like_a_plain_one(tmp_path):
    """parallel.offload=optimizer+params: weights and optimizer state in host memory, layers
    streamed in by the train step and by evaluation; same numbers as without offload."""
    def run(name, *extra):
        base = SHRUNK + NO_PLOT + ["model.num_layers=2", "parallel.zero_stage=3", "precision.params=bf16",
                         "train.steps=3", "train.eval_every=3", f"run.dir={tmp_path / name}"]
        result = train(load_config(REPO / "configs/tiny.yaml", base + list(extra)))
        rows = [json.loads(l) for l in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
        return result.losses, [r["eval_loss"] for r in rows if "eval_loss" in r]

    offloaded = run("offloaded", "parallel.offload=optimizer+params", "parallel.update_on=host")
    assert offloaded == run("plain")
    assert RunCheckpoints(tmp_path / "offloaded" / "checkpoints", 3).steps() == [3]


def test_diverging_loss_stops_with_a_clear_error_and_saves_nothing(tmp_path):
    # lr=1e30 blows the weights up on the first update, so the second step's loss or gradients
    # are inf/nan without any loss scaling to blame. The run must stop, say so, save nothing.
    # (Rolling back instead is tests/test_divergence.py's.)
    cfg = load_config(REPO / "configs/tiny.yaml", SHRUNK + NO_PLOT + ["train.steps=6", "train.lr=1e30", "train.grad_clip=0",
                                                             "train.warmup_steps=0", "train.eval_every=0",
                                                             "train.on_divergence=stop", f"run.dir={tmp_path}"])
    with pytest.raises(TrainingDiverged, match=r"step 2: .*(loss is (nan|inf)|non-finite gradients).*"
                                               r"stopped without saving .*\. Newest healthy checkpoint: none\."):
        train(cfg)
    assert RunCheckpoints(tmp_path / "checkpoints", 3).steps() == []


def test_sample_and_export_from_a_run(tmp_path, capsys):
    from safetensors.numpy import load_file

    from zeroflow.cli import export, sample
    cfg = load_config(REPO / "configs/tiny.yaml", SHRUNK + NO_PLOT + ["train.steps=2", "train.eval_every=0",
                                                             "parallel.zero_stage=3", f"run.dir={tmp_path}"])
    result = train(cfg)
    capsys.readouterr()  # the run's own lines
    assert sample.main(["--run", str(tmp_path), "--prompt", "def ", "--tokens", "12", "--temperature", "0"]) == 0
    printed = capsys.readouterr().out
    assert printed.startswith("def ") and len(printed.rstrip("\n")) >= 4
    out = tmp_path / "weights.safetensors"
    assert export.main(["--run", str(tmp_path), "--out", str(out)]) == 0
    weights = load_file(str(out))
    assert "layers/attn/query/kernel" in weights and weights["embedding"].dtype == np.float32
    assert weights["layers/attn/query/kernel"].shape[0] == 1  # stacked layer axis kept
    assert result.step == 2
    assert export.main(["--run", str(tmp_path), "--out", str(tmp_path / "w.bin")]) == 2
    assert "must end in .safetensors or .npz" in capsys.readouterr().err


def test_resuming_a_finished_run_says_so_in_one_line(four_steps, tmp_path, capsys):
    shutil.copytree(four_steps, tmp_path, dirs_exist_ok=True)
    capsys.readouterr()  # the lines of the run that made it
    result = train(four_steps_config(tmp_path))
    out = capsys.readouterr().out
    assert "the checkpoint is at step 4, train.steps is 4: nothing to do" in out
    assert "nan" not in out and result.step == 4 and result.losses == {}


def test_dropout_uses_the_engine_rng_and_evaluation_runs_without_it(tmp_path):
    from zeroflow.trainer.evaluation import make_eval
    base = SHRUNK + ["train.steps=1", "train.eval_every=0", f"run.dir={tmp_path}"]
    run = build_run(load_config(REPO / "configs/tiny.yaml", base + ["model.dropout=0.5"]))
    state = run.init_state()
    assert state.rng is not None  # the engine derives every step's dropout keys from it
    no_dropout = build_run(load_config(REPO / "configs/tiny.yaml", base))
    assert no_dropout.init_state().rng is None
    # Evaluation of the same weights with and without dropout configured: equal (dropout off).
    assert make_eval(run)(state) == make_eval(no_dropout)(state.replace(rng=None))
    # Training does use dropout: the first step's loss differs from the dropout-free model's.
    _, with_drop = run.make_step()(state, run.global_batch(np.asarray(
        run.data.train[: 8 * 33]).reshape(8, 33)))
    _, without = no_dropout.make_step()(no_dropout.init_state(), run.global_batch(np.asarray(
        run.data.train[: 8 * 33]).reshape(8, 33)))
    assert float(with_drop["loss"]) != pytest.approx(float(without["loss"]), rel=1e-4)
