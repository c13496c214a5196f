"""``--max-seq`` with the FP8 and long-row options given as ``key=value``: each probe compiles
the config as given, so FP8 matmuls reach the compiled step, and FP8 residuals and
``model.layer_chunk`` lower the peak of a long row (XLA:CPU, the tiny model at 2,048 tokens)."""
import pytest

from zeroflow.cli import max_seq
from zeroflow.config.io import apply_overrides, load_config
from helpers import REPO

pytestmark = pytest.mark.fast

LONG = ["precision.params=bf16", "train.batch_size=1", "model.remat=full", "model.seq_len=2048"]


def probe(overrides, monkeypatch):
    """The probe's peak at 2,048 tokens and the text of its compiled step."""
    texts = []
    real = max_seq.analysed
    monkeypatch.setattr(max_seq, "analysed", lambda c: texts.append(c.as_text()) or real(c))
    cfg = apply_overrides(load_config(str(REPO / "configs" / "tiny.yaml")), LONG + overrides)
    got = max_seq.probe_config(cfg, devices=1, target=None)(2048)
    assert got.peak_bytes is not None, got.note
    return got.peak_bytes, texts[-1]


def test_fp8_matmuls_reach_the_probe(monkeypatch):
    _, fp8 = probe(["precision.autocast=fp8", "precision.fp8_select=all"], monkeypatch)
    _, plain = probe([], monkeypatch)
    assert "f8e4m3fn" in fp8 and "f8e4m3fn" not in plain


def test_fp8_inputs_and_layer_chunk_lower_the_probes_peak(monkeypatch):
    plain, _ = probe([], monkeypatch)
    fp8_inputs, text = probe(["model.remat_dtype=fp8"], monkeypatch)
    chunked, _ = probe(["model.remat_dtype=fp8", "model.layer_chunk=256"], monkeypatch)
    assert "f8e4m3fn" in text
    assert chunked < fp8_inputs < plain
