"""Fine-tuning a Hugging Face model through the real entry points: configs/finetune-llama.yaml
on a tiny local Llama (made by scripts/make_tiny_hf.py), its tokenizer in the data pipeline,
sampling, and the export loaded back in transformers."""
import json
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

pytestmark = pytest.mark.slow

torch = pytest.importorskip("torch", reason="torch is in the test extra (pip install -e '.[test]')")
transformers = pytest.importorskip("transformers", reason="transformers is in the test extra")

from zeroflow.cli import export, sample  # noqa: E402
from zeroflow.cli import train as train_cli  # noqa: E402
from zeroflow.config.schema import DataConfig  # noqa: E402
from zeroflow.config.io import load_config  # noqa: E402
from zeroflow.data import load_data, stdlib_root, train_batch  # noqa: E402
from zeroflow.trainer import train  # noqa: E402
from helpers import load_script

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    """A tiny random Llama + BPE tokenizer folder, as scripts/make_tiny_hf.py writes it."""
    folder = tmp_path_factory.mktemp("tiny-llama")
    return load_script("make_tiny_hf").make_tiny_llama(
        folder, vocab_size=300, hidden=32, layers=2, heads=4, kv_heads=2, mlp=64, context=64,
        max_bytes=300_000)


def torch_next_token_loss(model, tokens: np.ndarray) -> float:
    with torch.no_grad():
        out = model(torch.tensor(tokens[:, :-1], dtype=torch.long)).logits
        targets = torch.tensor(tokens[:, 1:], dtype=torch.long).reshape(-1)
        return float(torch.nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]), targets))


def test_finetune_config_trains_samples_and_exports_for_transformers(tiny_llama, tmp_path, capsys):
    cfg = load_config(REPO / "configs/finetune-llama.yaml", [
        f"model.init_from={tiny_llama}", f"data.tokenizer={tiny_llama}", "model.seq_len=32",
        "data.max_bytes=300000", "train.steps=12", "train.batch_size=8", "train.warmup_steps=2",
        "train.eval_every=0", "train.eval_batches=1", "train.log_every=1", "checkpoint.every=0",
        "run.progress=false", f"run.dir={tmp_path / 'run'}"])
    assert cfg.parallel.zero_stage == 3  # the config's own choice, on the 8 emulated devices
    result = train(cfg)
    losses = result.losses
    assert losses[12] < losses[1] - 0.3
    # Step 1's loss is the checkpoint's own: transformers on the same batch agrees.
    data = load_data(cfg.data, cfg.model.seq_len)
    first = train_batch(data.train, 0, global_batch=8, seq_len=32, seed=cfg.train.seed)
    original = transformers.AutoModelForCausalLM.from_pretrained(tiny_llama).eval()
    assert losses[1] == pytest.approx(torch_next_token_loss(original, first), abs=1e-4)

    out = tmp_path / "hf"
    assert export.main(["--run", str(tmp_path / "run"), "--format", "hf", "--out", str(out)]) == 0
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {p.name for p in out.iterdir()}
    tuned = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(tuned).__name__ == "LlamaForCausalLM"
    model_cfg, tokenizer, params, step = sample.load_params(tmp_path / "run")
    assert step == 12
    from zeroflow.models import GPT
    batch = first[:2]
    with torch.no_grad():
        theirs = tuned(torch.tensor(batch, dtype=torch.long)).logits.numpy()
    ours = np.asarray(GPT(model_cfg).apply({"params": params}, jnp.asarray(batch, jnp.int32)))
    np.testing.assert_allclose(theirs, ours, atol=1e-4, rtol=0)
    assert torch_next_token_loss(tuned, first) < torch_next_token_loss(original, first) - 0.3

    # Greedy sampling decodes with the model's tokenizer and continues as transformers does.
    prompt = "def main():\n    "
    capsys.readouterr()
    assert sample.main(["--run", str(tmp_path / "run"), "--prompt", prompt, "--tokens", "8",
                        "--temperature", "0"]) == 0
    printed = capsys.readouterr().out
    hf_tok = transformers.AutoTokenizer.from_pretrained(out)
    ids = hf_tok(prompt).input_ids
    assert ids == tokenizer.encode(prompt) and ids[0] == hf_tok.bos_token_id
    with torch.no_grad():
        for _ in range(8):
            ids.append(int(tuned(torch.tensor([ids])).logits[0, -1].argmax()))
    new = ids[len(tokenizer.encode(prompt)):]
    assert printed == prompt + hf_tok.decode(new, skip_special_tokens=False) + "\n"


def test_prepare_data_tokenizes_with_the_models_tokenizer(tiny_llama, tmp_path):
    prepare_data = load_script("prepare_data")
    corpus = tmp_path / "text"
    corpus.mkdir()
    names = ("textwrap.py", "shlex.py", "fnmatch.py")
    for name in names:
        (corpus / name).write_text(Path(stdlib_root(), name).read_text())
    out = tmp_path / "tokens"
    assert prepare_data.main(["--input", str(corpus), "--out", str(out), "--tokenizer",
                              str(tiny_llama), "--val-fraction", "0", "--quiet"]) == 0
    meta = json.loads((out / "meta.json").read_text())
    assert meta["tokenizer"] == "tokenizer.json" and meta["vocab_size"] == 300
    assert (out / "tokenizer_config.json").is_file()
    # Each document is the tokenizer's encoding (begin-of-text first) then its eos token.
    hf_tok = transformers.AutoTokenizer.from_pretrained(tiny_llama)
    expected = np.concatenate([hf_tok((corpus / n).read_text()).input_ids + [hf_tok.eos_token_id]
                               for n in sorted(names)])
    data = load_data(DataConfig(source=str(out), tokenizer=str(tiny_llama), val_fraction=0.0),
                     seq_len=16)
    np.testing.assert_array_equal(data.train, expected)
    text = load_data(DataConfig(source=str(corpus), tokenizer=str(tiny_llama), val_fraction=0.0),
                     seq_len=16)
    np.testing.assert_array_equal(text.train, expected)
    from tokenizers import Tokenizer, models
    other = tmp_path / "other" / "tokenizer.json"
    other.parent.mkdir()
    Tokenizer(models.WordLevel({"a": 0, "[UNK]": 1}, unk_token="[UNK]")).save(str(other))
    with pytest.raises(ValueError, match="was tokenized with"):
        load_data(DataConfig(source=str(out), tokenizer=str(other.parent)), seq_len=16)


@pytest.mark.parametrize("override,needle", [
    ("model.init_from={missing}", "no Hugging Face config at"),
    ("model.init_from={unsupported}", "architectures[0]='BertForMaskedLM' is not supported"),
])
def test_bad_init_from_is_one_line(override, needle, tiny_llama, tmp_path, capsys):
    (tmp_path / "bert").mkdir()
    bert = {"architectures": ["BertForMaskedLM"]}
    (tmp_path / "bert" / "config.json").write_text(json.dumps(bert))
    override = override.format(missing=tmp_path / "nope", unsupported=tmp_path / "bert")
    code = train_cli.main(["--config", str(REPO / "configs/finetune-llama.yaml"), override,
                           f"data.tokenizer={tiny_llama}", f"run.dir={tmp_path / 'run'}"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and needle in err[0], err
