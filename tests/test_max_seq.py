"""The longest sequence that fits (``--max-seq``): the search against the closed-form answer of
a peak formula; compiled on the CPU, the long-context settings holding a row that whole-row
attention cannot hold in the same memory; the long-context config's schema."""
import math
import warnings

import pytest

from zeroflow.cli.max_seq import probe_config
from zeroflow.config.io import load_config
from zeroflow.memory.max_seq import Probe, longest_fitting
from helpers import REPO

pytestmark = pytest.mark.fast


def linear_probe(base, per_token, calls):
    def probe(seq):
        calls.append(seq)
        return Probe(seq, base + per_token * seq, 0.0)
    return probe


@pytest.mark.parametrize("start", [1024, 65536, 10 ** 6])
def test_search_finds_the_formulas_longest_length(start):
    base, per_token, memory, granule = 3e9, 2e5, 80e9, 1024
    calls = []
    got = longest_fitting(linear_probe(base, per_token, calls), memory, start=start,
                          granule=granule, limit=1 << 24, max_compiles=20)
    expected = math.floor((memory - base) / per_token / granule) * granule
    assert got.best.seq == expected and got.first_too_long.seq == expected + granule
    assert got.converged and len(calls) == len(got.probes) <= 20
    assert all(s % granule == 0 for s in calls)


def test_search_stops_at_its_budget_and_its_limit_and_when_nothing_fits():
    calls = []
    short = longest_fitting(linear_probe(3e9, 2e5, calls), 80e9, start=1024, granule=1024,
                            limit=1 << 24, max_compiles=11)
    assert len(calls) == 11 and not short.converged
    assert short.best.seq <= 384_000 < short.first_too_long.seq  # the answer is bracketed
    roomy = longest_fitting(linear_probe(0, 1, []), 80e9, start=1024, granule=1024,
                            limit=8192, max_compiles=12)
    assert roomy.best.seq == 8192 and roomy.first_too_long is None
    none = longest_fitting(linear_probe(100e9, 1, []), 80e9, start=4096, granule=1024,
                           limit=8192, max_compiles=12)
    assert none.best is None and [p.seq for p in none.probes] == [4096, 2048, 1024]


def test_a_length_that_does_not_compile_does_not_fit():
    def probe(seq):
        if seq > 5000:
            return Probe(seq, None, None, "XLA ran out of memory")
        return Probe(seq, 1.0, 0.0)
    got = longest_fitting(probe, 80e9, start=1000, granule=1000, limit=10 ** 5, max_compiles=12)
    assert got.best.seq == 5000 and got.first_too_long.note == "XLA ran out of memory"


def test_bad_search_settings_are_one_line(capsys):
    from zeroflow.memory import __main__ as cli
    with pytest.raises(SystemExit):
        cli.main(["--config", str(REPO / "configs/tiny.yaml"), "--max-seq", "--seq-step", "0"])
    err = capsys.readouterr().err
    assert "argument --seq-step: must be at least 1, got 0" in err and "Traceback" not in err


LENGTH, CONTEXT = 4096, 8
LONG_CONTEXT = ("train.batch_size=1", f"parallel.context={CONTEXT}",
                "model.context_attention=ring", "model.remat=full")
"The long-context settings the CPU can show: the row split over 8 devices, a ring of key/value"
" blocks, each layer's input the only saved activation."


def test_long_context_settings_hold_a_row_whole_row_attention_cannot():
    """The demo in docs/long_context.md, at one length: any step that runs XLA attention on the
    whole row materializes at least one layer's fp32 scores [heads, S, S] (the plain step keeps
    every layer's), so a device of heads x S^2 x 4 bytes cannot hold it. The tiny model's
    long-context step, compiled by XLA:CPU, fits in it: no device ever holds a whole row's
    scores."""
    cfg = load_config(REPO / "configs/tiny.yaml", list(LONG_CONTEXT))
    scores = cfg.model.num_heads * LENGTH ** 2 * 4  # one layer's fp32 [heads, S, S]: 268 MB
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        long = probe_config(cfg, devices=1, target=None)(LENGTH)
    assert long.fits(scores), (long.peak_bytes, scores)


def test_the_long_context_config_validates_as_planned():
    """The config whose memory plan docs/long_context.md reports (schema only, no compile):
    it and its 8 x H100 variant load, and carry the settings the plan was compiled with."""
    from zeroflow.models.gpt import check_config
    from zeroflow.trainer.setup import run_model_config
    path = REPO / "configs/long-context-llama3-8b.yaml"
    eight = ["parallel.context=8", "model.attention=pallas", "model.context_attention=ring",
             "parallel.update_on=device"]
    for overrides in ([], eight):
        cfg = load_config(path, overrides)
        model = run_model_config(cfg)  # the architecture from config.json
        check_config(model)
        assert (model.num_layers, model.embed_dim, model.seq_len) == (32, 4096, 524288)
        assert (model.remat, model.loss_chunk, model.mlp_chunk) == ("offload_input", 4096, 8192)
        assert (cfg.parallel.zero_stage, cfg.parallel.offload) == (3, "optimizer+params")


def test_cli_answers_with_the_longest_fit_and_the_host_memory_per_process(monkeypatch, capsys):
    """``--max-seq`` end to end with the compile replaced by a formula (a 10 GB base, 100 KB
    and 20 KB of host memory per token): the answer and the host to provision follow from it."""
    import json

    from zeroflow.cli import max_seq
    from zeroflow.memory import __main__ as cli
    seen = {}

    def formula(cfg, *, devices, target):
        seen.update(devices=devices, context=cfg.parallel.context, target=target)
        return lambda seq: Probe(seq, 10e9 + 1e5 * seq, 2e4 * seq)
    monkeypatch.setattr(max_seq, "probe_config", formula)
    argv = ["--config", str(REPO / "configs/tiny.yaml"), "--devices", "2", "--max-seq",
            "--device-memory", "80GB", "--seq-step", "1000", "--max-compiles", "20",
            "parallel.context=4",
            "model.context_attention=ring"]
    assert cli.main([*argv, "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert seen == {"devices": 2, "context": 4, "target": None}
    assert got["max_seq"] == 700_000 and got["first_too_long"] == 701_000 and got["converged"]
    # 2 data x 4 context devices, all in one process: 8 x 20 KB x 700,000 tokens.
    assert got["host_bytes_per_process"] == 8 * 2e4 * 700_000
    assert cli.main(argv) == 0
    text = capsys.readouterr().out
    assert "700,000 tokens per row" in text and "701,000 does not fit" in text


def test_the_table_counts_every_context_device_in_a_process(capsys):
    """2 data x 4 context devices are 8 devices of one host, each with its own offloaded
    state: the host memory per process is 8 devices' (it counted the 2 data devices only)."""
    import json

    from zeroflow.memory import __main__ as cli
    assert cli.main(["--config", str(REPO / "configs/tiny.yaml"), "--devices", "2", "--measure",
                     "never", "--json", "--stages", "3", "--offloads", "optimizer", "--remats",
                     "full", "parallel.context=4", "model.context_attention=ring",
                     "parallel.offload=optimizer"]) == 0
    row = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    # One device's offloaded state by the ZeRO formula (remat full offloads no activations).
    from zeroflow.config.io import load_config
    from zeroflow.memory import estimate_config
    cfg = load_config(REPO / "configs/tiny.yaml", ["parallel.context=4",
                                                   "model.context_attention=ring",
                                                   "parallel.offload=optimizer"])
    per_device = estimate_config(cfg, num_devices=2, stage=3, offload="optimizer", remat="full",
                                 devices_per_process=1).host_bytes
    assert per_device > 0 and row["host_bytes_per_process"] == pytest.approx(8 * per_device, abs=8)
