"""Faults and mistakes around a run folder: kill -9 at random points, damaged checkpoints, a
config for another model, bad inputs. Each ends with nothing lost and, where the user must act,
one line saying what to do (docs/runs.md)."""
import errno
import json
import os
import random
import shutil
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

from zeroflow.cli import export, sample
from zeroflow.cli import train as train_cli
from zeroflow.config.io import load_config
from zeroflow.engine import checkpoint_digests
from zeroflow.trainer import build_run, train
from zeroflow.trainer.checkpoints import RunCheckpoints, UnreadableCheckpoint
from zeroflow.trainer.reporting import trim_metrics
from fixtures import TINY_TRAINER
from helpers import one_cpu_env

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
# No plot.png: drawing it costs about a second of CPU per run and a matplotlib import per
# process, and no test here reads it except the plot's own, which turns it on.
SMALL = TINY_TRAINER + ["data.max_bytes=100000", "train.warmup_steps=2", "train.eval_every=0",
                        "run.plot=false"]
LEAKS = ("Traceback", "TensorStore", "tensorstore", "pybind", "NoneType", "zarr", "OCDBT")


def config(run_dir, *overrides):
    return load_config(REPO / "configs/tiny.yaml", SMALL + [f"run.dir={run_dir}", *overrides])


def cli_args(run_dir, *overrides):
    return ["--config", str(REPO / "configs/tiny.yaml"), *SMALL, f"run.dir={run_dir}", *overrides]


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    """4 steps with a checkpoint every 2: checkpoints/2 and checkpoints/4."""
    run_dir = tmp_path_factory.mktemp("finished") / "run"
    train(config(run_dir, "train.steps=4", "checkpoint.every=2"))
    return run_dir


@pytest.fixture
def run_copy(finished_run, tmp_path):
    shutil.copytree(finished_run, tmp_path / "run")
    return tmp_path / "run"


def stored_arrays(step_dir: Path) -> list[np.ndarray]:
    """Every array of a step's saved state, read by Orbax without our code."""
    with ocp.StandardCheckpointer() as ckptr:
        return [np.asarray(x) for x in jax.tree.leaves(ckptr.restore(step_dir / "state"))]


def cut_data_files(step_dir: Path) -> None:
    """Cut every data file of a step's state to a third, as a crash mid-copy would."""
    for f in (step_dir / "state").rglob("*"):
        if f.is_file() and f.parent.name == "d":
            f.write_bytes(f.read_bytes()[: f.stat().st_size // 3])


def metric_rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def one_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert not any(leak in err for leak in LEAKS), err
    return lines[0]


def snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() if p.is_file() else b"<dir>"
            for p in sorted(folder.rglob("*"))}


# --- kill -9 -------------------------------------------------------------------------------

def _cached_env(**extra) -> dict[str, str]:
    # One CPU device, like a user's first run; every program goes to the test run's compilation
    # cache (conftest), however quickly it compiled: the runs of a test, and the disk-full run
    # of the same command, compile only once.
    return one_cpu_env(cache_every_program=True, **extra)


def _spawn(args):
    return subprocess.Popen([sys.executable, "-m", "zeroflow.train", *args], cwd=REPO,
                            env=_cached_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


def _logged_steps(run_dir: Path) -> int:
    try:
        return sum('"step"' in line and '"loss"' in line
                   for line in (run_dir / "metrics.jsonl").read_text().splitlines())
    except FileNotFoundError:
        return 0


# The command of the kill -9 test and of the disk-full one: one compiled step for both.
EVERY_STEP_SAVED = ["train.steps=8", "checkpoint.every=1", "train.eval_batches=0"]


def test_kill_9_at_random_points_resumes_bit_identically_and_logs_each_step_once(tmp_path):
    steps = 8
    common = [*EVERY_STEP_SAVED, "checkpoint.keep=2"]
    straight = _spawn(cli_args(tmp_path / "straight", *common))
    _, err = straight.communicate(timeout=600)
    assert straight.returncode == 0, err

    faulty = tmp_path / "faulty"
    rng = random.Random(22)
    killed_mid_run = 0
    for target in sorted(rng.sample(range(1, steps), 3)):  # kill once this many steps are logged
        proc = _spawn(cli_args(faulty, *common))
        while proc.poll() is None and _logged_steps(faulty) < target:
            time.sleep(0.005)
        time.sleep(rng.uniform(0, 0.05))  # land anywhere: mid-step, mid-save, mid-log
        proc.send_signal(signal.SIGKILL)
        proc.communicate(timeout=600)
        killed_mid_run += proc.returncode == -signal.SIGKILL and _logged_steps(faulty) < steps
    assert killed_mid_run >= 1
    resumed = _spawn(cli_args(faulty, *common))
    out, err = resumed.communicate(timeout=600)
    assert resumed.returncode == 0, err

    for want, got in zip(stored_arrays(tmp_path / "straight" / "checkpoints" / str(steps)),
                         stored_arrays(faulty / "checkpoints" / str(steps)), strict=True):
        np.testing.assert_array_equal(got, want)
    rows = metric_rows(faulty)
    logged = [r["step"] for r in rows if "loss" in r]
    assert logged == list(range(1, steps + 1))  # each step once, in order
    losses = {r["step"]: r["loss"] for r in rows if "loss" in r}
    assert losses == {r["step"]: r["loss"] for r in metric_rows(tmp_path / "straight") if "loss" in r}
    assert any(r.get("event") == "resume" for r in rows)
    assert not list((faulty / "checkpoints").glob("*tmp*"))  # interrupted saves cleaned up


def test_trimming_metrics_drops_rows_past_the_step_and_a_torn_line(tmp_path):
    path = tmp_path / "metrics.jsonl"
    rows = [{"step": s, "loss": 1.0 / s} for s in range(1, 6)] + [{"event": "resume"}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 6, "lo')
    assert trim_metrics(path, 3) == 3
    assert [json.loads(line) for line in path.read_text().splitlines()] == rows[:3] + rows[5:]


# --- damaged checkpoints -------------------------------------------------------------------

def test_corrupt_latest_checkpoint_is_moved_aside_and_written_again(run_copy, caplog):
    original = stored_arrays(run_copy / "checkpoints" / "4")
    cut_data_files(run_copy / "checkpoints" / "4")
    with caplog.at_level("WARNING", logger="zeroflow"):
        result = train(config(run_copy, "train.steps=4", "checkpoint.every=2"))
    [warning] = [r.getMessage() for r in caplog.records if r.name == "zeroflow"]
    assert "\n" not in warning and not any(leak in warning for leak in LEAKS), warning
    assert warning.startswith("checkpoint step 4 is unreadable: checkpoints/4/state/d/")
    assert "when it was saved" in warning  # its size, read from the step's digests
    assert "moved it to checkpoints/4.corrupt, resuming from step 2" in warning
    assert sorted(result.losses) == [3, 4]
    assert (run_copy / "checkpoints" / "4.corrupt").is_dir()
    # Step 4 was saved afresh: readable, and the same state the first run saved.
    assert RunCheckpoints(run_copy / "checkpoints", 3).steps() == [2, 4]
    for got, want in zip(stored_arrays(run_copy / "checkpoints" / "4"), original, strict=True):
        np.testing.assert_array_equal(got, want)
    rows = metric_rows(run_copy)
    assert [r["step"] for r in rows if "loss" in r] == [1, 2, 3, 4]
    # Dropped: steps 3 and 4 and the final evaluation at 4, all logged again after it.
    assert {"event": "resume", "resumed_from_step": 2, "dropped_rows": 3} in rows
    # Rerunning finds a readable latest checkpoint: nothing to train, nothing moved.
    assert train(config(run_copy, "train.steps=4", "checkpoint.every=2")).losses == {}


def _delete(rel):
    def damage(step_dir):
        path = step_dir / rel
        shutil.rmtree(path) if path.is_dir() else path.unlink()
    return damage


def _overwrite(rel, data: bytes):
    return lambda step_dir: (step_dir / rel).write_bytes(data)


def _cut(rel):
    return lambda step_dir: (step_dir / rel).write_bytes((step_dir / rel).read_bytes()[:20])


@pytest.mark.parametrize("damage,reason", [
    (_delete("state/_METADATA"), "checkpoints/4/state/_METADATA is missing"),
    (_overwrite("state/_METADATA", b"\x8f\x00garbage"), "checkpoints/4/state/_METADATA is not valid JSON"),
    (_overwrite("meta/metadata", b"{\"step\": "), "checkpoints/4/meta/metadata is not valid JSON"),
    (_delete("state"), "checkpoints/4/state/ is missing"),
    (_cut("state/manifest.ocdbt"), "checkpoints/4/state/manifest.ocdbt has 20 bytes, "),
    (cut_data_files, " when it was saved"),
])
def test_an_unreadable_step_is_named_with_its_file_and_fault(run_copy, damage, reason):
    damage(run_copy / "checkpoints" / "4")
    like = build_run(config(run_copy, "train.steps=4")).abstract_state()
    with pytest.raises(UnreadableCheckpoint) as caught:
        RunCheckpoints(run_copy / "checkpoints", 3, read_only=True).restore(4, like)
    message = str(caught.value)
    assert message.startswith("checkpoint step 4 is unreadable: ") and reason in message
    assert "\n" not in message and not any(leak in message for leak in LEAKS), message


def test_no_readable_checkpoint_says_what_to_do_and_moves_nothing(run_copy, capsys):
    for step in (2, 4):
        _delete("state/_METADATA")(run_copy / "checkpoints" / str(step))
    before = snapshot(run_copy)
    assert train_cli.main(cli_args(run_copy, "train.steps=4")) == 2
    line = one_line(capsys.readouterr().err)
    assert line.startswith(f"zeroflow.train: error: no readable checkpoint in {run_copy / 'checkpoints'}: "
                           "step 2: checkpoints/2/state/_METADATA is missing; step 4: ")
    assert f"to train this run from scratch move that folder away (mv {run_copy / 'checkpoints'} " in line
    assert snapshot(run_copy) == before


def test_export_and_sample_name_their_step_and_fall_back_from_an_unreadable_latest(
        run_copy, capsys, caplog):
    cut_data_files(run_copy / "checkpoints" / "4")
    before = snapshot(run_copy)
    out = run_copy.parent / "w.safetensors"
    with caplog.at_level("WARNING", logger="zeroflow"):
        assert export.main(["--run", str(run_copy), "--out", str(out)]) == 0
    assert "from step 2 to" in capsys.readouterr().out
    [warning] = [r.getMessage() for r in caplog.records if r.name == "zeroflow"]
    assert warning.startswith("checkpoint step 4 is unreadable: checkpoints/4/state/d/")
    assert "using step 2, the newest readable one" in warning and "\n" not in warning
    assert sample.main(["--run", str(run_copy), "--tokens", "2", "--temperature", "0"]) == 0
    assert "[step 2]" in capsys.readouterr().err
    assert snapshot(run_copy) == before  # readers change nothing

    # An existing output is refused before any work: nothing is overwritten.
    assert export.main(["--run", str(run_copy), "--out", str(out), "--step", "2"]) == 2
    assert "already exists" in one_line(capsys.readouterr().err)
    out.unlink()
    assert export.main(["--run", str(run_copy), "--out", str(out), "--step", "2"]) == 0
    assert "from step 2 to" in capsys.readouterr().out
    umask = os.umask(0)
    os.umask(umask)
    assert out.stat().st_mode & 0o777 == 0o666 & ~umask  # 0644 under the usual umask, not 0600
    out.unlink()
    assert sample.main(["--run", str(run_copy), "--tokens", "2", "--step", "2", "--temperature", "0"]) == 0
    assert "[step 2]" in capsys.readouterr().err
    assert export.main(["--run", str(run_copy), "--out", str(out), "--step", "3"]) == 2
    assert "no checkpoint at step 3" in one_line(capsys.readouterr().err)


# --- the run folder is changed only after every check --------------------------------------

def test_a_config_for_another_model_stops_before_the_folder_is_changed(run_copy, capsys):
    before = snapshot(run_copy)
    assert train_cli.main(cli_args(run_copy, "train.steps=6", "model.embed_dim=64")) == 2
    line = one_line(capsys.readouterr().err)
    assert f"{run_copy} holds a run of another model: model.embed_dim is 32 there, 64 here" in line
    assert snapshot(run_copy) == before
    # Without its config.yaml the checkpoint itself refuses the other model, still before
    # anything is written.
    (run_copy / "config.yaml").unlink()
    before = snapshot(run_copy)
    assert train_cli.main(cli_args(run_copy, "train.steps=6", "model.embed_dim=64")) == 2
    assert "does not match the target state" in one_line(capsys.readouterr().err)
    assert snapshot(run_copy) == before


@pytest.fixture(scope="module")
def damaged_hf_folders(tmp_path_factory):
    """A small Llama folder written by zeroflow, and copies with a cut and a random
    model.safetensors."""
    from zeroflow import hf
    from zeroflow.config.schema import ModelConfig
    from zeroflow.models import GPT, init_params
    root = tmp_path_factory.mktemp("hf")
    model_cfg = ModelConfig(vocab_size=256, seq_len=32, num_layers=1, embed_dim=32, num_heads=2,
                            mlp_dim=64)
    params, _ = init_params(model_cfg, jax.random.key(0))
    hf.save_pretrained(GPT(model_cfg), params, model_cfg, root / "good")
    good = (root / "good" / "model.safetensors").read_bytes()
    folders = {}
    for name, data in (("cut", good[: len(good) // 2]),
                       ("random", np.random.default_rng(0).bytes(len(good)))):
        shutil.copytree(root / "good", root / name)
        (root / name / "model.safetensors").write_bytes(data)
        folders[name] = root / name
    return folders


@pytest.mark.parametrize("case", ["missing data", "cut safetensors", "random safetensors"])
def test_bad_inputs_are_one_line_exit_2_and_leave_no_run_folder(case, damaged_hf_folders,
                                                                 tmp_path, capsys, monkeypatch):
    run_dir = tmp_path / "new-run"
    override, needle = {
        "missing data": ("data.source=/no/such/corpus", "data source not found: '/no/such/corpus'"),
        "cut safetensors": (f"model.init_from={damaged_hf_folders['cut']}",
                            "model.safetensors is not a readable safetensors file (shorter than "
                            "its header says: cut short?)"),
        "random safetensors": (f"model.init_from={damaged_hf_folders['random']}",
                               "model.safetensors is not a readable safetensors file"),
    }[case]
    assert train_cli.main(cli_args(run_dir, "train.steps=2", override)) == 2
    assert needle in one_line(capsys.readouterr().err)
    assert not run_dir.exists()
    monkeypatch.setenv("ZEROFLOW_TRACEBACK", "1")  # the full traceback when asked for
    with pytest.raises((ValueError, FileNotFoundError)):
        train_cli.main(cli_args(run_dir, "train.steps=2", override))


# --- what a person reads -------------------------------------------------------------------

def test_step_lines_and_summary_go_to_stdout_unwrapped(tmp_path, capsys):
    train(config(tmp_path / "run", "train.steps=4", "train.log_every=2", "run.progress=true",
                 "train.eval_batches=1"))
    out, err = capsys.readouterr()
    steps = [line for line in out.splitlines() if line.startswith("step ")]
    assert [line.split()[1] for line in steps] == ["2/4", "4/4"]  # every train.log_every steps
    assert all("loss " in line and "tok/s" in line for line in steps)
    summary = [line for line in out.splitlines() if "params: " in line]
    assert len(summary) == 1 and len(summary[0]) > 80  # one line, however long
    assert any(line.startswith("final: train loss") for line in out.splitlines())
    assert "step 2/4" not in err and "final:" not in err


def test_raising_train_steps_announces_the_stretched_schedule(run_copy, caplog):
    with caplog.at_level("WARNING", logger="zeroflow"):
        train(config(run_copy, "train.steps=6"))
    [warning] = [r.getMessage() for r in caplog.records if r.name == "zeroflow"]
    # optax's own schedule, as the run configures it: warmup 2, cosine to 0.1 x lr.
    lr = load_config(REPO / "configs/tiny.yaml").train.lr
    old, new = (float(optax.warmup_cosine_decay_schedule(0.0, lr, 2, steps, lr * 0.1)(4))
                for steps in (4, 6))
    assert warning == (f"train.steps 4 -> 6: the learning-rate schedule follows the new settings, "
                       f"so the rate after update 4 changes from {old:.2e} to {new:.2e}")


def test_byte_level_hf_export_has_a_tokenizer_giving_our_byte_ids(finished_run, tmp_path, capsys):
    transformers = pytest.importorskip("transformers", reason="transformers is in the test extra")
    out = tmp_path / "hf"
    assert export.main(["--run", str(finished_run), "--format", "hf", "--out", str(out)]) == 0
    assert "with tokenizer.json (byte ids)" in capsys.readouterr().out
    text = "def f(x):\n\treturn x  # héllo wörld ✓ 🎉 \x00\x7f"
    want = list(text.encode("utf-8"))  # the byte tokenizer's ids
    fast = transformers.PreTrainedTokenizerFast(tokenizer_file=str(out / "tokenizer.json"))
    assert fast.encode(text) == want and fast.decode(want) == text
    auto = transformers.AutoTokenizer.from_pretrained(out)
    assert auto(text)["input_ids"] == want  # no BOS token added
    every_byte = bytes(range(256)).decode("latin-1")
    assert fast.encode(every_byte) == list(every_byte.encode("utf-8"))
    umask = os.umask(0)
    os.umask(umask)
    assert {p.name: p.stat().st_mode & 0o777 for p in out.iterdir()} == {
        p.name: 0o666 & ~umask for p in out.iterdir()}


# --- every fault in one line, and nothing half-done ----------------------------------------

def _unshare_works() -> bool:
    return shutil.which("unshare") is not None and subprocess.run(
        ["unshare", "-rm", "true"], capture_output=True).returncode == 0


needs_mount_namespace = pytest.mark.skipif(
    not _unshare_works(), reason="a full or read-only disk is made with a private mount "
    "(unshare -rm), which this machine does not allow")


def _in_private_mount(setup: str, args: list[str]) -> subprocess.CompletedProcess:
    """``python -m zeroflow.train ARGS`` after the shell commands ``setup`` in a private mount
    namespace (a tmpfs of a few hundred KB, or a folder mounted read-only)."""
    env = _cached_env()
    env.pop("ZEROFLOW_TRACEBACK", None)
    command = f'{setup} && exec "$0" -m zeroflow.train "$@"'
    return subprocess.run(["unshare", "-rm", "sh", "-c", command, sys.executable, *args],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=600)


@needs_mount_namespace
def test_disk_full_and_a_read_only_folder_each_end_in_one_line(tmp_path, finished_run):
    disk = tmp_path / "disk"
    disk.mkdir()
    run_dir = disk / "run"
    # 700 KB: the first checkpoints fit, a later one does not.
    # An asynchronous save (the default, named here): the disk fills while the files are
    # written off the training thread, and the error reaches the run when it waits for that
    # save (at the next save or the close).
    full = _in_private_mount(f"mount -t tmpfs -o size=700k tmpfs {disk}",
                             cli_args(run_dir, *EVERY_STEP_SAVED, "checkpoint.async_save=true"))
    assert full.returncode == 1, full.stderr
    line = one_line(full.stderr)
    assert line.startswith("zeroflow.train: error: no space left on device for checkpoint step ")
    assert "it needs about " in line and " bytes are free; " in line

    shutil.copytree(finished_run, run_dir)
    before = snapshot(run_dir)
    read_only = _in_private_mount(f"mount --bind {run_dir} {run_dir} && mount -o "
                                  f"remount,bind,ro {run_dir}", cli_args(run_dir, "train.steps=6"))
    assert read_only.returncode == 2, read_only.stderr
    assert one_line(read_only.stderr) == (
        f"zeroflow.train: error: run.dir {run_dir} is not writable (Read-only file system): a "
        "trainer writes its checkpoints and metrics there; make it writable or give another "
        "run.dir (sample and export only read it)")
    assert snapshot(run_dir) == before


def test_a_plot_that_fails_beside_the_run_s_error_is_not_a_second_line(tmp_path, monkeypatch,
                                                                      caplog):
    """A full disk fails the checkpoint and the last redraw of plot.png alike: the run's error
    is the one line to read, so the plot's warning is left out when the run is failing, and
    printed when the run itself went well (the control)."""
    from zeroflow.trainer import loop, reporting

    def no_space(run_dir):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(reporting, "write_plot", no_space)
    with caplog.at_level("WARNING", logger="zeroflow"):
        train(config(tmp_path / "fine", "train.steps=1", "run.plot=true"))
    assert any(r.getMessage().startswith("could not draw") for r in caplog.records)
    caplog.clear()

    def disk_full(*args, **kwargs):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(loop, "_train_steps", disk_full)
    with caplog.at_level("WARNING", logger="zeroflow"), pytest.raises(OSError):
        train(config(tmp_path / "failing", "train.steps=1", "run.plot=true"))
    assert not any("could not draw" in r.getMessage() for r in caplog.records)


def test_run_dir_that_is_a_file_stops_before_any_work(tmp_path, capsys):
    run_file = tmp_path / "runs"
    run_file.write_text("not a folder")
    assert train_cli.main(cli_args(run_file, "train.steps=2")) == 2
    assert one_line(capsys.readouterr().err) == (
        f"zeroflow.train: error: run.dir {run_file} is a file, not a folder; give a folder (it "
        "is created when missing)")
    assert train_cli.main(cli_args(run_file / "inner", "train.steps=2")) == 2
    assert f"is inside {run_file}, which is a file" in one_line(capsys.readouterr().err)
    assert run_file.read_text() == "not a folder"


def test_fp16_on_cpu_is_refused_before_any_work_naming_the_key(tmp_path, capsys):
    run_dir = tmp_path / "new" / "run"
    # XLA:CPU has no fp16 matmul with fp32 accumulation for the step's batched products: the
    # step would fail as it compiles; the config is refused before anything is built.
    assert train_cli.main(cli_args(run_dir, "train.steps=2", "precision.params=fp16")) == 2
    line = one_line(capsys.readouterr().err)
    assert "precision.params=fp16" in line and "precision.params=bf16" in line, line
    assert not (tmp_path / "new").exists()


def test_a_run_that_fails_before_its_first_checkpoint_leaves_no_folder_nor_lock(
        tmp_path, capsys, monkeypatch):
    """A failure found late (after steps ran, at the first save: a full disk, say) leaves
    nothing to resume from: the folder is removed, the lock with it; in an existing folder the
    files the run added are removed and the ones it rewrote put back."""
    def no_room(self, step, *args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(RunCheckpoints, "save", no_room)
    run_dir = tmp_path / "new" / "run"
    assert train_cli.main(cli_args(run_dir, "train.steps=2", "checkpoint.every=2")) == 1
    assert "No space left on device" in one_line(capsys.readouterr().err)
    assert not (tmp_path / "new").exists()
    existing = tmp_path / "existing"
    existing.mkdir()
    (existing / "notes.txt").write_text("mine")
    before = snapshot(existing)
    assert train_cli.main(cli_args(existing, "train.steps=2", "checkpoint.every=2")) == 1
    capsys.readouterr()
    assert snapshot(existing) == before  # no config.yaml, metrics.jsonl, tb/ nor trainer.lock


def test_a_final_evaluation_lost_to_a_kill_is_run_on_resume(run_copy, capsys):
    rows = metric_rows(run_copy)
    finals = [r for r in rows if r.get("step") == 4 and "eval_loss" in r]
    assert len(finals) == 1
    # What a kill during the final evaluation leaves: the last checkpoint, no evaluation row.
    (run_copy / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows
                                                    if r not in finals))
    assert train_cli.main(cli_args(run_copy, "train.steps=4", "checkpoint.every=2")) == 0
    assert "running its final evaluation" in capsys.readouterr().out
    again = [r for r in metric_rows(run_copy) if r.get("step") == 4 and "eval_loss" in r]
    assert [r["eval_loss"] for r in again] == [finals[0]["eval_loss"]]
    assert train_cli.main(cli_args(run_copy, "train.steps=4", "checkpoint.every=2")) == 0
    assert "nothing to do" in capsys.readouterr().out


RAISING_TEMPLATE = "{% for m in messages %}{{ m['content'] }}{{ 1 // (m['content'] | length - 3) }}{% endfor %}"
"Divides by zero on a message of three characters: a fault of the template, not the record."


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    from helpers import load_script
    folder = tmp_path_factory.mktemp("tokenizer")
    load_script("make_tiny_hf").train_tokenizer(folder, vocab_size=300, max_bytes=100_000)
    return folder


def _records_args(tmp_path, source, tokenizer, *extra):
    return [f"data.source={source}", "data.format=chat", f"data.tokenizer={tokenizer}",
            "data.val_fraction=0", "model.seq_len=64", f"run.dir={tmp_path / 'run'}",
            "run.progress=false", "train.steps=2", *extra]


def _chat(content):
    return json.dumps({"messages": [{"role": "user", "content": content},
                                    {"role": "assistant", "content": "fine"}]})


def test_bad_data_ends_in_one_line_naming_file_and_line(tmp_path, tokenizer_dir, capsys):
    from zeroflow.config.schema import DataConfig
    from zeroflow.data import load_data
    source = tmp_path / "chat.jsonl"
    good = [_chat(f"question {i}") for i in range(6)]
    source.write_bytes("\n".join(good[:2]).encode() + b"\n" + _chat("cafX").encode().replace(b"cafX", b"caf\xe9")
                       + b"\n" + "\n".join(good[2:]).encode() + b"\n")
    assert train_cli.main(_records_args(tmp_path, source, tokenizer_dir,
                                        "data.bad_records=stop")) == 2
    line = one_line(capsys.readouterr().err)
    assert "bad record at chat.jsonl line 3: not UTF-8 (byte 0xe9 at byte " in line
    skipped = load_data(DataConfig(source=str(source), format="chat", tokenizer=str(tokenizer_dir),
                                   val_fraction=0, bad_records="skip"), 64)
    assert (skipped.records, len(skipped.train)) == (7, 6)
    assert "1 not UTF-8 (first: chat.jsonl line 3: byte 0xe9" in skipped.summary()

    # Only malformed lines: one line, counted by kind, the first example of each.
    junk = tmp_path / "junk.jsonl"
    junk.write_text("".join(f"{'{' * (i % 7 + 1)}\n" for i in range(20)) + "[1]\nnot json\n")
    assert train_cli.main(_records_args(tmp_path, junk, tokenizer_dir)) == 2
    line = one_line(capsys.readouterr().err)
    assert ("skipped 22 bad records: 21 invalid JSON (first: junk.jsonl line 1: Expecting "
            "property name enclosed in double quotes at column 1); 1 not a JSON object (first: "
            "junk.jsonl line 21: list)") in line and len(line) < 400

    template_dir = tmp_path / "template-tokenizer"
    shutil.copytree(tokenizer_dir, template_dir)
    (template_dir / "chat_template.jinja").write_text(RAISING_TEMPLATE)
    source.write_text("\n".join([_chat("first"), _chat("abc"), _chat("last")]) + "\n")
    assert train_cli.main(_records_args(tmp_path, source, template_dir, "data.train_on=all")) == 2
    assert one_line(capsys.readouterr().err) == (
        f"zeroflow.train: error: chat template {template_dir / 'chat_template.jinja'} raised "
        "ZeroDivisionError: integer division or modulo by zero on the record at chat.jsonl "
        f"line 2 (record 1 of {source}); fix the template")
    assert not (tmp_path / "run").exists()


def test_a_checkpoint_past_the_file_size_limit_is_one_line_and_leaves_nothing_half_written(
        tmp_path, finished_run):
    # EFBIG, the other way a write runs out of room: a process file-size limit (ulimit -f)
    # below the checkpoint's largest array (the embedding's fp32 master weights, 32,768 bytes
    # here), which lands whole in one data file however Orbax groups arrays into files (its
    # grouping varies from save to save: one step's largest file was 167 KB, the next one's
    # 93 KB, under an earlier 100 KB limit), but above every other file the run writes (plot
    # and TensorBoard off; the largest, the checkpoint's _METADATA, ~14 KB).
    import resource
    run_dir = tmp_path / "run"
    shutil.copytree(finished_run, run_dir)
    shutil.rmtree(run_dir / "checkpoints" / "4")  # killed before its last save: resumes at 2
    before = snapshot(run_dir / "checkpoints")

    def limit_file_size():
        resource.setrlimit(resource.RLIMIT_FSIZE, (20_000, 20_000))

    # Without the suite's shared compilation cache: its entries (~50 KB) would meet the limit
    # first, and jax warns about each one it cannot write.
    env = one_cpu_env(JAX_ENABLE_COMPILATION_CACHE="false")
    env.pop("ZEROFLOW_TRACEBACK", None)
    done = subprocess.run(
        [sys.executable, "-m", "zeroflow.train",
         *cli_args(run_dir, "train.steps=4", "checkpoint.every=2", "run.plot=false",
                   "run.tensorboard=false", "checkpoint.async_save=true")],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=600,
        preexec_fn=limit_file_size)
    assert done.returncode == 1, done.stderr
    line = one_line(done.stderr)
    assert line.startswith("zeroflow.train: error: a file larger than the file-size limit "
                           f"allows (ulimit -f, or the file system's) for checkpoint step 4 in "
                           f"{run_dir / 'checkpoints'}: it needs about "), line
    assert "raise the file-size limit" in line and "resume from step 2" in line
    assert snapshot(run_dir / "checkpoints") == before  # step 4 gone whole, step 2 untouched


def _as_a_user(args: list[str]) -> subprocess.CompletedProcess:
    """``python -m zeroflow.<args>`` without the power to bypass file permissions: root runs
    it in a user namespace of its own (no capabilities over this machine's files)."""
    prefix = ["unshare", "-U"] if os.geteuid() == 0 else []
    env = _cached_env()
    env.pop("ZEROFLOW_TRACEBACK", None)
    return subprocess.run([*prefix, sys.executable, "-m", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=600)


@pytest.mark.skipif(os.geteuid() == 0 and subprocess.run(
    ["unshare", "-U", "true"], capture_output=True).returncode != 0,
    reason="root without user namespaces (unshare -U) cannot be refused a file")
def test_a_step_that_cannot_be_read_for_permissions_falls_back(run_copy, tmp_path):
    state = run_copy / "checkpoints" / "4" / "state"
    state.chmod(0)
    try:
        out = tmp_path / "w.npz"
        done = _as_a_user(["zeroflow.export", "--run", str(run_copy), "--out", str(out)])
        assert done.returncode == 0 and "from step 2 to" in done.stdout, done.stderr
        warning = one_line(done.stderr)
        assert "checkpoints/4/state" in warning and "Permission denied" in warning
        # A checkpoints/ that cannot be changed: the damaged step stays, and the trainer, which
        # could not save there, says so before training.
        (run_copy / "checkpoints").chmod(0o555)
        done = _as_a_user(["zeroflow.train", *cli_args(run_copy, "train.steps=6",
                                                        "checkpoint.every=2")])
        lines = done.stderr.strip().splitlines()
        assert done.returncode == 2 and len(lines) == 2, done.stderr
        assert "could not move it aside" in lines[0] and "resuming from step 2" in lines[0]
        assert lines[1] == (f"zeroflow.train: error: {run_copy / 'checkpoints'} is not writable "
                            "(Permission denied): the run cannot save there; make it writable "
                            "and run the same command to resume from its newest readable step")
    finally:
        (run_copy / "checkpoints").chmod(0o755)
        state.chmod(0o755)
    assert sorted(p.name for p in (run_copy / "checkpoints").iterdir()) == ["2", "4"]


# --- faults while an asynchronous save is in flight ----------------------------------------

def _spawn_held(step: int, tmp_path: Path, args: list[str]):
    marker, release = tmp_path / "held", tmp_path / "release"
    proc = subprocess.Popen([sys.executable, str(REPO / "tests" / "hold_in_save.py"), str(step),
                             str(marker), str(release), *args], cwd=REPO, env=_cached_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    return proc, marker, release


def _wait_for(condition, proc, timeout_s=600.0):
    """Until ``condition()``; a run that ends first, or never gets there, fails the test (and
    is not left held)."""
    start = time.monotonic()
    while not condition():
        if proc.poll() is not None or time.monotonic() - start > timeout_s:
            proc.kill()
            pytest.fail(f"the held run did not get there: {proc.communicate()}")
        time.sleep(0.01)


def test_kill_9_while_an_async_save_is_in_flight_resumes_bit_identically(tmp_path):
    """The save of step 3 holds (its files written, its digests not yet) while the run trains
    step 4, which only an asynchronous save allows; kill -9 then. The resume never loads the
    half-finished step 3: it goes back to step 2 and ends where an uninterrupted run ends."""
    common = [*EVERY_STEP_SAVED, "checkpoint.keep=2"]
    straight = _spawn(cli_args(tmp_path / "straight", *common))
    assert straight.wait(timeout=600) == 0, straight.communicate()[1]
    run_dir = tmp_path / "faulty"
    proc, marker, _ = _spawn_held(3, tmp_path, cli_args(run_dir, *common))
    _wait_for(lambda: marker.exists() and _logged_steps(run_dir) >= 4, proc)
    proc.send_signal(signal.SIGKILL)
    proc.communicate(timeout=600)
    resumed = _spawn(cli_args(run_dir, *common))
    out, err = resumed.communicate(timeout=600)
    assert resumed.returncode == 0, err
    assert "resumed from step 2" in out and "checkpoints/3/zeroflow_manifest.json is missing" in err
    for want, got in zip(stored_arrays(tmp_path / "straight" / "checkpoints" / "8"),
                         stored_arrays(run_dir / "checkpoints" / "8"), strict=True):
        np.testing.assert_array_equal(got, want)
    assert [r["step"] for r in metric_rows(run_dir) if "loss" in r] == list(range(1, 9))


def test_sigterm_while_an_async_save_is_in_flight_completes_it_and_saves_again(tmp_path):
    """SIGTERM lands while step 3's save is in flight: the run waits for it, saves the step it
    stopped at, and ends in one line; every step it left is complete with its digests."""
    run_dir = tmp_path / "run"
    proc, marker, release = _spawn_held(3, tmp_path, cli_args(run_dir, *EVERY_STEP_SAVED))
    _wait_for(lambda: marker.exists() and _logged_steps(run_dir) >= 4, proc)
    proc.send_signal(signal.SIGTERM)
    release.touch()
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 128 + signal.SIGTERM, err
    [last] = [line for line in out.splitlines() if line.startswith("SIGTERM")]
    stopped_at = int(last.split("checkpoint at step ")[1].split(";")[0])
    assert stopped_at >= 4 and "Traceback" not in err
    steps = sorted(int(p.name) for p in (run_dir / "checkpoints").iterdir() if p.name.isdigit())
    assert steps[-1] == stopped_at and 3 in steps
    for step in steps:
        assert checkpoint_digests.verify(run_dir / "checkpoints" / str(step), expected=True)
