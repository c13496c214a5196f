"""``python -m zeroflow.memory --remat-dtypes compute,fp8``: the memory table's FP8-residual rows,
only when asked. Reference: a hand count of what FP8 residuals take off save_dots for the tiny
config (its shapes written out below), and the default table's rows, which stay as they were."""
import json

import pytest

from zeroflow.cli.memory import main

pytestmark = pytest.mark.fast

BASE = ["--config", "configs/tiny.yaml", "--devices", "8", "--measure", "never",
        "--stages", "0", "--offloads", "none", "--remats", "none,save_dots",
        "model.seq_len=1024", "precision.params=bf16"]
# tiny: 4 layers, width 128 (4 heads x 32), mlp 384 with SwiGLU; batch 16 over 8 devices
TOKENS = 16 // 8 * 1024
SIX = 128 + 128 + 128 + 128 + 384 + 384  # q, k, v, attention output, up, gate per token
FP8_SAVES = 4 * (TOKENS * SIX * (2 - 1) - 6 * 4)  # bf16 -> one byte, plus an fp32 scale each


def rows(capsys, *extra):
    assert main([*BASE, *extra, "--json"]) == 0
    return [json.loads(line) for line in capsys.readouterr().out.splitlines()]


def test_fp8_rows_only_when_asked_and_saving_the_hand_count(capsys):
    plain = rows(capsys)
    assert [r["remat"] for r in plain] == ["none", "save_dots"]
    assert all("remat_dtype" not in r for r in plain)
    both = rows(capsys, "--remat-dtypes", "compute,fp8")
    assert [(r["remat"], r["remat_dtype"]) for r in both] == [
        ("none", "compute"), ("save_dots", "compute"), ("save_dots", "fp8")]
    assert [r["estimated_peak_bytes"] for r in both[:2]] == [
        r["estimated_peak_bytes"] for r in plain]
    dots, dots8 = (r["formula"]["activations"] for r in both[1:])
    assert dots - dots8 == FP8_SAVES


def test_the_answer_names_fp8_where_only_it_fits(capsys):
    both = rows(capsys, "--remat-dtypes", "compute,fp8")
    dots, dots8 = (r["estimated_peak_bytes"] for r in both[1:])
    between = str((dots + dots8) // 2)
    assert main([*BASE, "--remats", "save_dots", "--remat-dtypes", "compute,fp8",
                 "--device-memory", between]) == 0
    out = capsys.readouterr().out
    assert "save_dots fp8" in out
    assert "model.remat=save_dots model.remat_dtype=fp8 (needs" in out


def test_an_unknown_remat_dtype_is_one_line(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main([*BASE, "--remat-dtypes", "fp4"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) <= 2 and err[-1].startswith("zeroflow.memory: error: argument "
                                                "--remat-dtypes: takes remat dtypes among "
                                                "compute,fp8, got 'fp4'")
