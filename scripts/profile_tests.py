"""Where a test selection's CPU time goes, by JAX phase. Needs py-spy (``pip install py-spy``):
``python scripts/profile_tests.py tests/test_engine.py tests/test_frozen.py``.

Runs ``python -m pytest -m "" -p no:cacheprovider -n 0 ARGS`` (one process, so one profile; both
tiers, so a file of either is profiled whole, and ``-m slow`` among ARGS still narrows it) under
py-spy's sampling profiler (20 samples a second of the test process's busy threads: time spent
waiting for a process the test started is not counted, that process's own work neither) and
files each sample under the innermost phase on its stack: an XLA compile inside a trace counts
as compiling. Prints each phase's share and, for what no phase claims, the busiest functions.
"""
from __future__ import annotations

import argparse
import collections
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

PHASES = (  # (phase, a frame of it as py-spy names it: "function (file:line)")
    ("XLA compile", ("backend_compile", "compiler.py")),
    ("compilation cache", ("", "compilation_cache.py")),
    ("MLIR context", ("make_ir_context", "mlir.py")),
    ("lowering", ("lower_jaxpr_to_module", "mlir.py")),
    ("tracing", ("trace_to_jaxpr", "partial_eval.py")),
    ("running", ("ExecuteReplicated.__call__", "pxla.py")),
    ("garbage collection", ("gc_collect_harder", "")),
    ("collection", ("importtestmodule", "python.py")),
    ("removing old test folders", ("cleanup_numbered_dir", "pathlib.py")),
)


def phase_of(stack: list[str]) -> str:
    """The phase of the innermost frame (leaf first) that belongs to one."""
    for frame in reversed(stack):
        for phase, (function, filename) in PHASES:
            if function in frame and filename in frame:
                return phase
    return "other"


def read_samples(path: Path) -> list[tuple[list[str], int]]:
    """py-spy's raw format: one line per distinct stack, ``frame;frame;... count``."""
    samples = []
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        samples.append((stack.split(";"), int(count)))
    return samples


def report(samples: list[tuple[list[str], int]], top: int = 12) -> str:
    total = sum(count for _, count in samples)
    phases: collections.Counter[str] = collections.Counter()
    unclaimed: collections.Counter[str] = collections.Counter()
    for stack, count in samples:
        phase = phase_of(stack)
        phases[phase] += count
        if phase == "other":
            unclaimed[stack[-1]] += count
    lines = [f"{total} samples (20 a second)", f"{'phase':28} {'share':>6}"]
    lines += [f"{phase:28} {count / total:6.1%}" for phase, count in phases.most_common()]
    lines += ["", "busiest functions of 'other':"]
    lines += [f"{count / total:6.1%}  {frame}" for frame, count in unclaimed.most_common(top)]
    return "\n".join(lines)


def pytest_summary(lines: list[str]) -> str:
    """pytest's summary line. py-spy exits 0 whatever pytest did: a run without one (a wrong
    path, a usage error, nothing collected) is no profile of the tests, and ends in one line."""
    outcome = [line for line in lines if re.search(r"\d+ (passed|failed)", line)]
    if not outcome:
        said = [line for line in lines if line.startswith("ERROR")] or lines[-1:] or ["no output"]
        sys.exit(f"profile_tests: no tests ran under the profiler: {said[0]}")
    return outcome[-1]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("pytest_args", nargs="+", help="test files and pytest options")
    args = p.parse_args()
    if shutil.which("py-spy") is None:
        sys.exit("profile_tests: py-spy is not installed (pip install py-spy)")
    with tempfile.TemporaryDirectory() as scratch:
        raw = Path(scratch) / "samples.txt"
        command = ["py-spy", "record", "-r", "20", "-f", "raw", "-o", str(raw), "--",
                   sys.executable, "-m", "pytest", "-q", "-m", "", "-p", "no:cacheprovider",
                   "-n", "0", *args.pytest_args]
        done = subprocess.run(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        lines = [line for line in done.stdout.splitlines() if line.strip()]
        summary = pytest_summary(lines)
        samples = read_samples(raw) if raw.exists() else []
        if not samples:
            sys.exit(f"profile_tests: py-spy took no samples ({summary})")
        print(summary)
        print(report(samples))


if __name__ == "__main__":
    main()
