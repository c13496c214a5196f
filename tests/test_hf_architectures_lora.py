"""Qwen3, Gemma 2, Gemma 3 and Phi-3 fine-tuned with LoRA on every attention and MLP
projection at ZeRO stage 3 over the 8 emulated devices, and the adapters read by peft on
transformers' model (the reference): tiny random models made on the spot, nothing downloaded."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

torch = pytest.importorskip("torch", reason="torch is in the test extra (pip install -e '.[test]')")
transformers = pytest.importorskip("transformers", reason="transformers is in the test extra")

import zeroflow as zf  # noqa: E402
from zeroflow import hf  # noqa: E402
from zeroflow.models import make_loss_fn  # noqa: E402
from test_hf_architectures import ONE_EACH, save_cases  # noqa: E402
from test_hf_parity import ATOL, torch_logits  # noqa: E402

pytestmark = pytest.mark.slow

@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    return save_cases(tmp_path_factory, ONE_EACH)


RANK, ALPHA = 2, 4.0
TARGETS = r"(attn|mlp)/\w+/kernel"
"Every attention and MLP projection (model.lora.targets' default)."


@pytest.mark.parametrize("name", ONE_EACH)
def test_lora_at_stage3_trains_and_peft_reads_the_adapters(name, saved, tmp_path):
    """LoRA on every attention and MLP projection (Phi-3's fused ones included) trained by the
    ZeRO-3 step over the 8 emulated devices, the base frozen and stored sharded: the loss
    falls, and the adapters exported for peft on transformers' model give our logits."""
    peft = pytest.importorskip("peft", reason="peft is in the test extra")
    from zeroflow.lora.peft import save_peft
    folder, reference_model, tokens, _ = saved[name]
    plan = zf.ZeroPlan(zf.make_mesh(data=-1), stage=3)
    model, base, cfg = hf.from_pretrained(folder, plan=plan, seq_len=12)
    lo = zf.lora(make_loss_fn(cfg.model), rank=RANK, alpha=ALPHA, targets=TARGETS)
    batch = {"tokens": jnp.asarray(np.tile(tokens, (4, 1))[:, :12], jnp.int32)}
    adapters = lo.init(jax.random.key(0), base, batch)
    params = {"base": base, "lora": adapters}
    trainable = {"base": jax.tree.map(lambda _: False, base),
                 "lora": jax.tree.map(lambda _: True, adapters)}
    tx, prec = optax.adam(3e-2), zf.Precision(params="fp32")
    state = zf.init_train_state(params, tx, plan, prec, trainable=trainable)
    step = zf.make_train_step(lo.loss, tx, plan, prec)
    losses = []
    for _ in range(3):
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
    assert losses[-1] < losses[0]
    tuned = jax.device_get(state.master_params["lora"])
    logits = zf.lora(lambda p, t: model.apply({"params": p}, t), rank=RANK, alpha=ALPHA,
                     targets=TARGETS)
    ours = np.asarray(jax.jit(logits.loss)({"base": jax.device_get(base), "lora": tuned},
                                           jnp.asarray(tokens)))
    save_peft(tuned, cfg, tmp_path / "peft", alpha=ALPHA, base_model=str(folder))
    adapted = peft.PeftModel.from_pretrained(type(reference_model).from_pretrained(folder),
                                             tmp_path / "peft").eval()
    theirs = torch_logits(adapted, tokens)
    assert np.abs(theirs - saved[name][3]).max() > 0.05  # the adapters moved the model
    np.testing.assert_allclose(ours, theirs, atol=ATOL, rtol=0)


def _reference_loss(model, tokens: np.ndarray) -> float:
    """transformers' mean next-token cross-entropy over ``tokens`` [B, S + 1]."""
    logits = torch_logits(model, tokens[:, :-1]).astype(np.float64)
    logits -= logits.max(-1, keepdims=True)
    logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    return float(-np.take_along_axis(logp, tokens[:, 1:, None], -1).mean())


def test_gemma3_on_the_context_axis_matches_transformers(saved):
    """Gemma 3's windowed and global layers with each row split over 2 devices (allgather; the
    window of 4 crosses the split of 12 tokens into 6 + 6), ZeRO-3 over data 2 x context 2:
    the step's loss is transformers' on the whole rows."""
    from zeroflow.models.context import context_batch
    folder, reference_model, _, _ = saved["gemma3-pattern2-linear"]
    tokens = np.random.default_rng(3).integers(0, reference_model.config.vocab_size, (2, 13))
    plan = zf.ZeroPlan(zf.make_mesh(data=2, context=2, devices=jax.devices()[:4]), stage=3)
    model, params, cfg = hf.from_pretrained(folder, plan=plan, seq_len=12)
    tx, prec = optax.sgd(0.0), zf.Precision(params="fp32")
    state = zf.init_train_state(params, tx, plan, prec)
    step = zf.make_train_step(make_loss_fn(cfg.model), tx, plan, prec)
    _, metrics = step(state, context_batch({"tokens": jnp.asarray(tokens, jnp.int32)}, 2,
                                           "allgather"))
    np.testing.assert_allclose(float(metrics["loss"]), _reference_loss(reference_model, tokens),
                               rtol=1e-5)
