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
from zeroflow.trainer.planning import compile_config, estimate_config_step
from helpers import REPO, token_batches, train_losses, require_cuda_plugin

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


def test_estimator_knows_offloaded_activations(h100):
    from zeroflow.cli.memory import Row
    est = {remat: estimate_config_step(CFG, **CHOICE, remat=remat, backend="gpu")
           for remat in h100}
    off, saved = est["offload_dots"], est["save_dots"]
    # The same activations are kept, on the host instead of the device.
    assert saved.host_activations == 0 and off.host_activations > 0
    assert off.activations + off.host_activations == pytest.approx(saved.activations, rel=1e-6)
    assert off.host_activations == pytest.approx(
        analysed(h100["offload_dots"][0]).host_temp_bytes, rel=0.1)
    measured = {remat: device_peak(analysed(compiled), setup.state)
                for remat, (compiled, setup) in h100.items()}
    assert saved.peak_bytes == pytest.approx(measured["save_dots"], rel=0.1)
    # With the dots offloaded the estimate is conservative: it adds every activation kept on
    # the device to the first layer's recompute, while XLA:GPU's peak comes inside the
    # attention recompute of a later layer, some of those activations already consumed
    # (+16% on jax 0.10.2). It must not fall under XLA:GPU's peak by more than 10%, nor miss
    # the saving: its device saving is within 15% of XLA:GPU's.
    assert 0.9 * measured["offload_dots"] <= off.peak_bytes <= 1.2 * measured["offload_dots"]
    assert saved.peak_bytes - off.peak_bytes == pytest.approx(
        measured["save_dots"] - measured["offload_dots"], rel=0.15)
    # python -m zeroflow.memory's host column: per process of 8 devices.
    assert Row(3, "none", "offload_dots", "device", off, 8).host_bytes == 8 * off.host_activations


def test_cpu_keeps_the_activations_in_device_memory_and_says_so():
    from zeroflow.models.gpt import offload_policy
    with pytest.warns(UserWarning, match="cpu has no separate host memory") as caught:
        offload_policy(zf.backend.for_platform("cpu"))
    assert "\n" not in str(caught[0].message)
    est = estimate_config_step(CFG, **CHOICE, remat="offload_dots", backend="cpu")
    assert est.host_activations == 0 and est.activations == pytest.approx(
        estimate_config_step(CFG, **CHOICE, remat="save_dots", backend="cpu").activations)


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
