"""Fine-tuning on conversations through the real entry points: configs/sft-llama.yaml shrunk,
on a tiny local Llama (scripts/make_tiny_hf.py) and docstring Q&A (scripts/make_sft_data.py).

The first step's loss is checked against transformers running each packed example alone, so
packing, positions, attention segments and the assistant-only loss mask are all checked
end to end; a run resumed from a checkpoint continues with the batches the uninterrupted run
saw; and zeroflow.sample --chat answers through the chat template."""
import json
import shutil
from pathlib import Path

import numpy as np
import pytest

pytestmark = pytest.mark.slow

torch = pytest.importorskip("torch", reason="torch is in the test extra (pip install -e '.[test]')")
transformers = pytest.importorskip("transformers", reason="transformers is in the test extra")

from zeroflow.cli import sample  # noqa: E402
from zeroflow.config.io import load_config  # noqa: E402
from zeroflow.data import load_data  # noqa: E402
from zeroflow.trainer import train  # noqa: E402
from helpers import load_script  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
SEQ, BATCH, STEPS = 128, 8, 4


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """(tiny Llama folder, conversations .jsonl): what the config's launch lines make."""
    root = tmp_path_factory.mktemp("sft")
    folder = load_script("make_tiny_hf").make_tiny_llama(
        root / "llama", vocab_size=300, hidden=32, layers=2, heads=4, kv_heads=2, mlp=64,
        context=64, max_bytes=300_000)
    conversations = load_script("make_sft_data").conversations(max_chars=120)
    source = root / "qa.jsonl"
    source.write_text("".join(json.dumps(c) + "\n" for c, _ in zip(conversations, range(300))))
    return folder, source


def _config(folder, source, run_dir):
    return load_config(REPO / "configs/sft-llama.yaml", [
        f"model.init_from={folder}", f"data.tokenizer={folder}", f"data.source={source}",
        f"model.seq_len={SEQ}", f"train.steps={STEPS}", f"train.batch_size={BATCH}",
        "train.warmup_steps=1", "train.eval_every=0", "train.eval_batches=1",
        "train.log_every=1", "checkpoint.every=2", "run.progress=false", f"run.dir={run_dir}"])


def _reference_loss(model, batch) -> float:
    """The step's loss as the engine defines it on 8 devices of one row each: every row's
    mean loss over its trained targets, averaged over rows; each example run alone."""
    rows = []
    for row in range(len(batch["tokens"])):
        seg = batch["segment_ids"][row]
        total = count = 0.0
        for s in sorted(set(seg[seg > 0].tolist())):
            at = seg == s
            inputs = torch.tensor(batch["tokens"][row][at][None], dtype=torch.long)
            with torch.no_grad():
                logits = model(inputs).logits[0]
            losses = torch.nn.functional.cross_entropy(
                logits, torch.tensor(batch["targets"][row][at], dtype=torch.long), reduction="none")
            weights = torch.tensor(batch["loss_mask"][row][at], dtype=torch.float32)
            total += float((losses * weights).sum())
            count += float(weights.sum())
        rows.append(total / max(count, 1.0))
    return float(np.mean(rows))


def test_sft_config_trains_on_assistant_tokens_resumes_and_chats(setup, tmp_path, capsys):
    folder, source = setup
    run_dir = tmp_path / "run"
    cfg = _config(folder, source, run_dir)
    assert (cfg.data.format, cfg.data.train_on, cfg.parallel.zero_stage) == ("chat", "completion", 3)
    result = train(cfg)
    assert result.step == STEPS
    printed = capsys.readouterr().out
    assert "of tokens real" in printed and "trained on" in printed

    # Step 1 is the checkpoint's own loss on the first packed batch, per trained token.
    data = load_data(cfg.data, SEQ)
    first = next(iter(data.train_batches(batch_size=BATCH, seed=cfg.train.seed)))
    assert 0 < first["loss_mask"].sum() < (first["segment_ids"] > 0).sum()  # prompts masked out
    original = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    assert result.losses[1] == pytest.approx(_reference_loss(original, first), abs=1e-4)

    # Throughput counts only trained tokens.
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    step1 = next(m for m in metrics if m["step"] == 1 and "loss" in m)
    assert step1["trained_tokens"] == int(first["loss_mask"].sum())
    assert step1["tokens_per_s"] == pytest.approx(step1["trained_tokens"] / step1["step_time"])

    # Resume from step 2 (the loader position is in the checkpoint): steps 3 and 4 repeat.
    assert (run_dir / "checkpoints" / "2" / "loader" / "process_0-of-1.json").is_file()
    shutil.rmtree(run_dir / "checkpoints" / str(STEPS))
    resumed = train(cfg)
    assert sorted(resumed.losses) == [3, 4]
    for step in (3, 4):
        assert resumed.losses[step] == pytest.approx(result.losses[step], abs=1e-6)

    capsys.readouterr()
    assert sample.main(["--run", str(run_dir), "--chat", "--prompt", "What does len do?",
                        "--tokens", "4", "--temperature", "0"]) == 0
    assert capsys.readouterr().out.strip("\n") != ""
