"""CI's script names test files and test ids by hand. pytest collects nothing (exit 5) when a
named file is gone, and a ``--deselect`` id that matches no test silently deselects nothing,
so both are checked here, where a rename or deletion shows up at once."""

import re
import subprocess
import sys

from helpers import REPO
import pytest

pytestmark = pytest.mark.fast

CI_SCRIPT = REPO / ".ci" / "run"


def _script() -> str:
    # Continuation lines joined: test lists span several lines.
    return CI_SCRIPT.read_text().replace("\\\n", " ")


def test_every_test_file_ci_names_exists():
    named = set(re.findall(r"(?<![\w/])(tests/[\w/]+\.py)\b", _script()))
    assert named, "the pattern no longer finds the test files in .ci/run"
    missing = sorted(path for path in named if not (REPO / path).is_file())
    assert not missing, f".ci/run names test files that do not exist: {missing}"


def test_every_deselected_test_id_ci_names_is_collected():
    ids = re.findall(r'--deselect\s+"?([^"\s]+)"?', _script())
    if not ids:
        return  # nothing deselected: nothing that could go stale
    # -m "": the ids of either tier (a slow test deselected is still a test that exists).
    done = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-m", "",
                           "-n", "0", "-p", "no:cacheprovider", *ids], cwd=REPO,
                           capture_output=True, text=True, check=False)
    collected = set(done.stdout.split())
    stale = [test_id for test_id in ids if test_id not in collected]
    assert not stale, f".ci/run deselects tests that do not exist: {stale}\n{done.stdout[-2000:]}"
