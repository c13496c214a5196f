"""Rows compiled one per fresh process (the experiments that compile for abstract GPUs): each
child gets its own XLA flags and schedule log, and a row that crashes or hangs XLA costs that
row only. The child prints its row as the last JSON line on stdout."""
from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

from zeroflow.cli.common import start_script

start_script()  # before jax: where the CUDA plugin has no driver, a CPU jax without its noise

HERE = Path(__file__).resolve().parent


def child_env() -> dict:
    """This process's environment with XLA:GPU's step-time estimate printed
    (``zeroflow.xla.schedule``), the CPU as jax's platform and the experiments importable."""
    from zeroflow.xla import schedule

    env = schedule.enable(dict(os.environ))
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONPATH"] = os.pathsep.join(
        filter(None, [str(HERE), str(HERE.parent), env.get("PYTHONPATH")])
    )
    return env


def run_row(cmd: list[str], env: dict, row: dict, timeout: float, note_width: int) -> dict:
    """The row ``cmd`` prints, or ``row`` with a note: the timeout, or the child's last error
    line (at most ``note_width`` characters)."""
    try:
        out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {**row, "note": f"compile over {timeout:.0f} s"}
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("{")]
    if out.returncode == 0 and lines:
        return json.loads(lines[-1])
    errors = [ln for ln in out.stderr.splitlines() if "Error" in ln or "error" in ln]
    return {**row, "note": (errors[-1] if errors else f"exit {out.returncode}").strip()[:note_width]}
