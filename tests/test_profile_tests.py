"""scripts/profile_tests.py files py-spy's samples under JAX's phases: the innermost phase on a
stack wins, and what no phase claims is listed by its function."""
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.fast

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))

import profile_tests  # noqa: E402

TRACE = "trace_to_jaxpr (jax/_src/interpreters/partial_eval.py:2312)"
LOWER = "lower_jaxpr_to_module (jax/_src/interpreters/mlir.py:1387)"
COMPILE = "backend_compile_and_load (jax/_src/compiler.py:337)"
TEST = "test_something (tests/test_x.py:10)"


def test_the_innermost_phase_takes_the_sample_and_shares_add_up(tmp_path):
    raw = tmp_path / "samples.txt"
    raw.write_text("\n".join([
        f"{TEST};{TRACE};helper (zeroflow/a.py:1) 6",        # tracing
        f"{TEST};{TRACE};{LOWER};{COMPILE} 3",               # a compile inside a trace
        f"{TEST};{LOWER};emit (jax/_src/interpreters/mlir.py:9) 1",  # lowering
        f"{TEST};json_dump (json.py:1) 10",                  # no phase
    ]) + "\n")
    samples = profile_tests.read_samples(raw)
    assert [profile_tests.phase_of(stack) for stack, _ in samples] == [
        "tracing", "XLA compile", "lowering", "other"]
    printed = profile_tests.report(samples)
    assert "20 samples" in printed
    shares = {line[:28].strip(): line[28:].strip() for line in printed.splitlines()[2:6]}
    assert shares == {"other": "50.0%", "tracing": "30.0%", "XLA compile": "15.0%",
                      "lowering": "5.0%"}
    assert " 50.0%  json_dump (json.py:1)" in printed


def test_a_run_without_a_pytest_outcome_is_one_line():
    # py-spy exits 0 whatever pytest did; pytest's own lines tell a wrong path from a profile.
    summary = "3 passed, 1 failed in 9.1s"
    assert profile_tests.pytest_summary(["..", summary]) == summary
    with pytest.raises(SystemExit, match="no tests ran under the profiler: ERROR: file or "
                                         "directory not found: tests/nope.py"):
        profile_tests.pytest_summary(["ERROR: file or directory not found: tests/nope.py",
                                      "no tests ran in 0.01s"])
