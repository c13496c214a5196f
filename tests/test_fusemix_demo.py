"""README's FuseMix command, as written, in a fresh folder (nothing but configs/fusemix.yaml):
the run writes its two tiny encoders itself, encodes, trains and evaluates, and its piped lines
are whole; without torch it says in one line what to install and writes nothing."""
import json
import re
import shlex
import shutil
import subprocess
import sys

import pytest
from helpers import REPO, one_cpu_env

pytestmark = pytest.mark.slow

pytest.importorskip("sklearn", reason="the digits come with scikit-learn (the fusemix extra)")

README = (REPO / "README.md").read_text()
# The FuseMix paragraph's command, read from the README itself so that the test follows it.
INLINE = re.findall(r"`([^`]+)`", re.sub(r"```.*?```", "", README, flags=re.S))
COMMAND = next(command.strip() for span in INLINE for command in span.split("&&")
               if command.strip().startswith("python -m zeroflow.train")
               and "configs/fusemix.yaml" in command)


def _fresh_folder(tmp_path):
    """A folder as a fresh clone has it for this command: the config, no runs/."""
    (tmp_path / "configs").mkdir()
    shutil.copy(REPO / "configs" / "fusemix.yaml", tmp_path / "configs")
    return tmp_path


def _run(folder, argv, **env):
    return subprocess.run(argv, cwd=folder, capture_output=True, text=True, timeout=900,
                          env=one_cpu_env(cache_every_program=True, COLUMNS="60", **env))


def test_readme_command_makes_its_encoders_and_trains(tmp_path):
    pytest.importorskip("transformers", reason="the tiny encoders are made with transformers")
    folder = _fresh_folder(tmp_path)
    argv = [sys.executable, *shlex.split(COMMAND)[1:]]
    # shortened only: 100 of its 400 steps, an evaluation at 50 and 100
    done = _run(folder, [*argv, "train.steps=100", "train.eval_every=50", "checkpoint.every=0"])
    assert done.returncode == 0, done.stderr[-3000:]
    encoders = folder / "runs" / "fusemix-encoders"
    assert (encoders / "vision" / "config.json").is_file()
    assert (encoders / "text" / "tokenizer.json").is_file()
    assert not list(encoders.glob("*.partial"))  # written whole, then renamed into place
    vision = json.loads((encoders / "vision" / "config.json").read_text())
    assert (vision["model_type"], vision["image_size"], vision["patch_size"]) == (
        "clip_vision_model", 32, 8)

    out = done.stdout + done.stderr
    assert "wrote the tiny random encoders" in out
    chance = float(re.search(r"chance recall@1 ([\d.]+)", out).group(1))
    # piped: each evaluation is one line holding all six figures, however narrow COLUMNS is
    evals = [line for line in out.splitlines() if line.startswith("step 100:")]
    assert len(evals) == 1 and len(re.findall(r"\b[it]2[ti]_r\d+ [\d.]+", evals[0])) == 6
    figures = dict(re.findall(r"\b([it]2[ti]_r\d+) ([\d.]+)", evals[0]))
    # 100 steps align the two random encoders' latents far above chance (0.13 / 0.17 measured
    # against 0.014 on 2026-12-04)
    assert float(figures["i2t_r1"]) > 4 * chance and float(figures["t2i_r1"]) > 4 * chance
    rows = [json.loads(r) for r in open(folder / "runs" / "fusemix" / "metrics.jsonl")]
    assert {r["step"] for r in rows if "i2t_r1" in r} == {50, 100}


BLOCK_TORCH = """
import importlib.abc, runpy, sys
class Missing(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("torch", "transformers"):
            raise ModuleNotFoundError(f"No module named {name!r}")
sys.meta_path.insert(0, Missing())
sys.argv = ["zeroflow.train", *sys.argv[1:]]
from zeroflow.cli.common import start_command
start_command("train")  # as python -m zeroflow.train prepares itself (run from -c here)
runpy.run_module("zeroflow.train", run_name="__main__")
"""


def test_without_torch_one_line_names_the_extra(tmp_path):
    folder = _fresh_folder(tmp_path)
    done = _run(folder, [sys.executable, "-c", BLOCK_TORCH, *shlex.split(COMMAND)[3:]])
    assert done.returncode == 2, done.stderr[-3000:]
    assert done.stderr.strip().splitlines() == [
        "zeroflow.train: error: fusemix.tiny_encoders: the tiny encoders are made with torch "
        "and transformers (No module named 'torch'): pip install -e \".[hf,fusemix]\""]
    assert not (folder / "runs").exists()  # nothing written
