"""A QLoRA run (NF4 base, adapters) with ``model.attention: cudnn`` for an H100 target: the
trainer's step lowers with cuDNN's fused attention, and the query, key and value it is given
are bf16 under bf16 precision, in the forward and the backward pass. Lowering (no compile)
keeps it cheap; the compiled peaks are in experiments/nf4_memory.py."""
import re

import zeroflow as zf
from zeroflow import backend
from zeroflow.config.io import load_config
from zeroflow.trainer.setup import abstract_batch, build_run
from zeroflow.util import compat
import pytest

pytestmark = pytest.mark.slow


def _fused_attention_operands(text: str) -> dict[str, list[str]]:
    """``{custom call target: element types of its operands}`` for each cuDNN attention call in
    a StableHLO module's text."""
    calls = {}
    for line in text.splitlines():
        found = re.search(r"custom_call @(__cudnn\$fmha\w*)\(.*\)\s*\{.*\}\s*:\s*\((.*?)\)\s*->",
                          line)
        if found:
            calls[found[1]] = re.findall(r"tensor<[^>]*x(\w+)>", found[2])
    return calls


def test_qlora_step_lowers_with_bf16_cudnn_attention_for_h100():
    cfg = load_config("configs/tiny.yaml", [
        "model.seq_len=64", "model.num_layers=2", "train.batch_size=1", "parallel.grad_accum=1",
        "parallel.zero_stage=0", "precision.params=bf16", "model.attention=cudnn",
        "model.lora.rank=4", "model.lora.quantize=nf4"])
    mesh = zf.target_mesh("h100", data=1)
    with backend.tracing_for(backend.of(mesh)), compat.cudnn_for_target():
        run = build_run(cfg, with_data=False, mesh=mesh)
        batch = abstract_batch(cfg, sharding=run.plan.batch_sharding())
        text = run.make_step().lower(run.abstract_state(), batch).as_text()
    calls = _fused_attention_operands(text)
    assert set(calls) == {"__cudnn$fmhaSoftmax", "__cudnn$fmhaSoftmaxBackward"}
    # q, k, v lead both calls' operands (the backward's then takes the output and its
    # gradient, also in the compute dtype).
    assert calls["__cudnn$fmhaSoftmax"][:3] == ["bf16"] * 3
    assert calls["__cudnn$fmhaSoftmaxBackward"][:3] == ["bf16"] * 3


def test_the_planner_compiles_a_qlora_run_with_cudnn_attention_as_the_target_gpu_allows():
    """``compile_config``, the planner's and ``zeroflow.memory``'s way in, on a QLoRA run with
    cuDNN attention: the adapters' sites are traced for the target's GPUs (not this machine's
    CPU), and jax's cuDNN rules are asked for the target's compute capability. cuDNN takes
    head dims up to 256 on Hopper and up to 128 before it (jax's own check): Gemma 3's 256
    compiles for an H100 and is refused for an A100, in one line before jax's cuDNN call."""
    from zeroflow.trainer.planning import compile_config
    cfg = load_config("configs/tiny.yaml", [
        "model.seq_len=64", "model.num_layers=1", "model.num_heads=2", "model.head_dim=256",
        "train.batch_size=1", "parallel.grad_accum=1", "precision.params=bf16",
        "model.attention=cudnn", "model.lora.rank=4", "model.lora.quantize=nf4"])
    choice = dict(num_devices=1, stage=0, offload="none", update_on="device", remat="none")
    compiled, _ = compile_config(cfg, target="h100", **choice)
    assert "__cudnn$fmhaSoftmax" in compiled.as_text()
    with pytest.raises(ValueError, match=r"model.attention='cudnn' cannot run head dim 256 on "
                       r"NVIDIA A100.* \(compute capability 8\.0\)"):
        compile_config(cfg, target="a100", **choice)
