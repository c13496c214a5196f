"""Every ``python -m zeroflow...`` command the README shows, run as written (shortened by
overrides that only cut its length: fewer steps, a temporary run folder, fewer tokens), so the
README cannot drift from the code. Templates (``configs/<name>.yaml``, ``--config X``) are
syntax, not commands, and are left out; commands whose inputs another documented command makes
(a tiny Hugging Face model) are checked to name files that exist, and run in their own tests
(test_hf_trainer.py); FuseMix's, which writes its tiny encoders itself, runs as written in a
fresh folder in test_fusemix_demo.py."""

import re
import shlex
import subprocess
import sys

import pytest

from helpers import REPO, one_cpu_env

pytestmark = pytest.mark.slow

README = (REPO / "README.md").read_text()
BLOCKS = re.findall(r"```bash\n(.*?)```", README, re.S)
SPANS = BLOCKS + re.findall(r"`([^`]+)`", re.sub(r"```.*?```", "", README, flags=re.S))


def _commands() -> list[str]:
    found = []
    for span in SPANS:
        for line in span.replace("\n", " ").split("&&"):
            line = line.split("#")[0].strip()
            if line.startswith("python -m zeroflow.") and not re.search(r"<|\bX\b|\bN\b|\[", line):
                found.append(" ".join(line.split()))
    return list(dict.fromkeys(found))


COMMANDS = _commands()
SHORT = ["train.steps=2", "train.eval_batches=1", "train.log_every=1", "run.progress=false"]


def test_the_readme_shows_the_commands_a_newcomer_needs():
    programs = {c.split()[2] for c in COMMANDS}
    assert {"zeroflow.train", "zeroflow.sample", "zeroflow.export", "zeroflow.memory"} <= programs
    assert any("--cpu-devices 4 parallel.zero_stage=3" in c for c in COMMANDS)  # "scale it"


def _env() -> dict[str, str]:
    # A bare environment, as a newcomer's shell would give (no JAX_PLATFORMS, no test
    # settings), plus only what makes compiling cheaper and changes no command or output: the
    # suite's cheap-compile XLA flags and its compilation cache, every program written to it,
    # so the sample and export commands load what the train command compiled.
    suite = one_cpu_env(cache_every_program=True)
    keep = ("XLA_FLAGS", "JAX_COMPILATION_CACHE_DIR", "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS",
            "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES")
    return {"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin",
            **{key: suite[key] for key in keep if key in suite}}


def _run(argv: list[str]) -> subprocess.CompletedProcess:
    done = subprocess.run([sys.executable, *argv], cwd=REPO, capture_output=True, text=True,
                          env=_env(), timeout=900)
    assert done.returncode == 0, f"{shlex.join(argv)}\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}"
    return done


def _as_written(command: str) -> list[str]:
    return shlex.split(command)[1:]  # without "python"


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """The README's first command, two steps long, in a temporary folder."""
    run_dir = tmp_path_factory.mktemp("readme") / "tiny"
    first = next(c for c in COMMANDS if c.startswith("python -m zeroflow.train --config "
                                                      "configs/tiny.yaml") and "--cpu" not in c)
    _run([*_as_written(first), *SHORT, f"run.dir={run_dir}"])
    assert (run_dir / "plot.png").is_file() and (run_dir / "tb").is_dir()
    return run_dir


def _with_run(command: str, run_dir) -> list[str]:
    return [a.replace("runs/tiny", str(run_dir)) if a.startswith("runs/tiny") else a
            for a in _as_written(command)]


@pytest.mark.parametrize("command", [c for c in COMMANDS if " zeroflow.sample " in c
                                     or " zeroflow.export " in c and "--format peft" not in c])
def test_sample_and_export_run_as_written(command, tiny_run, tmp_path):
    argv = _with_run(command, tiny_run)
    argv = [str(tmp_path / a) if a.endswith((".safetensors", ".npz")) else a for a in argv]
    if "zeroflow.sample" in command:
        argv += ["--tokens", "4"]
    _run(argv)


def test_scale_it_runs_as_written(tmp_path):
    command = next(c for c in COMMANDS if "--cpu-devices 4" in c)
    argv = [a for a in _as_written(command) if not a.startswith("run.dir=")]
    done = _run([*argv, *SHORT, f"run.dir={tmp_path / 'zero3'}"])
    assert "ZeRO stage 3" in done.stdout and "'data': 4" in done.stdout


@pytest.mark.parametrize("command", [c for c in COMMANDS if " zeroflow.memory " in c])
def test_memory_commands_parse_as_written(command):
    # Compiling gpt-1b for 8 H100s takes minutes: the flags and the config are what can drift.
    from zeroflow.cli.memory import _parser
    args = _parser().parse_args(_as_written(command)[2:])
    assert (REPO / args.config).is_file()


# FuseMix's command makes its own inputs (fusemix.tiny_encoders) and runs as written in a
# fresh folder in test_fusemix_demo.py.
@pytest.mark.parametrize("command", [c for c in COMMANDS if "finetune-llama" in c])
def test_commands_that_need_prepared_inputs_name_real_files(command):
    config = REPO / _as_written(command)[_as_written(command).index("--config") + 1]
    assert config.is_file()
    prepare = re.findall(r"scripts/\S+\.py", config.read_text())
    assert prepare and all((REPO / p).is_file() for p in prepare), prepare
