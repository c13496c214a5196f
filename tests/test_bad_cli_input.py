"""Flags and files the CLIs must refuse in one line (exit 2), before any work: each case was
once accepted silently or answered with a raw error or a usage block."""

import pytest

from helpers import REPO
from zeroflow.cli import export, memory, planner, sample, train
from zeroflow.data.corpus import iter_documents

pytestmark = pytest.mark.fast


def _one_error_line(capsys, code) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2, err
    assert len(err) == 1, err  # no usage block, no traceback
    assert ": error: " in err[0]
    return err[0]


def _exit_code(main, argv):
    try:
        return main(argv)
    except SystemExit as e:  # argparse ends the process itself
        return e.code


@pytest.mark.parametrize("main, argv, named", [
    (train.main, ["--cpu-devices", "-1"], "--cpu-devices"),
    (train.main, ["--cpu-devices", "0"], "--cpu-devices"),
    (sample.main, ["--run", "nowhere", "--temperature", "-1"], "--temperature"),
    (sample.main, ["--run", "nowhere", "--temperature", "nan"], "--temperature"),
    (sample.main, ["--run", "nowhere", "--tokens", "0"], "--tokens"),
    (sample.main, ["--run", "nowhere", "--top-k", "-3"], "--top-k"),
    (export.main, ["--run", "nowhere", "--out", "w.npz", "--step", "-2"], "--step"),
    (memory.main, ["--no-such-flag"], "--no-such-flag"),
    (memory.main, ["--device-memory", "0"], "--device-memory"),
    (memory.main, ["--devices-per-process", "0"], "--devices-per-process"),
    (memory.main, ["--devices", "0"], "--devices"),
    (memory.main, ["--max-seq", "--seq-step", "-1"], "--seq-step"),
    (memory.main, ["--max-seq", "--seq-step", "0"], "--seq-step"),
    (memory.main, ["--max-seq", "--max-compiles", "0"], "--max-compiles"),
    (memory.main, ["--max-seq", "--seq-limit", "-5"], "--seq-limit"),
    (memory.main, ["--max-seq", "--max-compiles", "1"], "--max-compiles"),
    (memory.main, ["--max-seq", "--seq-step", "4096", "--seq-limit", "1024"], "--seq-limit"),
    (planner.main, ["--gpus", "h100", "--devices", "1", "--grad-accums", "0"], "--grad-accums"),
    (planner.main, ["--devices", "0"], "--devices"),
    (planner.main, ["--devices", "1,x"], "--devices"),
    (planner.main, ["--min-compiles", "5", "--max-compiles", "1"], "--min-compiles"),
    (planner.main, ["--max-compiles", "0"], "--max-compiles"),
    (planner.main, ["--device-memory", "0"], "--device-memory"),
    (planner.main, ["--stages", "4"], "--stages"),
    (planner.main, ["--margin", "1.5"], "--margin"),
], ids=["cpu-devices-negative", "cpu-devices-zero", "temperature-negative", "temperature-nan",
        "tokens-zero", "top-k-negative", "export-step-negative", "memory-unknown-flag",
        "memory-device-memory-zero", "memory-devices-per-process-zero", "memory-devices-zero",
        "memory-seq-step-negative", "memory-seq-step-zero", "memory-max-compiles-zero",
        "memory-seq-limit-negative", "memory-max-compiles-one", "memory-seq-limit-below-step",
        "planner-grad-accums-zero", "planner-devices-zero",
        "planner-devices-not-int", "planner-min-above-max-compiles", "planner-max-compiles-zero",
        "planner-device-memory-zero", "planner-stage-4", "planner-margin-above-1"])
def test_a_bad_flag_is_one_line_naming_it(main, argv, named, capsys):
    line = _one_error_line(capsys, _exit_code(main, argv))
    assert named in line


def test_the_planner_refuses_an_out_that_is_a_file_before_any_work(tmp_path, capsys):
    out = tmp_path / "plans"
    out.write_text("keep me")
    line = _one_error_line(capsys, _exit_code(planner.main, [
        "--config", str(REPO / "configs/tiny.yaml"), "--gpus", "h100", "--out", str(out)]))
    assert "--out" in line and "is a file" in line and line.startswith("zeroflow.planner: ")
    assert out.read_text() == "keep me"


def test_a_config_that_is_not_text_names_the_file(tmp_path, capsys):
    config = tmp_path / "weights.yaml"
    config.write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00")
    line = _one_error_line(capsys, _exit_code(train.main, ["--config", str(config)]))
    assert str(config) in line and "UTF-8" in line


def test_export_to_an_existing_file_as_a_folder_writes_nothing(tmp_path, capsys):
    out = tmp_path / "taken"
    out.write_text("keep me")
    run = REPO / "no-run-needed"  # the flag is checked before the run is read
    line = _one_error_line(capsys, _exit_code(export.main, [
        "--run", str(run), "--format", "hf", "--out", str(out)]))
    assert str(out) in line and "is a file" in line
    assert out.read_text() == "keep me" and sorted(tmp_path.iterdir()) == [out]


def test_a_lone_data_file_that_is_not_utf8_is_an_error_naming_it(tmp_path):
    data = tmp_path / "corpus.txt"
    data.write_bytes("caf\u00e9 ".encode("latin-1") * 100)
    with pytest.raises(ValueError, match="corpus.txt is not readable UTF-8"):
        list(iter_documents(data, val_fraction=0.1))


def test_a_failed_run_ends_on_its_one_line_though_writes_were_left_pending(tmp_path):
    # A checkpoint that runs out of room leaves the array writes it had started as coroutines
    # nobody awaits; Python reports each at exit ("sys:1: RuntimeWarning: coroutine ... was never
    # awaited") under the error line unless the command drops them.
    import subprocess
    import sys

    program = tmp_path / "pending.py"
    program.write_text(
        "import argparse, errno\n"
        "from zeroflow.cli.common import run_cli\n"
        "async def write_fragment():\n"
        "    pass\n"
        "class Save:\n"
        "    pass\n"
        "def main(args):\n"
        "    save = Save()\n"
        "    save.pending, save.itself = write_fragment(), save  # a cycle: freed at exit\n"
        "    raise OSError(errno.EFBIG, 'File too large')\n"
        "raise SystemExit(run_cli('zeroflow.train', main, argparse.ArgumentParser(), []))\n")
    done = subprocess.run([sys.executable, str(program)], cwd=REPO, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 1
    assert done.stderr.strip().splitlines() == ["zeroflow.train: error: [Errno 27] File too large"]
