"""Every key of the trainer's config refuses a wrong type and an out-of-range value in one line
that names it; every typed flag of every CLI refuses a wrong type in one line, exit 2.

The keys are found by walking the config dataclasses, so a new key is swept without a new
test: a wrong type and a wrong choice are derived from its type and choices, and its range
must be written in ``RANGES`` below (the sweep fails until it is). Most of it runs in-process
(the loader and the CLIs' own ``main``); two subprocesses check the real command."""

import contextlib
import dataclasses
import io
import os
import subprocess
import sys
import typing

import pytest
import yaml

from helpers import REPO
from zeroflow.cli import export, launch, memory, planner, sample, train
from zeroflow.config.io import ConfigError, config_from_dict, load_config
from zeroflow.config.schema import CHOICES, Config

pytestmark = pytest.mark.fast


def leaves(cls=Config, prefix=""):
    """``(dotted key, type, choices or None)`` of every settable key, nested sections entered."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        key = f"{prefix}.{f.name}" if prefix else f.name
        if dataclasses.is_dataclass(hints[f.name]):
            yield from leaves(hints[f.name], key)
        else:
            yield key, hints[f.name], f.metadata.get(CHOICES)


KEYS = list(leaves())
NUMERIC = [key for key, typ, choices in KEYS if typ in (int, float) and not choices]

# Each numeric key: values just outside its allowed range, and one just inside (accepted: the
# check is not stricter than documented). Written from each key's documented meaning.
RANGES = {
    "model.vocab_size": ([0], 1), "model.seq_len": ([0], 1), "model.num_layers": ([0], 1),
    "model.embed_dim": ([0, -4], 4), "model.num_heads": ([0], 1), "model.num_kv_heads": ([-1], 0),
    "model.head_dim": ([-1], 0), "model.mlp_dim": ([0], 1), "model.rope_base": ([0, -1], 0.5),
    "model.loss_chunk": ([-1], 0), "model.loss_vocab_chunk": ([0], 1), "model.mlp_chunk": ([-1], 0),
    "model.layer_chunk": ([-1], 0),
    "model.mlp_density": ([0, 1.01], 1), "model.mlp_block_size": ([0, 16, 48, 256], 32),
    "model.dropout": ([-0.1, 1], 0.99), "model.max_positions": ([-1], 0),
    "model.norm_eps": ([0, -1e-6], 1e-12), "model.rope_scaling_factor": ([0], 0.5),
    "model.rope_low_freq_factor": ([0, 4], 3.9), "model.rope_high_freq_factor": ([1, 0.5], 1.1),
    "model.rope_original_max_positions": ([0], 1), "model.sliding_window": ([-1], 0),
    "model.attn_softcap": ([-1], 0), "model.logit_softcap": ([-1], 0),
    "model.query_pre_attn_scalar": ([-1], 0), "model.local_rope_base": ([-1], 0),
    "model.global_every": ([-1], 0), "model.norm_offset": ([-0.5, 1.5], 1),
    "model.lora.rank": ([-1], 0), "model.lora.alpha": ([0, -8], 0.01),
    "model.lora.dropout": ([-0.1, 1], 0.5),
    "data.val_fraction": ([-0.1, 1], 0), "data.max_bytes": ([-1], 0), "data.packing_bins": ([0], 1),
    "train.steps": ([0, 2**31], 2**31 - 1), "train.batch_size": ([0], 1), "train.lr": ([-1e-3], 0),
    "train.min_lr_ratio": ([-0.1, 1.1], 1), "train.warmup_steps": ([-1], 0),
    "train.weight_decay": ([-0.1], 0), "train.b1": ([-0.1, 1], 0), "train.b2": ([-0.1, 1], 0.999),
    "train.grad_clip": ([-1], 0), "train.seed": ([-1, 2**32], 2**32 - 1), "train.log_every": ([0], 1),
    "train.eval_every": ([-1], 0), "train.eval_batches": ([-1], 0),
    "train.spike_factor": ([-1, 0.5, 1], 1.01), "train.spike_window": ([0], 1),
    "train.max_grad_norm": ([-1], 0), "train.rollback_lr_factor": ([0, 1.5], 1),
    "train.max_rollbacks": ([-1], 0),
    "parallel.data": ([0, -2], -1), "parallel.model": ([0], 1), "parallel.context": ([0], 1),
    "parallel.grad_accum": ([0], 1), "parallel.quantize_block": ([0, -256], 1),
    "parallel.hosts": ([-1], 0),
    "precision.init_scale": ([0, -1], 1), "precision.growth_interval": ([0], 1),
    "precision.min_scale": ([0, 65536], 32768), "precision.max_consecutive_skips": ([0], 1),
    "precision.fp8_history": ([0, -1], 1), "precision.fp8_margin": ([-1], 0),
    "checkpoint.every": ([-1], 0), "checkpoint.keep": ([0, -1], 1), "checkpoint.keep_every": ([-1], 0),
    "fusemix.max_text_len": ([0], 1), "fusemix.encode_batch": ([0], 1),
    "fusemix.val_pairs": ([0], 1), "fusemix.shared_dim": ([0], 1), "fusemix.adapter_hidden": ([0], 1),
    "fusemix.adapter_layers": ([0], 1), "fusemix.adapter_expansion": ([0], 1),
    "fusemix.temperature": ([0, -0.07], 1e-3), "fusemix.mixup_alpha": ([-0.1], 0),
    "fusemix.prefetch": ([-1], 0),
}  # fmt: skip

WRONG_TEXT = {int: ["x", "1.5", "2e3"], float: ["x", "inf", "nan"], bool: ["maybe", "2"], str: []}
"Overrides are text: a string fits every str key."
WRONG_YAML = {int: [1.5, [1], "x"], float: [[1.0], True, "x"], bool: [2, "x"],
              str: [[1], {"a": 1}, True]}  # fmt: skip


def one_line_naming(key, make):
    with pytest.raises(ConfigError) as info:
        make()
    message = str(info.value)
    assert "\n" not in message and key in message, message
    return message


def nested(key, value):
    """``{"model": {"lora": {"rank": value}}}`` for ``model.lora.rank``: a YAML document."""
    *sections, name = key.split(".")
    data = {name: value}
    for section in reversed(sections):
        data = {section: data}
    return data


def test_every_numeric_key_has_its_range_written_down():
    assert sorted(RANGES) == sorted(NUMERIC)


@pytest.mark.parametrize("key, typ, choices", KEYS, ids=[k for k, _, _ in KEYS])
def test_a_wrong_value_for_any_key_is_one_line_naming_it(key, typ, choices, tmp_path):
    for value in WRONG_TEXT[typ]:
        one_line_naming(key, lambda: load_config(None, [f"{key}={value}"]))
    for value in WRONG_YAML[typ]:
        one_line_naming(key, lambda: config_from_dict(nested(key, value)))
    if choices:
        wrong = 9 if typ is int else "no-such-choice"
        message = one_line_naming(key, lambda: load_config(None, [f"{key}={wrong}"]))
        assert all(str(c) in message for c in choices), message
    for bad in RANGES.get(key, ([], None))[0]:
        one_line_naming(key, lambda: load_config(None, [f"{key}={bad}"]))
    if typ is int:  # past int64 (what numpy and XLA hold): refused, not an OverflowError later
        for huge in (2**63, -(2**63) - 1, 10**30):
            one_line_naming(key, lambda: load_config(None, [f"{key}={huge}"]))
    if key in RANGES:
        good = RANGES[key][1]
        value = load_config(None, [f"{key}={good}"])
        for name in key.split("."):
            value = getattr(value, name)
        assert value == good
    # The same through a YAML file: the message also names the file.
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(nested(key, WRONG_YAML[typ][0])))
    assert str(path) in one_line_naming(key, lambda: load_config(path))


def test_the_real_command_refuses_a_bad_key_in_one_line_and_creates_nothing(tmp_path):
    run_dir = tmp_path / "run"
    for override in ("precision.init_scale=-1",):
        proc = subprocess.run(
            [sys.executable, "-m", "zeroflow.train", f"run.dir={run_dir}", override],
            capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(REPO)},
        )  # fmt: skip
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode == 2 and len(lines) == 1, proc.stderr
        assert lines[0].startswith("zeroflow.train: error: " + override.split("=")[0]), lines
        assert not run_dir.exists() and proc.stdout == ""


@pytest.mark.parametrize("main, argv, named", [
    (train.main, ["data.source={tmp}/no-data"], "no-data"),
    (train.main, ["data.tokenizer={tmp}/no-tokenizer.json"], "no-tokenizer.json"),
    (train.main, ["model.init_from={tmp}/no-model"], "no-model"),
    (train.main, ["--config", "{tmp}/no-config.yaml"], "no-config.yaml"),
    (sample.main, ["--run", "{tmp}/no-run"], "no-run"),
    (export.main, ["--run", "{tmp}/no-run", "--out", "{tmp}/w.npz"], "no-run"),
    (memory.main, ["--config", "{tmp}/no-config.yaml"], "no-config.yaml"),
], ids=["data.source", "data.tokenizer", "model.init_from", "train-config", "sample-run",
        "export-run", "memory-config"])
def test_a_missing_file_is_one_line_naming_it_and_leaves_nothing(main, argv, named, tmp_path,
                                                                  capsys):
    argv = [a.format(tmp=tmp_path) for a in argv]
    if main is train.main:
        argv.append(f"run.dir={tmp_path}/run")
    try:
        code = main(argv)
    except SystemExit as e:
        code = e.code
    lines = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and named in lines[0], lines
    assert list(tmp_path.iterdir()) == []


# --- every CLI's typed flags -------------------------------------------------------------------

CLIS = {  # the flags each needs besides the one under test, so only that one is wrong
    "train": (train.main, train.parser(), []),
    "sample": (sample.main, sample.parser(), ["--run", "nowhere"]),
    "export": (export.main, export.parser(), ["--run", "nowhere", "--out", "w.npz"]),
    "memory": (memory.main, memory._parser(), []),
    "planner": (planner.main, planner.parser(), []),
    "launch": (launch.main, launch.parser(), ["--processes", "1"]),
}


def typed_flags():
    """``(cli, flag, wrong value)`` for every flag with a type or choices, read off the parsers."""
    for name, (_, parser, _) in CLIS.items():
        for action in parser._actions:
            flag = max(action.option_strings, key=len, default=None)
            if flag is None or flag in ("--help",):
                continue
            if action.choices:
                yield name, flag, "no-such-choice"
            elif action.type is not None and getattr(action.type, "__name__", "") != "text":
                yield name, flag, "x"  # text flags: their empty value, tests/test_bad_cli_flags.py


FLAGS = list(typed_flags())


@pytest.mark.parametrize("cli, flag, value", FLAGS, ids=[f"{c}{f}" for c, f, _ in FLAGS])
def test_a_wrong_flag_value_for_any_cli_is_one_line_naming_it(cli, flag, value, tmp_path,
                                                               monkeypatch):
    main, _, needed = CLIS[cli]
    monkeypatch.chdir(tmp_path)
    argv = [*needed, flag, value] + (["--", "true"] if cli == "launch" else [])
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            code = main(argv)
        except SystemExit as e:
            code = e.code
    lines = err.getvalue().strip().splitlines()
    assert code == 2 and len(lines) == 1, lines
    assert flag in lines[0] and ": error: " in lines[0], lines
    assert list(tmp_path.iterdir()) == []  # nothing written


def test_the_sweep_covers_every_cli():
    assert {cli for cli, _, _ in FLAGS} == set(CLIS)
