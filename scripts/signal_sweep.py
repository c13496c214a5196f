"""Ctrl-C (and SIGTERM) at many moments of ``python -m zeroflow.train``, each resumed.

    PYTHONPATH=$PWD python scripts/signal_sweep.py [--out experiments/signal_sweep.json]

One uninterrupted run of the tiny trainer gives the reference: its per-step losses, its
evaluations and the master weights of its final checkpoint. Then the same command is started
again and again, and each time a signal is sent at another moment (``moments``): 12 over
start-up, each anchored on what marks its phase (the instant zeroflow's package begins to load,
when the process starts to catch SIGTERM; ``trainer.lock`` appearing as the run is built;
``config.yaml`` and the banner line as the first step compiles) plus an offset, since times
alone drift with the machine's load; 8 right after a line of the output (each training step,
the mid-run evaluation, the final summary); and SIGTERM at 3. Each run must be interrupted
(a run that ended first is a failure of the moment) and end with exit 128 + N and one line:
``zeroflow.train: stopped by SIGINT`` on stderr, leaving no run folder, while starting; else
``SIGINT: saved a checkpoint at step K ...`` (or ``... the run had finished ...``) as the last
line of stdout, with nothing on stderr. Then the same command resumes it, and the resumed
run's losses, evaluations and final weights must equal the reference's bit for bit.

Prints a Markdown table (one row per moment) and exits 1 if any moment fails.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from zeroflow.cli.common import start_script

start_script()  # before jax: where the CUDA plugin has no driver, a CPU jax without its noise

REPO = Path(__file__).resolve().parent.parent
STEPS = 6
TINY = [
    "model.num_layers=1", "model.embed_dim=32", "model.num_heads=2", "model.mlp_dim=64",
    "model.seq_len=32", "train.batch_size=8", "train.eval_batches=1", "train.log_every=1",
    "run.progress=false", f"train.steps={STEPS}", "checkpoint.every=2", "train.eval_every=3",
    "run.plot=false", "run.tensorboard=false",
]  # fmt: skip
AFTER_LINES = [f"step {k}/{STEPS}" for k in range(1, STEPS + 1)] + ["step 3: eval", "final:"]
"Line-triggered moments: the signal goes right after the first line starting with each."


def command(run_dir: Path) -> list[str]:
    return [sys.executable, "-m", "zeroflow.train", "--config", str(REPO / "configs" / "tiny.yaml"),
            *TINY, f"run.dir={run_dir}"]  # fmt: skip


BASE_ENV = dict(os.environ)
"The environment the trainers get (this process sets JAX_PLATFORMS for itself later)."


def env() -> dict[str, str]:
    return {**BASE_ENV, "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(REPO)}


def catches_sigterm(pid: int) -> bool:
    """Whether the process has a SIGTERM handler: zeroflow's, installed as its package loads."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    caught = next(line for line in status.splitlines() if line.startswith("SigCgt:"))
    return bool(int(caught.split()[1], 16) & (1 << (signal.SIGTERM - 1)))


def where(run_dir: Path, lines: list[tuple[float, str]]) -> str:
    """The phase the run is in now, from its folder and its output."""
    if lines and not lines[-1][1].startswith("data "):
        return f"after '{lines[-1][1].split('  ')[0]}'"
    if (run_dir / "config.yaml").exists():
        return "compiling step 1"
    if (run_dir / "trainer.lock").exists():
        return "building the run"
    return "importing"


def run_until(run_dir: Path, sig: int | None, anchor: str = "load", offset: float = 0.0):
    """Start the trainer and send ``sig`` ``offset`` seconds after ``anchor``: 'load' (zeroflow
    starts to load), 'file:NAME' (NAME appears in the run folder) or 'line:TEXT' (the first
    stdout line starting with TEXT). Returns a record of what happened."""
    proc = subprocess.Popen(command(run_dir), env=env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)  # fmt: skip
    lines: list[tuple[float, str]] = []
    ended = threading.Event()
    while proc.poll() is None and not catches_sigterm(proc.pid):
        time.sleep(0.002)
    t0 = time.perf_counter()

    def read_stdout():
        for line in proc.stdout:
            lines.append((time.perf_counter() - t0, line.rstrip("\n")))
        ended.set()

    def anchored() -> bool:
        kind, _, what = anchor.partition(":")
        if kind == "file":
            return (run_dir / what).exists()
        if kind == "line":
            return any(text.startswith(what) for _, text in lines)
        return True

    reader = threading.Thread(target=read_stdout, daemon=True)
    reader.start()
    sent, landed = None, ""
    if sig is not None:
        while not anchored() and not ended.is_set():
            time.sleep(0.002)
        time.sleep(offset)
        sent, landed = time.perf_counter() - t0, where(run_dir, list(lines))
        if proc.poll() is None:
            proc.send_signal(sig)
    try:
        err = proc.stderr.read()
        proc.wait(timeout=900)
    except subprocess.TimeoutExpired:
        proc.kill()
        err = "HANG (killed after 900 s)"
    reader.join(timeout=10)
    return {"code": proc.returncode, "sent": sent, "landed": landed,
            "stdout": [t for _, t in lines], "stderr": err.strip().splitlines()}  # fmt: skip


def metrics(run_dir: Path) -> tuple[dict[int, float], dict[int, float]]:
    """Per-step training losses and evaluation losses (each step's last row)."""
    losses, evals = {}, {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        if "loss" in row and "step" in row:
            losses[row["step"]] = row["loss"]
        if "eval_loss" in row:
            evals[row["step"]] = row["eval_loss"]
    return losses, evals


def final_weights(run_dir: Path):
    """The master weights of the final checkpoint, read by Orbax alone."""
    os.environ.setdefault("JAX_PLATFORMS", "cpu")  # no GPU plugin probing for a file read
    import jax
    import numpy as np
    import orbax.checkpoint as ocp

    with ocp.StandardCheckpointer() as ckptr:
        state = ckptr.restore(run_dir / "checkpoints" / str(STEPS) / "state")
    return [np.asarray(x) for x in jax.tree.leaves(state["master"])]


def one_line_problem(rec: dict, sig: int, run_dir: Path) -> str:
    """'' when the interrupted run ended as it must, else what was wrong. Stopped while
    starting, a fresh run leaves no run folder behind (as a failed start leaves none)."""
    name = signal.Signals(sig).name
    if rec["code"] == 0:
        return ""  # finished before the signal came: nothing was interrupted
    if rec["code"] != 128 + sig:
        return f"exit {rec['code']}"
    text = "\n".join(rec["stderr"] + rec["stdout"])
    if "Traceback" in text or "Exception ignored" in text:
        return "a traceback"
    if rec["stderr"]:
        if rec["stderr"] != [f"zeroflow.train: stopped by {name}"]:
            return f"stderr: {rec['stderr'][:3]}"
        started = any(line.startswith(f"step 1/{STEPS}") for line in rec["stdout"])
        left = sorted(str(p.relative_to(run_dir)) for p in run_dir.rglob("*"))
        return f"left {left or 'an empty folder'}" if run_dir.exists() and not started else ""
    last = rec["stdout"][-1] if rec["stdout"] else ""
    ends = (f"{name}: saved a checkpoint at step", f"{name}: the run had finished")
    return "" if last.startswith(ends) else f"last line: {last!r}"


def moments() -> list[tuple[int, str, float]]:
    """(signal, anchor, offset) of each moment: 12 SIGINTs over start-up (importing, building
    the run, compiling the first step: anchored on what marks each, as times alone drift with
    the machine's load), one right after each line of ``AFTER_LINES``, and 3 SIGTERMs."""
    start = [("load", t) for t in (0.0, 0.5, 1.0, 2.0, 4.0)]
    start += [("file:trainer.lock", t) for t in (0.0, 0.5, 2.0)]
    start += [("file:config.yaml", 0.0)] + [("line:data ", t) for t in (0.0, 0.5, 2.0)]
    out = [(signal.SIGINT, anchor, t) for anchor, t in start]
    out += [(signal.SIGINT, f"line:{line}", 0.0) for line in AFTER_LINES]
    out += [(signal.SIGTERM, "load", 0.0), (signal.SIGTERM, "file:trainer.lock", 0.5),
            (signal.SIGTERM, f"line:step 2/{STEPS}", 0.0)]  # fmt: skip
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=None, help="write the records as JSON")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="signal_sweep_"))
    ref = run_until(work / "straight", None)
    assert ref["code"] == 0, ref
    ref_metrics, ref_weights = metrics(work / "straight"), final_weights(work / "straight")
    rows, failed = [], 0
    for i, (sig, anchor, offset) in enumerate(moments()):
        run_dir = work / f"run{i}"
        rec = run_until(run_dir, sig, anchor, offset)
        problem = one_line_problem(rec, sig, run_dir) or (
            "not interrupted: it had ended" if rec["code"] == 0 else ""
        )
        resumed = subprocess.run(command(run_dir), env=env(), capture_output=True, text=True)
        same = resumed.returncode == 0 and metrics(run_dir) == ref_metrics
        if same:
            same = all(
                (a == b).all() for a, b in zip(final_weights(run_dir), ref_weights, strict=True)
            )
        if resumed.returncode != 0:
            problem = (
                problem or f"resume exit {resumed.returncode}: {resumed.stderr.strip()[-200:]}"
            )
        elif not same:
            problem = problem or "resume not bit-identical"
        failed += bool(problem)
        kind, _, what = anchor.partition(":")
        moment = {"load": "zeroflow loads", "file": f"{what} appears", "line": f"line '{what}'"}
        row = {"signal": signal.Signals(sig).name,
               "moment": f"{moment[kind]} + {offset:g} s", "landed": rec["landed"], "code": rec["code"],
               "line": (rec["stderr"] or rec["stdout"][-1:] or [""])[-1], "identical": same,
               "problem": problem, "record": rec}  # fmt: skip
        rows.append(row)
        print(_row(i + 1, row), flush=True)
    print(f"{len(rows) - failed}/{len(rows)} moments ended in one line and resumed bit-identically")
    if args.out:
        args.out.write_text(json.dumps(rows, indent=1))
    return 1 if failed else 0


def _row(n: int, row: dict) -> str:
    return (f"| {n} | {row['signal']} | {row['moment']} | {row['landed']} | {row['code']} | "
            f"`{row['line']}` | {'yes' if row['identical'] else 'NO'} | {row['problem'] or 'ok'} |")  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
