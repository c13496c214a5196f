"""How long a command takes to refuse a config typo, and ``import zeroflow`` to return.

    python scripts/bench_cli_start.py [--runs 7] [--repo PATH]

Runs each command ``--runs`` times in a fresh interpreter (PYTHONPATH = ``--repo``, default this
checkout; JAX_PLATFORMS unset, as a user's shell has it) and prints the median wall time and the
median CPU time (user + system of the process: on a busy machine the steadier of the two):

- ``python -c pass``: the interpreter alone, the floor;
- ``python -c "import zeroflow"``;
- the tiny config's train command with a mistyped key (the override bad.key=1), which must end
  with one ``zeroflow.train: error: ...`` line and exit 2 (checked on every run);
- ``python -c "import jax"``: what the typo no longer waits for.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

COMMANDS = {
    "python -c pass": ["-c", "pass"],
    'python -c "import zeroflow"': ["-c", "import zeroflow"],
    "python -m zeroflow.train ... bad.key=1": [
        "-m",
        "zeroflow.train",
        "--config",
        "configs/tiny.yaml",
        "bad.key=1",
    ],
    'python -c "import jax"': ["-c", "import jax"],
}


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def time_once(args: list[str], env: dict[str, str], cwd: Path) -> tuple[float, float, str, int]:
    """(wall s, CPU s, stderr, exit code) of one run of ``python ARGS``."""
    cpu, start = _children_cpu(), time.perf_counter()
    run = subprocess.run([sys.executable, *args], capture_output=True, text=True, env=env, cwd=cwd)
    return time.perf_counter() - start, _children_cpu() - cpu, run.stderr, run.returncode


def check_typo_run(stderr: str, code: int) -> None:
    lines = stderr.strip().splitlines()
    if code != 2 or len(lines) != 1 or not lines[0].startswith("zeroflow.train: error: "):
        sys.exit(f"bench_cli_start: the typo's run did not end in one error line: {stderr!r}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=7, help="runs per command (default 7)")
    p.add_argument("--repo", type=Path, default=REPO, help="the checkout to time")
    args = p.parse_args()
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_PLATFORMS", "XLA_FLAGS")}
    env["PYTHONPATH"] = str(args.repo.resolve())
    print(f"{'command':<42} {'wall s':>8} {'CPU s':>8}  (median of {args.runs})")
    for name, command in COMMANDS.items():
        walls, cpus = [], []
        for _ in range(args.runs):
            wall, cpu, stderr, code = time_once(command, env, args.repo)
            if "bad.key" in name:
                check_typo_run(stderr, code)
            walls.append(wall)
            cpus.append(cpu)
        print(f"{name:<42} {statistics.median(walls):>8.2f} {statistics.median(cpus):>8.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
