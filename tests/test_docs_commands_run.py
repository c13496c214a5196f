"""The commands of docs/*.md that take seconds to a minute of CPU, run for real as a newcomer
would (tests/command_runs.py: a fresh folder, a bare environment), shortened only by what cuts
their length (fewer steps, fewer tokens, one repetition, a smaller checkpoint). The parse check
of every documented command is tests/test_docs_commands.py; the README's are run by
test_readme_commands.py; the ``--help`` ones by test_docs_commands.py's slow case.

Every command of docs/*.md is either run here (``RUN``), or a template, a fragment of a
sentence, or one of these, which stay at the parse check (``PARSED_ONLY``, the fast case below
checks the list is complete), because running them costs far more than a minute or needs what
this machine lacks:
- benchmarks, whose point is their length and repetitions: scripts/bench_step.py,
  bench_autocast.py, bench_data.py, bench_kernel_cache.py, signal_sweep.py (many trainer
  runs, each stopped by a signal), profile_tests.py (py-spy over test files);
- GPU-only programs: scripts/gpu_report.py, bench_kernels.py, bench_offload.py,
  experiments/fusemix_max_batch.py (needs CUDA's ptxas);
- experiments that reproduce a measured figure (each minutes to hours): XLA:GPU compiles of 1B
  to 70B models (gpu_compile, vs_gspmd, fit_table, zero_memory_table, qlora_fit, nf4_memory,
  long_sequence_loss, peak_memory, padding_cost), long CPU runs (autocast_loss_gap,
  adamw_8bit, fusemix_cached_vs_in_step) and a multi-GB checkpoint (nf4_load_memory);
- ``python -m zeroflow.memory`` for GPU targets or 1B+ models (gpt-1b, gpt2-small, the 8B Llama and Qwen3, Gemma-3-12B, the
  long-context 8B: many XLA:GPU compiles), and on the tiny config for every stage, offload and
  remat choice (memory.md: over 3 CPU-minutes) or with 8 ring-attention compiles
  (long_context.md's second --max-seq line); ``python -m zeroflow.planner`` (minutes of
  XLA:GPU compiles per GPU);
- commands for a cluster or a real checkpoint: multihost.md's gpt-1b run on ``/shared``, the
  8B fine-tune from ``/path/to/Llama-3.1-8B``;
- sentences that name a flag of a command (``python -m zeroflow.memory --target``).
"""

import re
import shlex

import pytest
from command_runs import SHORT, fresh_folder, missing_extras, run
from test_docs_commands import COMMANDS, PLACEHOLDER, _markdown_sources

from helpers import REPO

DOCS = [(name, words) for name, words, _ in COMMANDS if name.startswith("docs/")]

# Commands of docs/*.md that stay at the parse check (why: the module docstring), by how the
# command starts.
PARSED_ONLY = (
    "python scripts/bench_step.py", "python scripts/bench_autocast.py",
    "python scripts/bench_data.py", "python scripts/bench_kernel_cache.py",
    "python scripts/signal_sweep.py", "python scripts/profile_tests.py",
    "python scripts/gpu_report.py", "python scripts/bench_kernels.py",
    "python scripts/bench_offload.py", "python experiments/",
    "python -m zeroflow.memory --config configs/gpt-1b.yaml",
    "python -m zeroflow.memory --config configs/gpt2-small.yaml",
    "python -m zeroflow.memory --config configs/finetune-llama3-8b.yaml",
    "python -m zeroflow.memory --config configs/long-context-llama3-8b.yaml",
    "python -m zeroflow.memory --config configs/finetune-qwen3-8b.yaml",
    "python -m zeroflow.memory --config configs/qlora-gemma3-12b.yaml",
    "python -m zeroflow.memory --config configs/tiny.yaml --target h100",
    "python -m zeroflow.memory --config configs/tiny.yaml --devices 8 --device-memory 80GB",
    "python -m zeroflow.memory --config configs/tiny.yaml --devices 1 --device-memory 256MB "
    "--max-seq --seq-step 1024 --max-compiles 8",
    "python -m zeroflow.planner",
    "python -m zeroflow.memory --target", "python -m zeroflow.memory --measure",
    "python -m zeroflow.train --config configs/gpt-1b.yaml run.dir=/shared",
    "python -m zeroflow.train --config configs/finetune-llama3-8b.yaml",
)


def _doc_command(*pieces: str) -> tuple[dict[str, str], list[str]]:
    """The command a docs/*.md line or inline span shows holding every piece (it must still be
    shown as written): the variables set before it (``NAME=value python ...``) and its words
    without ``python``."""
    sources = _markdown_sources()
    if re.fullmatch(r"configs/[\w.-]+\.yaml", pieces[0]):  # a config's header comment shows it
        sources = [(None, 0, line.lstrip("# ")) for line in
                   (REPO / pieces[0]).read_text().splitlines() if line.startswith("#")]
    for doc, _, span in sources:
        if doc is not None and doc.parent.name != "docs":
            continue
        for part in span.split("&&"):
            if "python " in part and all(p in part for p in pieces):
                words = shlex.split(part, comments=True)
                start = words.index("python")
                env = dict(w.split("=", 1) for w in words[:start] if "=" in w)
                return env, words[start + 1:]
    raise AssertionError(f"no command in docs/*.md shows {pieces}: update RUN")


OPTIONAL = "run if the docs show it"
# (the pieces that find the command, what is added to cut its length[, OPTIONAL]); chains in
# order.
RUN = {
    "train, eval-only, plot (runs.md, measured.md)": [
        (("zeroflow.train --config configs/tiny.yaml run.progress=false",), SHORT),
        (("--config runs/tiny/config.yaml train.eval_only=true",),
         ["train.eval_batches=1", "run.progress=false"]),
        (("zeroflow.trainer.plot RUN_DIR",), []),
    ],
    "autocast (autocast.md)": [(("configs/tiny.yaml precision.autocast=bf16",), SHORT)],
    "FP8 autocast (autocast.md)": [(("precision.autocast=fp8 precision.fp8_select=all",), SHORT)],
    "FP8 delayed scaling (autocast.md)": [
        (("precision.fp8_scaling=delayed precision.fp8_select=all",), SHORT)],
    "FP8 saved activations (autocast.md)": [
        (("model.remat=save_dots model.remat_dtype=fp8",), SHORT)],
    "QLoRA on the tiny model (nf4.md)": [(("model.lora.quantize=nf4",), SHORT)],
    "two processes (multihost.md)": [(("zeroflow.launch --processes 2", "run.dir="), SHORT)],
    "longest sequence on the tiny config (long_context.md)": [
        (("--max-seq --seq-step 512",), [])],
    "checkpoint digests (runs.md)": [(("bench_checkpoint_digests.py --gb 1",), [])],
    "command start times (engine.md, runs.md)": [(("bench_cli_start.py",), ["--runs", "1"])],
    "FuseMix with its prepared encoders (fusemix.md)": [
        # Shown while configs/fusemix.yaml needs its encoders made first (no
        # fusemix.tiny_encoders); a config that makes them itself needs no such step.
        (("make_tiny_encoders.py --out runs/fusemix-encoders",), [], OPTIONAL),
        (("zeroflow.train --config configs/fusemix.yaml",), SHORT),
    ],
    "fine-tune and export a Hugging Face model (hf.md)": [
        (("make_tiny_hf.py --out runs/tiny-llama-hf",), []),
        (("zeroflow.train --config configs/finetune-llama.yaml",), SHORT),
        (("--run runs/finetune-llama --format hf",), []),
    ],
    "LoRA fine-tune and both exports (lora.md; the train command from its config)": [
        (("make_tiny_hf.py --out runs/tiny-llama-hf",), []),
        (("configs/lora-llama.yaml", "zeroflow.train --config configs/lora-llama.yaml"), SHORT),
        (("--run runs/lora-llama --format hf --out merged/",), []),
        (("--run runs/lora-llama --format peft --out adapter/",), []),
    ],
    "chat fine-tune and chat sample (data.md)": [
        (("make_tiny_hf.py --out runs/tiny-llama-hf",), []),
        (("make_sft_data.py --out runs/sft-data/stdlib-qa.jsonl",), []),
        (("zeroflow.train --config configs/sft-llama.yaml",), SHORT),
        (("zeroflow.sample --run runs/sft-llama --chat", "--temperature 0"), ["--tokens", "4"]),
    ],
}
# What each case needs beyond the base install (its extra's libraries).
EXTRAS = {
    "FuseMix with its prepared encoders (fusemix.md)": ("torch", "transformers", "sklearn"),
    "fine-tune and export a Hugging Face model (hf.md)": ("torch", "transformers"),
    "LoRA fine-tune and both exports (lora.md; the train command from its config)": (
        "torch", "transformers", "peft"),
    "chat fine-tune and chat sample (data.md)": ("torch", "transformers", "grain", "datasets"),
}
# Placeholders the docs use where a run folder goes, filled with the run made before.
FILLED = {"RUN_DIR": "runs/tiny"}


def _shown(chain):
    """The steps of a chain, less the optional ones the docs do not show."""
    for step in chain:
        try:
            _doc_command(*step[0])
        except AssertionError:
            if OPTIONAL not in step:
                raise
            continue
        yield step


@pytest.mark.fast
def test_every_docs_command_is_run_or_listed_as_parsed_only():
    ran = [["python", *_doc_command(*step[0])[1], *step[1]]
           for chain in RUN.values() for step in _shown(chain)]
    unlisted = []
    for name, words in DOCS:
        text = shlex.join(words)
        template = any(PLACEHOLDER.search(w) or w in FILLED for w in words) or len(words) < 3
        if template or text.startswith(PARSED_ONLY) or words[-1] == "--help":
            continue
        if not any(set(words) <= set(r) for r in ran):
            unlisted.append(f"{name}: {text}")
    assert not unlisted, ("run these in RUN, or say in PARSED_ONLY and the docstring why not:\n"
                          + "\n".join(unlisted))


@pytest.mark.slow
@pytest.mark.parametrize("case", list(RUN))
def test_docs_commands_run_as_written(case, tmp_path):
    missing = missing_extras(*EXTRAS.get(case, ()))
    if missing:
        pytest.skip(f"needs {', '.join(missing)} (an extra not installed here)")
    folder = fresh_folder(tmp_path / "clone")
    for pieces, shorter, *_ in _shown(RUN[case]):
        env, words = _doc_command(*pieces)
        argv = [FILLED.get(w, w) for w in words]
        if "bench_checkpoint_digests.py" in argv[0]:
            argv[argv.index("--gb") + 1] = "0.001"  # 1 MB rather than 1 GB: the same steps
        run([*argv, *shorter], folder, env=env)


def _tiers_of(test_file: str) -> set[str]:
    """The tiers a test file's tests declare (its pytestmark, or each test's mark)."""
    text = (REPO / test_file).read_text()
    for tier in ("fast", "slow"):
        if f"pytestmark = pytest.mark.{tier}" in text:
            return {tier}
    return {tier for tier in ("fast", "slow") if f"@pytest.mark.{tier}" in text}


def _pytest_commands():
    for doc, line, span in _markdown_sources():
        if "python -m pytest" in span and "tests/" in span:
            words = shlex.split(span[span.index("python -m pytest"):])
            yield f"{doc.relative_to(REPO)}:{line}", words


PYTEST_COMMANDS = list(_pytest_commands())


@pytest.mark.fast
def test_the_docs_pytest_commands_name_the_tier_of_their_files():
    # pyproject's addopts deselect the slow tier (-m "not slow"): a command that runs a slow
    # file without -m slow (or -m "" for a file of both tiers) runs nothing, or half of it.
    assert PYTEST_COMMANDS, "no pytest command found in the docs: the search is wrong"
    wrong = []
    for name, words in PYTEST_COMMANDS:
        own = words[3:]  # after "python -m pytest"
        asked = own[own.index("-m") + 1] if "-m" in own else "not slow"
        selected = {"not slow": {"fast"}, "slow": {"slow"}, "": {"fast", "slow"}}[asked]
        tiers = set().union(*(_tiers_of(w) for w in words if w.startswith("tests/")))
        if not tiers <= selected:
            wrong.append(f"{name}: {shlex.join(words)} (its files: {', '.join(sorted(tiers))})")
    assert not wrong, "\n".join(wrong)
