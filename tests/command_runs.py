"""Running documented commands as a newcomer would: in a fresh folder that holds what a clone
holds and the commands read (``configs/``, ``scripts/``, ``experiments/``), nothing else (no
``runs/``), from a bare environment. Shared by test_readme_commands.py and
test_docs_commands_run.py."""

import importlib.util
import os
import shlex
import subprocess
import sys

from helpers import REPO, one_cpu_env

# Overrides that only cut a training command's length: the command still starts, builds,
# compiles, trains, evaluates, checkpoints and writes its run folder as written.
SHORT = ["train.steps=2", "train.eval_batches=1", "train.log_every=1", "run.progress=false"]
CLONE = ("configs", "scripts", "experiments")


def fresh_folder(path):
    """``path`` as a fresh clone's working folder: the repository's files the commands read,
    linked, and nothing a run writes."""
    path.mkdir(parents=True, exist_ok=True)
    for name in CLONE:
        (path / name).symlink_to(REPO / name, target_is_directory=True)
    return path


def bare_env() -> dict[str, str]:
    """A newcomer's shell (no JAX_PLATFORMS, no test settings; zeroflow importable as after
    ``pip install -e .``), plus only what makes compiling cheaper and changes no command or
    output: the suite's cheap-compile XLA flags and its compilation cache, every program
    written to it, so a command loads what an earlier one compiled."""
    suite = one_cpu_env(cache_every_program=True)
    keep = ("XLA_FLAGS", "JAX_COMPILATION_CACHE_DIR", "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS",
            "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "HOME", "TMPDIR")
    # PATH: the shell's ``python`` is this interpreter (the launcher starts "python -m ...").
    path = os.pathsep.join([os.path.dirname(sys.executable), "/usr/bin", "/bin"])
    return {"PYTHONPATH": str(REPO), "PATH": path,
            **{key: suite[key] for key in keep if key in suite}}


def words(command: str) -> list[str]:
    """argv of a documented ``python ...`` command, without ``python``."""
    return shlex.split(command)[1:]


def run(argv: list[str], cwd, *, env=None, timeout=900) -> subprocess.CompletedProcess:
    """``python *argv`` in ``cwd`` (with the variables ``env`` the command sets); it must end with 0 and write none of the CUDA plugin's lines
    (the commands and the project's programs start quietly: zeroflow.cli.common)."""
    full = bare_env()
    for name, value in (env or {}).items():  # the command's XLA flags after the cheap-compile ones
        full[name] = f"{full.get(name, '')} {value}".strip() if name == "XLA_FLAGS" else value
    done = subprocess.run([sys.executable, *argv], cwd=cwd, capture_output=True, text=True,
                          env=full, timeout=timeout)
    shown = f"{shlex.join(argv)}\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}"
    assert done.returncode == 0, shown
    assert "Could not find cuda drivers" not in done.stderr and "Traceback" not in done.stderr, shown
    return done


def missing_extras(*modules: str) -> list[str]:
    """Which of ``modules`` (an extra's libraries: torch, transformers, ...) are not installed."""
    return [m for m in modules if importlib.util.find_spec(m) is None]
