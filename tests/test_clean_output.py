"""What a person sees of a run: log lines above the progress bar in a terminal, never on its
end, and a plot that starts at the first step's loss and shows the learning rate."""

import json
import os
import pty
import re
import sys

from fixtures import TINY_TRAINER
from helpers import REPO, one_cpu_env
import pytest

pytestmark = pytest.mark.slow

ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


def _in_a_terminal(argv: list[str]) -> str:
    """What ``argv`` writes to a pseudo-terminal (stdout and stderr both terminals, so the bar
    is shown), with the terminal's control sequences taken out."""
    out = bytearray()

    def read(fd):
        data = os.read(fd, 65536)
        out.extend(data)
        return data

    # pty.spawn starts ``argv`` with this process's environment: for the run, the one of a
    # user's first run (one CPU device, not the suite's eight emulated ones), with every program
    # going to the test run's compilation cache.
    env_before = dict(os.environ)
    os.environ.update(one_cpu_env(cache_every_program=True, COLUMNS="160"))
    try:
        status = pty.spawn(argv, read)
    finally:
        os.environ.clear()
        os.environ.update(env_before)
    assert os.waitstatus_to_exitcode(status) == 0, out.decode(errors="replace")[-2000:]
    return ANSI.sub("", out.decode(errors="replace"))


def test_log_lines_print_above_the_bar_not_onto_it(tmp_path):
    text = _in_a_terminal([
        sys.executable, "-m", "zeroflow.train", "--config", str(REPO / "configs" / "tiny.yaml"),
        *[o for o in TINY_TRAINER if o != "run.progress=false"], "run.progress=true",
        f"run.dir={tmp_path / 'run'}", "train.steps=4", "train.eval_every=2",
        "checkpoint.every=0", "run.plot=false", "run.tensorboard=false"])
    assert "4/4" in text  # the bar was drawn
    lines = re.split(r"[\r\n]", text)
    logged = [line for line in lines if "eval loss" in line]
    assert len(logged) == 2, logged  # step 2's evaluation and the final summary
    assert all(re.match(r"^(step 2: eval loss|final: train loss)", line) for line in logged), logged


def test_the_plot_starts_at_step_one_and_has_the_learning_rate(tmp_path):
    from zeroflow.config.io import load_config
    from zeroflow.trainer.loop import train

    run = tmp_path / "run"
    train(load_config(REPO / "configs" / "tiny.yaml", [
        *TINY_TRAINER, f"run.dir={run}", "train.steps=6", "train.log_every=3",
        "train.eval_every=0", "checkpoint.every=0", "train.warmup_steps=4"]))
    rows = [json.loads(line) for line in open(run / "metrics.jsonl")]
    losses = [(r["step"], r["lr"]) for r in rows if "loss" in r]
    assert [s for s, _ in losses] == [1, 3, 6]  # step 1 although log_every is 3
    assert losses[0][1] < losses[1][1]  # warming up: the schedule is there to draw
    assert (run / "plot.png").stat().st_size > 0
