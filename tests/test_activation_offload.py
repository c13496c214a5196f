"""Remat 'offload_dots': the trainer GPT's matmul outputs kept in pinned host memory for the
backward pass. On abstract H100s (XLA:GPU, compiled without a GPU) against 'save_dots', which
keeps the same outputs in device memory; on XLA:CPU, where host memory is the device's, it
falls back to keeping them there."""
import re
import warnings

import jax
import numpy as np
import pytest

import zeroflow as zf
from zeroflow.config.io import load_config
from zeroflow.memory.measure import analysed, device_peak
from zeroflow.trainer.planning import compile_config
from helpers import REPO, token_batches, train_losses, require_cuda_plugin

pytestmark = pytest.mark.slow

LAYERS, WIDTH, MLP, HEADS, SEQ, BATCH, N = 4, 128, 384, 4, 256, 64, 8
CFG = load_config(REPO / "configs" / "tiny.yaml",
                  ["precision.params=bf16", f"train.batch_size={BATCH}", f"model.seq_len={SEQ}"])
CHOICE = dict(num_devices=N, stage=3, offload="none", update_on="device")
HOST_ARRAY = re.compile(r"(bf16|f32)\[([0-9,]*)\]\{[0-9,]*:S\(5\)\}")


@pytest.fixture(scope="module")
def h100():
    """The step compiled for 8 abstract H100s under each remat choice."""
    require_cuda_plugin()
    return {remat: compile_config(CFG, **CHOICE, remat=remat, target="h100")
            for remat in ("save_dots", "offload_dots")}


def test_offload_lowers_the_xla_gpu_device_peak(h100):
    memory = {remat: analysed(compiled) for remat, (compiled, _) in h100.items()}
    peak = {remat: device_peak(memory[remat], setup.state) for remat, (_, setup) in h100.items()}
    host = memory["offload_dots"].host_temp_bytes
    assert memory["save_dots"].host_temp_bytes == 0 and host > 0
    # What moved to the host is (nearly all) what the device no longer holds.
    assert peak["offload_dots"] < peak["save_dots"] - 0.8 * host


def test_offloaded_activations_are_host_buffers_in_the_compiled_hlo(h100):
    hlo = {remat: compiled.as_text() for remat, (compiled, _) in h100.items()}
    assert not HOST_ARRAY.search(hlo["save_dots"])
    # The matmul outputs of every layer the backward pass reads, stacked over the layers by the
    # scan, in host memory (S(5)): q, k, v [layers, batch, seq, heads, head dim], the attention
    # output [.., width], MLP up and gate [.., mlp width]; nothing else.
    micro = BATCH // N
    shapes = {(dtype, tuple(int(d) for d in dims.split(","))) for dtype, dims
              in HOST_ARRAY.findall(hlo["offload_dots"])}
    assert shapes == {("bf16", (LAYERS, micro, SEQ, HEADS, WIDTH // HEADS)),
                      ("bf16", (LAYERS, micro, SEQ, WIDTH)), ("bf16", (LAYERS, micro, SEQ, MLP))}
    # Written layer by layer in the forward loop, read back in the backward loop, asynchronously:
    # the six the backward pass reads (q, k, v, attention output, MLP up and gate; the MLP's
    # output only feeds the residual sum, which keeps nothing of it).
    lines = hlo["offload_dots"].splitlines()
    writes = [x for x in lines if re.search(r"dynamic-update-slice-start\S* = \(\(\w+\[[0-9,]*\]\{[0-9,]*:S\(5\)", x)]
    reads = [x for x in lines if re.search(r"dynamic-slice-start\S* = \(\(\w+\[[0-9,]*\]\{[0-9,]*:S\(5\)", x)]
    assert len(writes) >= 6 and len(reads) >= 6, (len(writes), len(reads))


def test_the_formula_and_the_memory_table_know_offloaded_activations(h100):
    """The activation formula's offloaded share (what save_dots keeps beyond full remat, the
    block input aside) against XLA:GPU's host buffers: it also counts the MLP's output, which
    only feeds the residual sum and is kept by neither, so it stays over by up to 15%. The
    memory table's host column where compiled is XLA's host bytes per device times a
    process's 8 devices."""
    from zeroflow.planner import memory_table
    from zeroflow.planner.compiling import Measured
    host = analysed(h100["offload_dots"][0]).host_temp_bytes
    formula = zf.memory.offloaded_activations(CFG.model, micro_batch=BATCH // N,
                                              remat="offload_dots")
    assert host <= formula <= 1.15 * host, (formula, host)
    table = memory_table.build(CFG, devices=N, stages=[3], offloads=["none"],
                               remats=["offload_dots"], measure="never", devices_per_process=8)
    [row] = table.rows
    est = zf.memory.estimate_config(CFG, num_devices=N, stage=3, remat="offload_dots",
                                    devices_per_process=8)
    assert table.host(row) == est.host_bytes + 8 * formula  # uncompiled: the formula's
    row.measured = Measured(peak_bytes=1.0, host_bytes=float(host), compile_s=0.0)
    assert table.host(row) == 8 * host


def test_cpu_says_it_keeps_the_activations_in_device_memory():
    from zeroflow.models.gpt import offload_policy
    with pytest.warns(UserWarning, match="cpu has no separate host memory") as caught:
        offload_policy(zf.backend.for_platform("cpu"))
    assert "\n" not in str(caught[0].message)


def test_cpu_training_with_offload_dots_equals_save_dots():
    from zeroflow.trainer.setup import build_run
    small = ["model.num_layers=2", "model.seq_len=16", "train.batch_size=4"]
    losses = {}
    for remat in ("save_dots", "offload_dots"):
        cfg = load_config(REPO / "configs" / "tiny.yaml", small + [f"model.remat={remat}"])
        run = build_run(cfg, with_data=False, devices=jax.devices()[:2])
        with warnings.catch_warnings(record=True):
            state = run.init_state()
            step = run.make_step()
            losses[remat], _, _ = train_losses(step, state, token_batches(
                2, rows=4, seq_len=16, vocab=run.model_cfg.vocab_size))
    np.testing.assert_array_equal(losses["offload_dots"], losses["save_dots"])


def test_activation_formula_moves_save_dots_outputs_to_the_host():
    from zeroflow import memory
    model, acts = CFG.model, {}
    for remat in ("save_dots", "offload_dots", "full"):
        acts[remat] = memory.activations(model, micro_batch=4, remat=remat)
    host = memory.offloaded_activations(model, micro_batch=4, remat="offload_dots")
    assert acts["offload_dots"] == acts["full"] < acts["save_dots"]
    assert host > 0 and acts["offload_dots"] + host == acts["save_dots"]
    assert memory.offloaded_activations(model, micro_batch=4, remat="save_dots") == 0
