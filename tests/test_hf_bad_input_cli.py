"""The commands on checkpoints they cannot use, as a user meets them: ``python -m
zeroflow.train --config X`` with ``model.init_from`` pointing at a folder of an unsupported
architecture or rope scaling, with a tensor missing or of the wrong shape, or with a tokenizer
larger than the model's vocabulary, and ``python -m zeroflow.export`` of a run whose checkpoint
folder became one of those: exit 2, one line naming the file and the key, nothing written.
A Gemma 3 multimodal folder trains with one warning line. Tiny folders made on the spot by
transformers (nothing downloaded); each command is its own process (slow)."""
import json
import shutil
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch", reason="torch is in the test extra (pip install -e '.[test]')")
transformers = pytest.importorskip("transformers", reason="transformers is in the test extra")
from safetensors.numpy import load_file, save_file  # noqa: E402
from tokenizers import Tokenizer, models, pre_tokenizers  # noqa: E402

from helpers import one_cpu_env  # noqa: E402
from test_hf_bad_input import GEMMA3, QWEN3  # noqa: E402

pytestmark = pytest.mark.slow
T = transformers


def _tokenizer(folder, size: int):
    vocab = {f"w{i}": i for i in range(size - 1)} | {"[UNK]": size - 1}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(folder / "tokenizer.json"))


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    """A tiny Qwen3 folder with a 60-token tokenizer, and a text to train on."""
    root = tmp_path_factory.mktemp("good")
    torch.manual_seed(0)
    T.Qwen3ForCausalLM(T.Qwen3Config(**QWEN3)).save_pretrained(root / "qwen3")
    _tokenizer(root / "qwen3", 60)
    (root / "text.txt").write_text(" ".join(f"w{i % 50}" for i in range(4000)))
    return root


def _bad(good, tmp_path, config=None, tensors=None, tokens=None):
    folder = tmp_path / "bad"
    shutil.copytree(good / "qwen3", folder)
    if config is not None:
        raw = json.loads((folder / "config.json").read_text())
        config(raw)
        (folder / "config.json").write_text(json.dumps(raw))
    if tensors is not None:
        weights = load_file(folder / "model.safetensors")
        tensors(weights)
        save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    if tokens is not None:
        _tokenizer(folder, tokens)
    return folder


def _command(*argv) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", *argv], capture_output=True, text=True,
                          env=one_cpu_env(), timeout=600)


def _train(folder, text, run_dir, config_dir):
    config = config_dir / "train.yaml"
    config.write_text(
        f"model:\n  init_from: {folder}\n  seq_len: 16\n"
        f"data:\n  source: {text}\n  tokenizer: {folder}\n"
        f"train:\n  steps: 2\n  batch_size: 2\n  eval_batches: 1\n"
        f"run:\n  dir: {run_dir}\n  progress: false\n")
    return _command("zeroflow.train", "--config", str(config))


def _assert_one_line(done, *needles):
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1, (done.returncode, done.stderr[-3000:])
    for needle in needles:
        assert needle in lines[0], lines[0]


EXPERTS = "model.layers.0.mlp.experts.0.up_proj.weight"
UP = "model.layers.0.mlp.up_proj.weight"
CASES = {
    "moe": (dict(config=lambda c: c.update(architectures=["Qwen3MoeForCausalLM"],
                                           model_type="qwen3_moe", num_experts=4)),
            "config.json", ["architectures[0]='Qwen3MoeForCausalLM'", "mixture-of-experts"]),
    "yarn": (dict(config=lambda c: c.update(rope_scaling={
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32})),
        "config.json", ["rope_scaling.rope_type='yarn'"]),
    "missing": (dict(tensors=lambda t: t.pop("model.norm.weight")),
                "model.safetensors", ["no tensor 'model.norm.weight'"]),
    "shape": (dict(tensors=lambda t: t.update({UP: t[UP][:40]})),
              "model.safetensors", [UP, "[40, 32]", "[48, 32]"]),
    "experts": (dict(tensors=lambda t: t.update({EXPERTS: t[UP]})),
                "model.safetensors", [EXPERTS]),
    "tokenizer": (dict(tokens=150), "tokenizer.json",
                  ["data.tokenizer", "150 tokens", "config.json vocab_size=101"]),
}


@pytest.mark.parametrize("case", list(CASES))
def test_train_on_a_bad_checkpoint_is_one_line_exit_2_and_writes_nothing(case, good, tmp_path):
    edits, file, needles = CASES[case]
    folder = _bad(good, tmp_path, **edits)
    done = _train(folder, good / "text.txt", tmp_path / "run", tmp_path)
    _assert_one_line(done, f"{folder / file}", *needles)
    assert done.stdout == "" and not (tmp_path / "run").exists()


def test_export_of_a_run_whose_checkpoint_became_unreadable_is_one_line(good, tmp_path):
    """A run trained on a good folder, exported after the folder's config.json changed to a
    MoE one, or its weights lost a tensor: exit 2, one line, no --out folder. Restored, the
    same export writes the folder (the refusal was the checkpoint's, not the run's)."""
    folder = _bad(good, tmp_path)
    run = tmp_path / "run"
    done = _train(folder, good / "text.txt", run, tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    config = (folder / "config.json").read_text()
    moe = {**json.loads(config), "architectures": ["Qwen3MoeForCausalLM"]}
    (folder / "config.json").write_text(json.dumps(moe))
    out = tmp_path / "hf"
    done = _command("zeroflow.export", "--run", str(run), "--format", "hf", "--out", str(out))
    _assert_one_line(done, f"{folder / 'config.json'}", "architectures[0]='Qwen3MoeForCausalLM'")
    assert not out.exists()
    (folder / "config.json").write_text(config)
    done = _command("zeroflow.export", "--run", str(run), "--format", "hf", "--out", str(out))
    assert done.returncode == 0 and (out / "model.safetensors").is_file(), done.stderr[-3000:]


def test_gemma3_multimodal_trains_with_one_warning_line(good, tmp_path):
    """The vision tower is ignored with one line saying what is read; training goes on."""
    vision = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                  num_attention_heads=2, image_size=28, patch_size=14)
    folder = tmp_path / "mm"
    torch.manual_seed(0)
    T.Gemma3ForConditionalGeneration(T.Gemma3Config(
        text_config={**GEMMA3, "vocab_size": 80}, vision_config=vision, mm_tokens_per_image=4,
        image_token_index=79, boi_token_index=77, eoi_token_index=78)).save_pretrained(folder)
    _tokenizer(folder, 60)
    done = _train(folder, good / "text.txt", tmp_path / "run", tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    warnings = [line for line in done.stderr.splitlines() if "warning" in line]
    vision_lines = [line for line in warnings if "vision tower" in line]
    assert len(vision_lines) == 1, done.stderr[-3000:]
    assert vision_lines[0].startswith(f"zeroflow.train: warning: {folder / 'config.json'}: "
                                      "Gemma3ForConditionalGeneration read as its text decoder")
