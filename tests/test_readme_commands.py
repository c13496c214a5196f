"""Every command the README shows (``python -m zeroflow...`` and ``python scripts/...``), run as
written in a fresh folder (tests/command_runs.py: what a clone holds, no ``runs/``, a bare
environment), shortened only by overrides that cut its length (fewer steps, fewer tokens), so
the README cannot drift from the code. Chains (``a && b && c``) run in order, as a shell
would; ``pip install -e ".[x]"`` is the test environment's (a chain whose extra is missing is
skipped, naming it). Templates (``configs/<name>.yaml``, ``--config X``) are syntax: the
memory one runs for real with the README's own tiny config, the planner one is parsed.

Two commands are not run for real here, and why:
- ``python -m zeroflow.memory --config configs/gpt-1b.yaml --target h100 --devices 8``:
  compiling a 1B model for 8 H100s with XLA:GPU, for every stage, offload and remat choice,
  takes many CPU-minutes; its flags and config are parsed (the same command's machinery runs
  in test_memory_cli.py and test_gpu_compile.py on small models).
- ``python -m zeroflow.planner --config X ...``: minutes of XLA:GPU compiles per GPU; parsed.
FuseMix's ``python -m zeroflow.train --config configs/fusemix.yaml`` runs for real once its
config makes the tiny encoders itself where they are missing (``fusemix.tiny_encoders``);
until then its inputs are checked to be made by the script its config names."""

import re

import pytest
from command_runs import SHORT, fresh_folder, missing_extras, run, words

from helpers import REPO

pytestmark = pytest.mark.slow

README = (REPO / "README.md").read_text()
BLOCKS = re.findall(r"```bash\n(.*?)```", README, re.S)
SPANS = BLOCKS + [" ".join(s.split()) for s in
                  re.findall(r"`([^`]+)`", re.sub(r"```.*?```", "", README, flags=re.S))]
PROGRAM = re.compile(r"^python (-m zeroflow\.|scripts/|experiments/)")
TEMPLATE = re.compile(r"<|\bX\b|\bN\b|\bDIR\b|\[")


def _chains() -> list[list[str]]:
    """Each line's commands, in order (``&&`` joins them), comments cut off."""
    chains = []
    for span in SPANS:
        for line in span.split("\n"):
            parts = [" ".join(p.split("#")[0].split()) for p in line.split("&&")]
            if any(PROGRAM.match(p) for p in parts):
                chains.append([p for p in parts if p])
    return chains


CHAINS = _chains()
COMMANDS = list(dict.fromkeys(c for chain in CHAINS for c in chain
                              if PROGRAM.match(c) and not TEMPLATE.search(c)))


def _command(*pieces: str) -> str:
    return next(c for c in COMMANDS if all(p in c for p in pieces))


def _chain(*pieces: str) -> list[str]:
    return next(ch for ch in CHAINS if all(any(p in c for c in ch) for p in pieces))


def test_the_readme_shows_the_commands_a_newcomer_needs():
    programs = {c.split()[2] if c.split()[1] == "-m" else c.split()[1] for c in COMMANDS}
    assert {"zeroflow.train", "zeroflow.sample", "zeroflow.export", "zeroflow.memory",
            "scripts/make_tiny_hf.py"} <= programs
    assert any("--cpu-devices 4 parallel.zero_stage=3" in c for c in COMMANDS)  # "scale it"


@pytest.fixture(scope="module")
def clone(tmp_path_factory):
    """A fresh folder in which the README's first command has run (two steps long)."""
    folder = fresh_folder(tmp_path_factory.mktemp("readme") / "clone")
    first = next(c for c in COMMANDS if c == "python -m zeroflow.train --config configs/tiny.yaml")
    run([*words(first), *SHORT], folder)
    run_dir = folder / "runs/tiny"
    assert (run_dir / "plot.png").is_file() and (run_dir / "tb").is_dir()
    return folder


@pytest.mark.parametrize("command", [c for c in COMMANDS if " zeroflow.sample " in c
                                     or " zeroflow.export " in c and "--run" in c])
def test_sample_and_export_run_as_written(command, clone):
    argv = words(command)
    if "zeroflow.sample" in command:
        argv += ["--tokens", "4"]
    run(argv, clone)
    out = argv[argv.index("--out") + 1] if "--out" in argv else None
    assert out is None or (clone / out).is_file()


def test_export_as_a_hugging_face_folder(clone):
    # "(or `--format hf --out DIR`)": the export command above with those flags, DIR a folder.
    argv = [*words(_command(" zeroflow.export ", "--run runs/tiny")), "--format", "hf"]
    argv[argv.index("--out") + 1] = "tiny-hf"
    run(argv, clone)
    assert (clone / "tiny-hf/config.json").is_file()


def test_scale_it_runs_as_written(tmp_path):
    done = run([*words(_command("--cpu-devices 4")), *SHORT], fresh_folder(tmp_path / "clone"))
    assert "ZeRO stage 3" in done.stdout and "'data': 4" in done.stdout
    assert (tmp_path / "clone/runs/tiny-zero3/config.yaml").is_file()


def test_the_memory_template_runs_with_the_readme_config(clone):
    # "`python -m zeroflow.memory --config X --devices N` shows it beside the ZeRO formula for
    # every stage, offload and remat choice": X the README's tiny config, N its 4 devices,
    # limited to one stage, offload and remat choice (flags that only cut its length).
    template = next(s for s in SPANS if s.startswith("python -m zeroflow.memory --config X "
                                                     "--devices N"))
    argv = [w.replace("X", "configs/tiny.yaml") if w == "X" else "4" if w == "N" else w
            for w in words(template)]
    done = run([*argv, "--stages", "3", "--offloads", "none", "--remats", "none"], clone)
    assert "stage" in done.stdout.lower()


@pytest.mark.parametrize("command", [c for c in COMMANDS if " zeroflow.memory " in c])
def test_memory_commands_parse_as_written(command):
    from zeroflow.cli.memory import _parser
    args = _parser().parse_args(words(command)[2:])
    assert (REPO / args.config).is_file()


def test_the_planner_template_parses_with_the_planner_docs_config():
    from zeroflow.cli.planner import parser
    template = next(s for s in SPANS if s.startswith("python -m zeroflow.planner --config X"))
    args = parser().parse_args([w.replace("X", "configs/gpt-1b.yaml") if w == "X" else w
                                for w in words(template)[2:]])
    assert (REPO / args.config).is_file() and args.gpus and args.devices


def test_the_hugging_face_demo_runs_as_written(tmp_path):
    chain = _chain("scripts/make_tiny_hf.py", "configs/finetune-llama.yaml")
    assert chain[0] == 'pip install -e ".[hf]"', chain
    missing = missing_extras("torch", "transformers")
    if missing:
        pytest.skip(f"the hf extra is not installed here ({', '.join(missing)})")
    folder = fresh_folder(tmp_path / "clone")
    for command in chain[1:]:
        run([*words(command), *(SHORT if " zeroflow.train " in command else [])], folder)
    assert (folder / "runs/tiny-llama-hf/config.json").is_file()
    assert (folder / "runs/finetune-llama/metrics.jsonl").is_file()


def _makes_its_own_inputs(config) -> bool:
    from zeroflow.config.io import load_config
    return bool(getattr(load_config(config, []).fusemix, "tiny_encoders", False))


def test_fusemix_runs_as_written(tmp_path):
    command = _command("configs/fusemix.yaml")
    config = REPO / "configs/fusemix.yaml"
    if not _makes_its_own_inputs(config):
        # Until the config writes its tiny encoders itself, the README's command needs them
        # made first: the config must name the script that makes them.
        prepare = re.findall(r"scripts/\S+\.py", config.read_text())
        assert prepare and all((REPO / p).is_file() for p in prepare), prepare
        return
    missing = missing_extras("torch", "transformers", "sklearn")
    if missing:
        pytest.skip(f"the hf and fusemix extras are not installed here ({', '.join(missing)})")
    folder = fresh_folder(tmp_path / "clone")
    done = run([*words(command), *SHORT], folder)
    shown = done.stdout + done.stderr  # the progress lines go to stderr when piped
    assert "i2t_r1" in shown and "t2i_r1" in shown  # retrieval recall, both ways


@pytest.mark.parametrize("command", [c for c in COMMANDS if "finetune-llama" in c])
def test_commands_that_need_prepared_inputs_name_real_files(command):
    config = REPO / words(command)[words(command).index("--config") + 1]
    assert config.is_file()
    prepare = re.findall(r"scripts/\S+\.py", config.read_text())
    assert prepare and all((REPO / p).is_file() for p in prepare), prepare
