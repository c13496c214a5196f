"""The project's own programs (scripts/*.py, experiments/*.py) start as quietly as the
``python -m zeroflow.<command>`` commands: ``import zeroflow`` no longer touches jax, so each
program that uses jax calls ``zeroflow.cli.common.start_script()`` before anything imports jax.
Where the CUDA plugin is installed without a driver (this machine), a program that skipped it
prints the plugin's "Could not find cuda drivers" lines and its traceback, even with
JAX_PLATFORMS=cpu."""

import ast
import os
import subprocess
import sys

import pytest
from helpers import REPO

pytestmark = pytest.mark.fast

PROGRAMS = sorted([*(REPO / "scripts").glob("*.py"), *(REPO / "experiments").glob("*.py")])
# Packages that import jax (benchlib and gpureport are scripts/' own, and import it).
USES_JAX = {"jax", "jaxlib", "flax", "optax", "orbax", "equinox", "benchlib", "gpureport"}
# zeroflow modules that never import jax (checked below): programs using only these need no call.
WITHOUT_JAX = ("zeroflow.data", "zeroflow.fusemix.digits")
START = "zeroflow.cli.common"


def _imported(node: ast.AST) -> list[str]:
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if isinstance(node, ast.ImportFrom) and node.level == 0:
        return [node.module or ""]
    return []


def _brings_jax(module: str) -> bool:
    if module == START or module.startswith(WITHOUT_JAX):
        return False
    return module.split(".")[0] in USES_JAX | {"zeroflow"}


def _calls_start_script(node: ast.AST) -> bool:
    return (isinstance(node, ast.Expr) and isinstance(node.value, ast.Call)
            and getattr(node.value.func, "id", None) == "start_script")


def _problem(path) -> str | None:
    """Why ``path`` would import jax before ``start_script()`` ran, or None."""
    tree = ast.parse(path.read_text())
    anywhere = [m for node in ast.walk(tree) for m in _imported(node)]
    if not any(_brings_jax(m) for m in anywhere):
        return None
    for node in tree.body:  # module level, in order: the call must come first
        if _calls_start_script(node):
            return None
        late = [m for m in _imported(node) if _brings_jax(m)]
        if late:
            return f"imports {late[0]} (line {node.lineno}) before start_script()"
    return "uses jax but never calls start_script() at module level"


@pytest.mark.parametrize("path", PROGRAMS, ids=[str(p.relative_to(REPO)) for p in PROGRAMS])
def test_program_starts_quietly_before_importing_jax(path):
    problem = _problem(path)
    assert problem is None, f"{path.relative_to(REPO)}: {problem}"


def test_the_modules_taken_as_jax_free_import_no_jax():
    code = f"import sys, {', '.join(WITHOUT_JAX)}; print('jax' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=120)
    assert done.stdout.strip() == "False", done.stderr[-1000:]


def test_a_program_using_jax_writes_nothing_of_the_cuda_plugin(tmp_path):
    # A bare shell's environment: no JAX_PLATFORMS (the suite's conftest sets it; a user's
    # shell does not). The program saves and hashes a tiny checkpoint: jax's backend starts,
    # which is where the plugin's traceback would come.
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_PLATFORMS",)}
    done = subprocess.run(
        [sys.executable, str(REPO / "scripts/bench_checkpoint_digests.py"), "--gb", "0.0001"],
        cwd=tmp_path, capture_output=True, text=True, timeout=300,
        env={**env, "PYTHONPATH": str(REPO)})
    assert done.returncode == 0 and "verify" in done.stdout, done.stderr[-2000:]
    noise = [line for line in done.stderr.splitlines()
             if "cuda" in line.lower() or "traceback" in line.lower()]
    assert not noise, "\n".join(noise[:5])


@pytest.mark.parametrize("driver", [True, False])
def test_on_a_machine_with_a_gpu_driver_a_program_keeps_its_gpu(driver):
    # scripts/gpu_report.py and the benchmarks measure real GPUs: where a driver exists,
    # start_script must leave jax's platform choice alone. A driver is faked by replacing the
    # check itself (this machine has none); without one (the control), the CPU is chosen.
    code = (
        "import os, sys\n"
        "from zeroflow.util import quiet_jax\n"
        "quiet_jax.cuda_plugin_module = lambda: 'xla_cuda12'  # the plugin installed, as on GPUs\n"
        f"quiet_jax.has_gpu_driver = lambda: {driver}\n"
        "from zeroflow.cli.common import start_script\n"
        "start_script()\n"
        "print(os.environ.get('JAX_PLATFORMS'), len(sys.meta_path))\n")
    env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
    runs = [subprocess.run([sys.executable, "-c", c], capture_output=True, text=True,
                           env={**env, "PYTHONPATH": str(REPO)}, timeout=120)
            for c in (code, code.replace("start_script()\n", ""))]
    (platform, finders), (_, finders_before) = (r.stdout.split() for r in runs)
    if driver:
        assert (platform, finders) == ("None", finders_before)
    else:
        assert (platform, int(finders)) == ("cpu", int(finders_before) + 1)
