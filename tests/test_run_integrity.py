"""Checkpoints prove their integrity (a digest of every file, checked before reading), and one
trainer at a time holds a run folder (docs/runs.md)."""
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import optax
import pytest

import zeroflow as zf
from zeroflow.engine import checkpoint_digests
from zeroflow.cli import export
from zeroflow.cli import train as train_cli
from zeroflow.engine.checkpoint import CheckpointError
from zeroflow.trainer import build_run, run_folder
from zeroflow.trainer.checkpoints import RunCheckpoints, UnreadableCheckpoint
from fixtures import init_params
from test_run_faults import (LEAKS, REPO, SMALL, _logged_steps, _spawn, cli_args, config,  # noqa: F401
                             finished_run, metric_rows, run_copy, stored_arrays)



def flip_one_bit(path: Path, rng: random.Random) -> None:
    data = bytearray(path.read_bytes())
    bit = rng.randrange(len(data) * 8)
    data[bit // 8] ^= 1 << (bit % 8)
    path.write_bytes(bytes(data))


def files_of(step_dir: Path) -> list[Path]:
    return sorted(p for p in step_dir.rglob("*") if p.is_file())


def stderr_lines(err: str) -> list[str]:
    lines = err.strip().splitlines()
    assert len(lines) <= 3 and not any(leak in err for leak in LEAKS), err
    return lines


@pytest.mark.slow
def test_one_flipped_bit_in_any_file_of_a_checkpoint_is_detected(run_copy):
    step_dir = run_copy / "checkpoints" / "4"
    files = files_of(step_dir)
    assert step_dir / checkpoint_digests.MANIFEST in files and len(files) > 10
    like = build_run(config(run_copy, "train.steps=4")).abstract_state()
    checkpoints = RunCheckpoints(run_copy / "checkpoints", 3, read_only=True)
    rng = random.Random(32)
    for file in files:
        original = file.read_bytes()
        flip_one_bit(file, rng)
        with pytest.raises(UnreadableCheckpoint) as caught:
            checkpoints.restore(4, like)
        message = str(caught.value)
        assert message.startswith("checkpoint step 4 is unreadable: ") and "\n" not in message
        assert str(file.relative_to(run_copy)) in message, message
        file.write_bytes(original)
    assert int(checkpoints.restore(4, like)[0].step) == 4  # all put back: it reads again


@pytest.mark.slow
def test_a_flipped_bit_makes_export_and_resume_fall_back_and_the_run_ends_bit_identical(
        run_copy, tmp_path, caplog, capsys):
    uninterrupted = stored_arrays(run_copy / "checkpoints" / "4")
    rng = random.Random(7)
    damaged = rng.choice(files_of(run_copy / "checkpoints" / "4"))
    flip_one_bit(damaged, rng)
    shown = str(damaged.relative_to(run_copy))

    out = tmp_path / "w.npz"
    proc = subprocess.run([sys.executable, "-m", "zeroflow.export", "--run", str(run_copy), "--out",
                           str(out)], cwd=REPO, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.returncode == 0, proc.stderr
    [warning] = stderr_lines(proc.stderr)
    assert "checkpoint step 4 is unreadable: " in warning and shown in warning, warning
    assert "using step 2, the newest readable one" in warning
    assert "from step 2 to" in proc.stdout
    assert (run_copy / "checkpoints" / "4").is_dir()  # readers move nothing

    # Resumed in this process: the same devices and compiler settings as the run that saved
    # the uninterrupted checkpoint, so its arrays must come out bit for bit the same.
    with caplog.at_level("WARNING", logger="zeroflow"):
        assert train_cli.main(cli_args(run_copy, "train.steps=4", "checkpoint.every=2")) == 0
    assert not capsys.readouterr().err.strip()
    [warning] = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert warning.startswith("checkpoint step 4 is unreadable: " + shown)
    assert "moved it to checkpoints/4.corrupt, resuming from step 2" in warning
    for got, want in zip(stored_arrays(run_copy / "checkpoints" / "4"), uninterrupted, strict=True):
        np.testing.assert_array_equal(got, want)
    logged = [r["step"] for r in metric_rows(run_copy) if "loss" in r]
    assert logged == [1, 2, 3, 4]


@pytest.mark.slow
@pytest.mark.parametrize("reader", ["sample", "export"])
def test_readers_of_a_sound_run_print_no_warnings(finished_run, tmp_path, reader):
    """Fresh processes, as a user runs them: Orbax's read-only manager notes 'Given directory is
    read only' (absl WARNING) and XLA may log 'Invalid stack_frame_id'; neither is the user's to
    act on, so a sound run's readers print nothing else there."""
    args = (["--tokens", "2", "--prompt", "def "] if reader == "sample"
            else ["--out", str(tmp_path / "w.npz")])
    proc = subprocess.run([sys.executable, "-m", f"zeroflow.{reader}", "--run", str(finished_run),
                           *args], cwd=REPO, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.returncode == 0, proc.stderr
    assert "read only" not in proc.stderr and "stack_frame_id" not in proc.stderr, proc.stderr
    # sample names the step it read on stderr (its stdout is the text alone); export on stdout
    assert proc.stderr == ("[step 4]\n" if reader == "sample" else ""), proc.stderr
    assert reader == "sample" or "from step 4 to" in proc.stdout


def _strip_digests(step_dir: Path) -> None:
    """The step as saved before checkpoints had digests: no manifest, no mark in its meta."""
    (step_dir / checkpoint_digests.MANIFEST).unlink(missing_ok=True)
    meta = json.loads((step_dir / "meta" / "metadata").read_text())
    del meta["digests"]
    (step_dir / "meta" / "metadata").write_text(json.dumps(meta))


@pytest.mark.slow
def test_a_step_without_digests_loads_only_in_a_run_without_any(run_copy, caplog):
    step_dir = run_copy / "checkpoints" / "4"
    like = build_run(config(run_copy, "train.steps=4")).abstract_state()
    checkpoints = RunCheckpoints(run_copy / "checkpoints", 3, read_only=True)
    (step_dir / checkpoint_digests.MANIFEST).unlink()
    with pytest.raises(UnreadableCheckpoint, match="zeroflow_manifest.json is missing "
                                                   r"\(the save did not finish\)"):
        checkpoints.restore(4, like)
    _strip_digests(step_dir)
    # Step 2 has its digests: step 4 lost them (or is not this run's), so it is not trusted.
    with pytest.raises(UnreadableCheckpoint, match="has no digests while other steps of this "
                       "run have them .*checkpoint.allow_unverified=true"):
        checkpoints.restore(4, like)
    allowing = RunCheckpoints(run_copy / "checkpoints", 3, read_only=True, allow_unverified=True)
    with caplog.at_level("WARNING", logger="zeroflow"):
        assert int(allowing.restore(4, like)[0].step) == 4
    assert [r.getMessage() for r in caplog.records if r.name == "zeroflow"] == [
        f"checkpoint step 4 in {run_copy / 'checkpoints'} has no digests "
        "(checkpoint.allow_unverified=true): loaded unverified"]
    caplog.clear()
    _strip_digests(run_copy / "checkpoints" / "2")  # a run from before digests: none has them
    with caplog.at_level("WARNING", logger="zeroflow"):
        assert int(checkpoints.restore(4, like)[0].step) == 4
    assert [r.getMessage() for r in caplog.records if r.name == "zeroflow"] == [
        f"checkpoint step 4 in {run_copy / 'checkpoints'} has no digests (saved before zeroflow "
        "recorded them): loaded unverified"]


@pytest.mark.slow
def test_a_damaged_step_stripped_of_its_digests_is_not_loaded_by_export_or_resume(
        run_copy, tmp_path, capsys, caplog):
    step_dir = run_copy / "checkpoints" / "4"
    _strip_digests(step_dir)
    flip_one_bit(max(files_of(step_dir / "state"), key=lambda p: p.stat().st_size),
                 random.Random(0))
    out = tmp_path / "w.npz"
    with caplog.at_level("WARNING", logger="zeroflow"):
        assert export.main(["--run", str(run_copy), "--out", str(out)]) == 0
    assert "from step 2 to" in capsys.readouterr().out
    assert "has no digests while other steps" in caplog.text
    # The resume moves it aside and trains from step 2, as for any damaged step.
    assert train_cli.main(cli_args(run_copy, "train.steps=4", "checkpoint.every=2")) == 0
    assert (run_copy / "checkpoints" / "4.corrupt").is_dir()
    assert "resumed from step 2" in capsys.readouterr().out


@pytest.mark.slow
def test_engine_checkpoints_carry_digests_too(tmp_path):
    plan = zf.ZeroPlan(zf.make_mesh(data=-1, model=1), stage=2)
    state = zf.init_train_state(init_params(), optax.adam(1e-3), plan, zf.Precision(params="fp32"))
    path = zf.save_checkpoint(tmp_path / "ckpt", state)
    data_file = max((p for p in files_of(path) if p.parent.name == "d"), key=lambda p: p.stat().st_size)
    original = data_file.read_bytes()
    flip_one_bit(data_file, random.Random(0))
    with pytest.raises(CheckpointError, match="does not match its sha256 digest"):
        zf.restore_checkpoint(path, state)
    data_file.write_bytes(original)
    restored = zf.restore_checkpoint(path, state)
    for got, want in zip(jax_leaves(restored.master_params), jax_leaves(state.master_params)):
        np.testing.assert_array_equal(got, want)


def jax_leaves(tree):
    import jax
    return [np.asarray(x) for x in jax.tree.leaves(tree)]


# --- one trainer per run folder -----------------------------------------------------------

@pytest.mark.slow
def test_a_second_trainer_refuses_in_one_line_while_export_reads_the_run(tmp_path, capsys):
    run_dir = tmp_path / "run"
    first = _spawn(cli_args(run_dir, "train.steps=100000", "checkpoint.every=2",
                            "train.eval_batches=0"))
    try:
        while first.poll() is None and not (run_dir / "checkpoints" / "2").is_dir():
            time.sleep(0.05)
        assert first.poll() is None, first.communicate()[1]
        assert train_cli.main(cli_args(run_dir, "train.steps=100000")) == 2
        [line] = stderr_lines(capsys.readouterr().err)
        assert line == (f"zeroflow.train: error: run.dir {run_dir} is in use by another trainer "
                        f"(pid {first.pid}); wait for it to finish or stop it, or give another "
                        "run.dir (sample and export may read it meanwhile)")
        assert export.main(["--run", str(run_dir), "--out", str(tmp_path / "w.npz")]) == 0
        assert "fp32 parameters from step" in capsys.readouterr().out
    finally:
        first.send_signal(signal.SIGTERM)
        _, err = first.communicate(timeout=600)
    assert first.returncode == 128 + signal.SIGTERM, err
    logged = [r["step"] for r in metric_rows(run_dir) if "loss" in r]
    assert logged == list(range(1, len(logged) + 1)) and _logged_steps(run_dir) == len(logged)
    assert not (run_dir / run_folder.LOCK_FILE).exists()  # removed when the run ends


@pytest.mark.slow
def test_the_lock_of_a_killed_trainer_is_never_stale(tmp_path):
    run_dir = tmp_path / "run"
    holder = subprocess.run(
        [sys.executable, "-c", "import os, sys; from pathlib import Path; "
         "from zeroflow.trainer.run_folder import claim\n"
         "with claim(Path(sys.argv[1])):\n    os.kill(os.getpid(), 9)", str(run_dir)],
        cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, text=True)
    assert holder.returncode == -signal.SIGKILL, holder.stderr
    lock = run_dir / run_folder.LOCK_FILE
    assert lock.read_text().strip().isdigit()  # left behind by kill -9, with its pid
    with run_folder.claim(run_dir):  # the kernel released the lock: taken at once
        with pytest.raises(run_folder.RunFolderInUse, match=f"pid {os.getpid()}"):
            with run_folder.claim(run_dir):
                pass


@pytest.mark.slow
def test_a_reader_lists_again_when_a_running_trainer_deletes_the_step_it_chose(run_copy,
                                                                               monkeypatch):
    # What a reader of a live run meets: it lists steps [2], the trainer saves 4 and deletes 2
    # (checkpoint.keep) before the reader opens it. The reader must read step 4, not report
    # the run as unreadable (it did, under load, while export read a training run).
    from zeroflow.cli.sample import load_run_params

    step4, held = run_copy / "checkpoints" / "4", run_copy.parent / "held-4"
    step4.rename(held)  # the reader's listing sees only step 2
    real_restore = RunCheckpoints.restore

    def trainer_moves_on(self, step, like, loader=None):
        if step == 2 and held.exists():  # saved 4, deleted 2, while the reader held the list
            held.rename(step4)
            shutil.rmtree(run_copy / "checkpoints" / "2")
        return real_restore(self, step, like, loader)
    monkeypatch.setattr(RunCheckpoints, "restore", trainer_moves_on)
    _, _, step = load_run_params(run_copy)
    assert step == 4 and not held.exists()


@pytest.mark.fast
def test_each_process_hashes_the_files_it_wrote_and_process_0_merges_the_parts(tmp_path):
    import hashlib
    files = {"state/_METADATA": b"meta", "state/ocdbt.process_0/d/a": b"zero" * 100,
             "state/ocdbt.process_1/d/b": b"one" * 100, "state/array_metadatas/process_1": b"m1",
             "meta/metadata": b"{}"}
    for name, data in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_bytes(data)
    part = checkpoint_digests.write_part(tmp_path, 1, 2)
    assert sorted(json.loads(part.read_text())) == ["state/array_metadatas/process_1",
                                                     "state/ocdbt.process_1/d/b"]
    checkpoint_digests.write_manifest(tmp_path, 2)
    entries = json.loads((tmp_path / checkpoint_digests.MANIFEST).read_text())["files"]
    assert {k: v["sha256"] for k, v in entries.items()} == {
        k: hashlib.sha256(v).hexdigest() for k, v in files.items()}
    assert not part.exists()
    # Each process checks its own files; a change in process 1's is found by process 1 alone.
    (tmp_path / "state/ocdbt.process_1/d/b").write_bytes(b"onf" + b"one" * 99)
    assert checkpoint_digests.verify(tmp_path, expected=True, process=0, process_count=2)
    with pytest.raises(checkpoint_digests.DigestMismatch, match="ocdbt.process_1/d/b"):
        checkpoint_digests.verify(tmp_path, expected=True, process=1, process_count=2)


@pytest.mark.slow
def test_a_flipped_bit_in_another_process_s_files_is_found_by_a_two_process_resume(tmp_path):
    """2 processes: process 1's arrays are hashed by process 1 (its part of the manifest); on
    resume each process checks its own files, and a flipped bit in process 1's makes both
    processes treat the step as damaged and resume from the step before."""
    args = ["-m", "zeroflow.launch", "--processes", "2", "--cpu-devices", "2", "--",
            sys.executable, "-m", "zeroflow.train", "--config", str(REPO / "configs/tiny.yaml"),
            *SMALL, "parallel.zero_stage=3", "checkpoint.every=2", f"run.dir={tmp_path / 'run'}"]
    env = {**os.environ, "PYTHONPATH": str(REPO), "JAX_PLATFORMS": "cpu"}
    first = subprocess.run([sys.executable, *args, "train.steps=4"], cwd=REPO, env=env,
                           capture_output=True, text=True, timeout=600)
    assert first.returncode == 0, first.stderr
    step4 = tmp_path / "run" / "checkpoints" / "4"
    assert not list(step4.glob(checkpoint_digests.PART + "*"))  # merged into the manifest
    flip_one_bit(sorted((step4 / "state" / "ocdbt.process_1" / "d").iterdir())[0],
                 random.Random(1))
    resumed = subprocess.run([sys.executable, *args, "train.steps=6"], cwd=REPO, env=env,
                             capture_output=True, text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stderr
    text = resumed.stdout + resumed.stderr
    assert "checkpoint step 4 is unreadable: checkpoints/4/state/ocdbt.process_1/d/" in text
    assert "does not match its sha256 digest" in text and "resuming from step 2" in text
    assert (tmp_path / "run" / "checkpoints" / "4.corrupt").is_dir()
    assert checkpoint_digests.verify(tmp_path / "run" / "checkpoints" / "6", expected=True)


@pytest.mark.slow
def test_checkpoints_elsewhere_than_the_run_folder_are_found_by_resume_and_export(tmp_path,
                                                                                 capsys):
    run_dir, elsewhere = tmp_path / "run", tmp_path / "shared" / "ckpt"
    common = ("checkpoint.every=2", f"checkpoint.dir={elsewhere}")
    assert train_cli.main(cli_args(run_dir, "train.steps=2", *common)) == 0
    assert not (run_dir / "checkpoints").exists()
    assert checkpoint_digests.verify(elsewhere / "2", expected=True)
    assert train_cli.main(cli_args(run_dir, "train.steps=4", *common)) == 0
    assert "resumed from step 2" in capsys.readouterr().out
    assert export.main(["--run", str(run_dir), "--out", str(tmp_path / "w.npz")]) == 0
    assert "from step 4 to" in capsys.readouterr().out


@pytest.mark.slow
def test_saves_that_never_finished_start_the_run_again_damage_does_not(run_copy, caplog):
    """A kill while the first saves were in flight leaves steps without their manifest: the run
    never had a finished checkpoint, so a resume starts from step 0 (the unfinished steps moved
    aside, one warning each). A finished step whose bytes differ is damage: no readable step,
    the resume refuses and moves nothing."""
    like = build_run(config(run_copy, "train.steps=4")).abstract_state()
    folder = run_copy / "checkpoints"
    steps = RunCheckpoints(folder, 3).steps()
    damaged = run_copy.parent / "damaged"
    shutil.copytree(run_copy, damaged)
    for step in steps:
        (folder / str(step) / checkpoint_digests.MANIFEST).unlink()
    with caplog.at_level("WARNING", logger="zeroflow"):
        assert RunCheckpoints(folder, 3).restore_latest(like) is None
    assert RunCheckpoints(folder, 3).steps() == []
    warned = [r.getMessage() for r in caplog.records if r.name == "zeroflow"]
    assert len(warned) == len(steps) and all("starting from step 0" in w for w in warned)

    rng = random.Random(5)
    for step in steps:
        flip_one_bit(files_of(damaged / "checkpoints" / str(step))[-1], rng)
    with pytest.raises(CheckpointError, match="no readable checkpoint"):
        RunCheckpoints(damaged / "checkpoints", 3).restore_latest(like)
    assert RunCheckpoints(damaged / "checkpoints", 3).steps() == steps


def _train_with(processes: int, run_dir: Path, *overrides) -> subprocess.CompletedProcess:
    """``python -m zeroflow.train`` on the tiny config, in one process or launched as
    ``processes`` local ones over gloo (2 CPU devices each)."""
    command = (["-m", "zeroflow.train", "--cpu-devices", "2"] if processes == 1 else
               ["-m", "zeroflow.launch", "--processes", str(processes), "--cpu-devices", "2",
                "--", sys.executable, "-m", "zeroflow.train"])
    env = {**os.environ, "PYTHONPATH": str(REPO), "JAX_PLATFORMS": "cpu"}
    env.pop("ZEROFLOW_TRACEBACK", None)
    return subprocess.run([sys.executable, *command, "--config", str(REPO / "configs/tiny.yaml"),
                           *SMALL, "parallel.zero_stage=3", "checkpoint.every=2",
                           f"run.dir={run_dir}", *overrides],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=600)


def _folder(path: Path) -> dict[str, bytes]:
    return {str(p.relative_to(path)): p.read_bytes() if p.is_file() else b"<dir>"
            for p in sorted(path.rglob("*"))}


@pytest.mark.slow
@pytest.mark.parametrize("saved_by,resumed_by", [(2, 1), (1, 2)])
def test_a_checkpoint_saved_by_another_process_count_is_refused_in_one_line(
        tmp_path, saved_by, resumed_by):
    """Each process of a multi-process save wrote and digested its own part of the step: a
    trainer with another number of processes refuses to resume it, in one line naming the step
    and both counts (exit 2, every process alike), and leaves the run folder byte for byte as
    it was: nothing moved aside as damaged, no config, metrics or lock written."""
    run_dir = tmp_path / "run"
    first = _train_with(saved_by, run_dir, "train.steps=2")
    assert first.returncode == 0, first.stderr
    before = _folder(run_dir)
    assert "checkpoints/2/zeroflow_manifest.json" in before
    resumed = _train_with(resumed_by, run_dir, "train.steps=4")
    assert resumed.returncode == 2, resumed.stdout + resumed.stderr
    wanted = (f"checkpoint step 2 in {run_dir / 'checkpoints'} was saved by a run of {saved_by} "
              f"process{'es' if saved_by > 1 else ''} and this run has {resumed_by}: ")
    errors = [line for line in resumed.stderr.splitlines() if "error" in line]
    assert errors and all(wanted in line for line in errors), resumed.stderr
    assert len(errors) <= resumed_by and not any(leak in resumed.stderr for leak in LEAKS)
    assert f"resume it with {saved_by} (python -m zeroflow.launch --processes {saved_by})" \
        in errors[0]
    assert _folder(run_dir) == before
