"""The two test tiers (tests/conftest.py, pyproject's addopts): the README's command runs the fast
tier, ``-m slow`` the end-to-end one, and a test that declares neither or both stops the
collection, so that no test can fall out of CI's two runs. Checked on a scratch suite that uses
the project's own conftest and pytest settings, so the rule is the one the real suite runs."""

import shutil
import subprocess
import sys
import tomllib

import pytest
from helpers import REPO

pytestmark = pytest.mark.fast

FILES = {
    "test_quick.py": "import pytest\npytestmark = pytest.mark.fast\ndef test_quick():\n    pass\n",
    "test_long.py": "import pytest\npytestmark = pytest.mark.slow\ndef test_long():\n    pass\n",
    "test_mixed.py": ("import pytest\n@pytest.mark.fast\ndef test_one():\n    pass\n"
                      "@pytest.mark.slow\ndef test_two():\n    pass\n"),
}


def _suite(tmp_path, extra: dict[str, str]):
    tests = tmp_path / "tests"
    tests.mkdir()
    for name in ("conftest.py", "file_progress.py"):
        shutil.copy(REPO / "tests" / name, tests / name)
    for name, text in {**FILES, **extra}.items():
        (tests / name).write_text(text)
    settings = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]
    ini = ["[pytest]", f"addopts = {settings['addopts']}", "testpaths = tests", "markers ="]
    ini += [f"    {marker}" for marker in settings["markers"]]
    (tmp_path / "pytest.ini").write_text("\n".join(ini) + "\n")
    return tmp_path


def _collect(root, *args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-n", "0",
                           "-p", "no:cacheprovider", *args], cwd=root, capture_output=True,
                          text=True, check=False)


def _ids(done) -> set[str]:
    return {line.split("::")[-1] for line in done.stdout.splitlines() if "::" in line}


def test_the_default_command_runs_the_fast_tier_and_slow_the_rest(tmp_path):
    root = _suite(tmp_path, {})
    fast, slow, both = _collect(root), _collect(root, "-m", "slow"), _collect(root, "-m", "")
    assert fast.returncode == 0, fast.stdout + fast.stderr
    assert _ids(fast) == {"test_quick", "test_one"}
    assert _ids(slow) == {"test_long", "test_two"}
    assert _ids(both) == _ids(fast) | _ids(slow)


@pytest.mark.parametrize("text,why", [
    ("def test_undeclared():\n    pass\n", "no tier"),
    ("import pytest\npytestmark = pytest.mark.fast\n@pytest.mark.slow\ndef test_undeclared():\n"
     "    pass\n", "both tiers"),
])
def test_a_test_without_exactly_one_tier_stops_the_collection(tmp_path, text, why):
    done = _collect(_suite(tmp_path, {"test_bad.py": text}))
    assert done.returncode != 0
    assert f"test_bad.py::test_undeclared: {why}" in done.stdout + done.stderr


def test_with_workers_a_test_without_a_tier_fails_naming_the_rule(tmp_path):
    # xdist's workers collect; a collection error there would end a worker without a word.
    root = _suite(tmp_path, {"test_bad.py": "def test_undeclared():\n    pass\n"})
    done = subprocess.run([sys.executable, "-m", "pytest", "-n", "1", "-p", "no:cacheprovider"],
                          cwd=root, capture_output=True, text=True, check=False)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "test_bad.py::test_undeclared declares no tier" in done.stdout
    assert "2 passed" in done.stdout  # the fast tier's other tests ran
