"""Ctrl-C (SIGINT) at any moment of ``python -m zeroflow.train``: while jax imports, while the
run is built and compiled, while it trains and while it closes. Each ends with exit 130 and one
line, no traceback, and the run resumed with the same command ends exactly as an uninterrupted
one (a start stopped leaves no folder behind, so its rerun is the uninterrupted run itself). These four moments sample the 20 of scripts/signal_sweep.py (its table: docs/runs.md).

The moments are counted from the instant zeroflow's package starts to load (when the process
begins to catch SIGTERM, which plain Python does not): before it the interpreter is still
starting (its site imports), where no program's code runs yet."""

import json
import signal
import subprocess
import sys
import time

import pytest

from fixtures import TINY_TRAINER
from helpers import REPO, one_cpu_env

pytestmark = pytest.mark.slow

STEPS = 6


def _command(run_dir, program=("-m", "zeroflow.train")):
    # 100 KB of the corpus: a run reads only what its 6 steps and one evaluation batch need.
    return [sys.executable, *program, "--config", str(REPO / "configs" / "tiny.yaml"),
            *TINY_TRAINER, f"run.dir={run_dir}", f"train.steps={STEPS}", "checkpoint.every=2",
            "train.eval_every=0", "run.plot=false", "run.tensorboard=false", "data.max_bytes=100000"]


def _env():
    # One CPU device, as a user's first run (the suite's eight emulated ones would make each run
    # compile and step an 8-way sharded program). Every program of every run goes to the test
    # run's compilation cache (conftest), however quickly it compiled: the runs are the same
    # program, so only the first one compiles.
    return one_cpu_env(cache_every_program=True, PYTHONUNBUFFERED="1")


def _final_loss(run_dir) -> float:
    rows = [json.loads(line) for line in open(run_dir / "metrics.jsonl")]
    return [r["loss"] for r in rows if r.get("step") == STEPS and "loss" in r][-1]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("straight") / "run"
    subprocess.run(_command(run_dir), env=_env(), check=True, capture_output=True)
    return _final_loss(run_dir)


def _catches_sigterm(pid: int) -> bool:
    status = open(f"/proc/{pid}/status").read()
    caught = int(next(line for line in status.splitlines() if line.startswith("SigCgt:")).split()[1], 16)
    return bool(caught & (1 << (signal.SIGTERM - 1)))


def _interrupt(run_dir, *, after_seconds=None, after_line=None, held_after_step=None):
    marker = run_dir.parent / "held"
    program = ("-m", "zeroflow.train") if held_after_step is None else (
        str(REPO / "tests" / "hold_before_step.py"), str(held_after_step), str(marker))
    proc = subprocess.Popen(_command(run_dir, program), env=_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    out = []
    while proc.poll() is None and not _catches_sigterm(proc.pid):
        time.sleep(0.005)
    if held_after_step is not None:  # the run waits there for the signal: no race to lose
        while proc.poll() is None and not marker.exists():
            time.sleep(0.01)
    elif after_line is not None:
        for line in proc.stdout:
            out.append(line)
            if line.startswith(after_line):
                break
    else:
        time.sleep(after_seconds)
    proc.send_signal(signal.SIGINT)
    rest, err = proc.communicate(timeout=600)
    return proc.returncode, "".join(out) + rest, err


@pytest.mark.parametrize("moment", [{"after_seconds": 0.0}, {"after_seconds": 2.0},
                                    {"held_after_step": 1}, {"after_line": f"step {STEPS}/"}],
                         ids=["importing", "building", "training", "closing"])
def test_sigint_at_any_moment_is_one_line_and_resumes_exactly(moment, tmp_path, uninterrupted):
    run_dir = tmp_path / "run"
    code, out, err = _interrupt(run_dir, **moment)
    # Training is held after step 1 until the signal comes (tests/hold_before_step.py), so it
    # is always interrupted; the other moments are instants a fast machine may have passed.
    if code == 0 and "held_after_step" not in moment:  # finished first: nothing interrupted
        assert _final_loss(run_dir) == uninterrupted
        return
    assert code == 130, (out, err)
    assert "Traceback" not in out + err and "Exception ignored" not in err, err
    lines = err.strip().splitlines()
    if lines:  # stopped at once (starting, or exiting): the one line is on stderr
        assert lines == ["zeroflow.train: stopped by SIGINT"], err
        if "step 1/" not in out:  # a start stopped leaves no run folder, as a failed one
            assert not run_dir.exists(), sorted(run_dir.rglob("*"))
            # Nothing left behind: the same command again is the uninterrupted run itself (the
            # fixture, run on no folder), so there is nothing more to resume.
            return
    else:  # stopped while training (it saved) or closing (it had saved): it says so last
        last = out.strip().splitlines()[-1]
        if "held_after_step" in moment:  # step 2 was in flight when the signal came: it is saved
            assert last.startswith("SIGINT: saved a checkpoint at step 2"), out
        assert last.startswith(("SIGINT: saved a checkpoint at step",
                                f"SIGINT: the run had finished; its last checkpoint is step {STEPS}")), out
    subprocess.run(_command(run_dir), env=_env(), check=True, capture_output=True)
    assert _final_loss(run_dir) == uninterrupted
