"""A Hugging Face Llama read straight into NF4 (hf.from_pretrained(..., quantize="nf4")), placed
in its ZeRO-3 shards, against transformers running the same checkpoint with each matrix put
through NF4's round trip as the format defines it (tests/nf4_reference.py: numpy, no
bitsandbytes kernel, whose CPU dequantization differs between its releases; tests/test_nf4.py
checks our bytes against bitsandbytes' own)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch is in the test extra (pip install -e '.[test]')")
transformers = pytest.importorskip("transformers", reason="transformers is in the test extra")

import nf4_reference  # noqa: E402
from helpers import load_script  # noqa: E402

import zeroflow as zf  # noqa: E402
from zeroflow import hf  # noqa: E402
from zeroflow.engine import quantized  # noqa: E402
from zeroflow.hf.architectures import CONVERTERS  # noqa: E402


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    """scripts/make_tiny_hf.py's Llama with its weights made O(1) (norm scales around 1), so
    that the logits spread over several units and NF4's error shows above float noise."""
    folder = load_script("make_tiny_hf").make_tiny_llama(
        tmp_path_factory.mktemp("tiny-llama"), vocab_size=300, hidden=64, layers=2, heads=4,
        kv_heads=2, mlp=128, context=64, max_bytes=200_000)
    model = transformers.LlamaForCausalLM.from_pretrained(folder).eval()
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            p.copy_(1.0 + 0.2 * noise if p.ndim == 1 else 0.3 * noise)
    model.save_pretrained(folder)
    return folder


def _reference_model(folder):
    """transformers' model of ``folder`` with each matrix replaced by its NF4 round trip, each
    taken in the layout zeroflow stores the weight in (the conversion table's view and
    transpose: NF4's blocks of 64 run along the stored tensor's last axis)."""
    model = transformers.LlamaForCausalLM.from_pretrained(folder).eval()
    zcfg = hf.read_config(folder).model
    maps = {m.hf.replace("{i}", "0"): m for m in CONVERTERS["LlamaForCausalLM"].tensor_maps(zcfg)}
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim < 2:
                continue
            m = maps[name if name in maps else ".".join(
                "0" if part.isdigit() else part for part in name.split("."))]
            ours = p.numpy().reshape(m.view_shape).transpose(m.perm)
            back = nf4_reference.round_trip(ours).transpose(np.argsort(m.perm)).reshape(p.shape)
            p.copy_(torch.from_numpy(back))
    return model


def _logits(model, tokens):
    with torch.no_grad():
        return model(torch.tensor(tokens, dtype=torch.long)).logits.float().numpy()


def _checked_against_the_format(params, loaded) -> int:
    """Each NF4 tensor of ``params`` dequantized: the format's round trip of the same tensor of
    ``loaded`` (its float32 weights), and within NF4's error of it. Returns the tensors seen."""
    seen = []

    def check(leaf, weight):
        if not quantized.is_quantized(leaf):
            return
        got = np.asarray(quantized.dequantize(leaf, jnp.float32)).reshape(-1, *leaf.shape)
        for ours, original in zip(got, np.asarray(weight).reshape(-1, *leaf.shape)):
            # the dynamic map's float32 values (ours) and its float64 definition (the
            # reference's) differ in the last bit at some entries
            np.testing.assert_allclose(ours, nf4_reference.round_trip(original), atol=1e-6,
                                       rtol=0)
            assert np.all(np.abs(ours - original) <= nf4_reference.error_bound(original))
            seen.append(leaf.shape)

    jax.tree.map(check, params, loaded, is_leaf=quantized.is_quantized)
    return len(seen)


@pytest.mark.fast
def test_loaded_quantized_logits_match_transformers_on_the_nf4_weights(tiny_llama, monkeypatch):
    from zeroflow.hf import quantized_load

    # tensors coded a few rows at a time, as a large model's are (the embedding in 5 chunks)
    monkeypatch.setattr(quantized_load, "CHUNK", 64 * 64)
    tokens = np.random.default_rng(1).integers(0, 300, (2, 16))
    original = _logits(transformers.LlamaForCausalLM.from_pretrained(tiny_llama).eval(), tokens)
    want = _logits(_reference_model(tiny_llama), tokens)
    assert np.abs(want - original).max() > 0.05  # NF4 moves the logits well above the tolerance

    plan = zf.ZeroPlan(zf.make_mesh(data=8), stage=3)
    model, params, _ = hf.from_pretrained(tiny_llama, plan=plan, quantize="nf4")
    kernel = params["layers"]["mlp"]["up"]["kernel"]
    assert isinstance(kernel, zf.QuantizedArray) and kernel.data.dtype == jnp.uint8
    # each device holds 1/8 of each layer's bytes: the stage-3 shard of the frozen weights
    assert kernel.data.addressable_shards[0].data.shape[-1] == kernel.data.shape[-1] // 8
    assert not quantized.is_quantized(params["final_norm"]["scale"])  # a vector stays as it is
    logits = jax.jit(lambda p, t: model.apply({"params": quantized.dequantized(p)}, t))
    np.testing.assert_allclose(np.asarray(logits(params, jnp.asarray(tokens))), want, atol=2e-4,
                               rtol=0)
    _, loaded, _ = hf.from_pretrained(tiny_llama)
    assert _checked_against_the_format(params, loaded) == 2 + 7 * 2  # embedding, head, 7 a layer
    # the codes are those of quantizing the loaded weights layer by layer (zf.quantize_frozen's);
    # the scales' offset (a mean) may differ in its last bit with the order of its sum
    for leaf, weight, axes in ((params["embedding"], loaded["embedding"], 0),
                               (kernel, loaded["layers"]["mlp"]["up"]["kernel"], 1)):
        got, ref = quantized.unpack(leaf), quantized.unpack(quantized.quantize(weight, "nf4", axes))
        np.testing.assert_array_equal(got.codes, ref.codes)
        np.testing.assert_allclose(got.maxima, ref.maxima, rtol=1e-6)
        np.testing.assert_allclose(got.offset, ref.offset, rtol=1e-6)
        assert np.mean(np.asarray(got.scale_codes) == np.asarray(ref.scale_codes)) > 0.99


@pytest.mark.slow
def test_qlora_tiny_config_trains_and_exports_for_peft(tiny_llama, tmp_path):
    """configs/qlora-tiny.yaml (the base read into NF4 shards at stage 3) trains a few steps;
    its peft folder on transformers' model with the NF4 round-tripped weights, and its merged
    export (the base dequantized first), give the run's adapted logits."""
    from zeroflow.cli import export
    from zeroflow.config.io import load_config
    from zeroflow.engine.grads.dequantized import dequantized_on_use
    from zeroflow.models import GPT
    from zeroflow.trainer import build_run, train
    from zeroflow.trainer.checkpoints import RunCheckpoints

    peft = pytest.importorskip("peft", reason="peft is in the test extra")
    cfg = load_config("configs/qlora-tiny.yaml", [
        f"model.init_from={tiny_llama}", f"data.tokenizer={tiny_llama}", "model.seq_len=16",
        "train.batch_size=8", "data.max_bytes=100000", "train.steps=2", "train.warmup_steps=0",
        "train.eval_every=0", "train.eval_batches=1", "train.log_every=1", "checkpoint.every=2",
        "run.progress=false", f"run.dir={tmp_path / 'run'}"])
    result = train(cfg)
    assert len(result.losses) == 2 and all(np.isfinite(list(result.losses.values())))
    run = build_run(cfg, with_data=False)
    checkpoints = RunCheckpoints(tmp_path / "run" / "checkpoints", 3, read_only=True)
    state, _ = checkpoints.read(run.abstract_state(), 2)
    checkpoints.close()
    params = state.params
    assert isinstance(params["base"]["layers"]["attn"]["query"]["kernel"], zf.QuantizedArray)

    tokens = np.random.default_rng(0).integers(0, 300, (2, 9))
    model = GPT(run.model_cfg)
    lo = zf.lora(lambda p, t: model.apply({"params": p}, t), rank=cfg.model.lora.rank,
                 alpha=cfg.model.lora.alpha, targets=cfg.model.lora.targets)
    ours = np.asarray(jax.jit(dequantized_on_use(lo.loss, jnp.float32))(params, tokens))
    for fmt in ("peft", "hf"):
        assert export.main(["--run", str(tmp_path / "run"), "--format", fmt,
                            "--out", str(tmp_path / fmt)]) == 0
    adapted = peft.PeftModel.from_pretrained(_reference_model(tiny_llama), tmp_path / "peft")
    merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    assert np.abs(ours - _logits(_reference_model(tiny_llama), tokens)).max() > 1e-2  # trained
    np.testing.assert_allclose(_logits(adapted.eval(), tokens), ours, atol=2e-4, rtol=0)
    np.testing.assert_allclose(_logits(merged, tokens), ours, atol=2e-4, rtol=0)
