"""The checks every Python library runs, as part of the suite (so CI's first leg and the
README's test command both run them): ruff's lint and format check over zeroflow/, the type
checker (mypy) and the dead-code check. Their settings live in pyproject.toml and .ci/vulture_whitelist.py."""

import subprocess
import sys

import pytest

from helpers import REPO


def _run(tool: str, *args: str) -> subprocess.CompletedProcess:
    """``python -m tool args`` in the repository (the test extra installs each tool)."""
    return subprocess.run([sys.executable, "-m", tool, *args], cwd=REPO, capture_output=True,
                          text=True, check=False)


@pytest.mark.fast
def test_ruff_lint_passes():
    done = _run("ruff", "check", "zeroflow")
    assert done.returncode == 0, done.stdout + done.stderr


@pytest.mark.fast
def test_ruff_format_leaves_every_file_as_it_is():
    done = _run("ruff", "format", "--check", "zeroflow")
    assert done.returncode == 0, done.stdout + done.stderr


@pytest.mark.fast
def test_no_dead_code():
    done = _run("vulture", "zeroflow", "pallas_kernels", "tests", "scripts", "experiments",
                ".ci/vulture_whitelist.py", "--min-confidence", "60")
    assert done.returncode == 0, "unused code (remove it, or say in .ci/vulture_whitelist.py " \
        "how it is used):\n" + done.stdout + done.stderr


@pytest.mark.slow
def test_the_type_checker_passes():
    # mypy over zeroflow/ with pyproject.toml's [tool.mypy]: an annotation that lies (a
    # "-> bool" returning a string) fails here.
    done = _run("mypy", "--no-incremental", "--cache-dir", "/dev/null")
    assert done.returncode == 0, done.stdout + done.stderr
