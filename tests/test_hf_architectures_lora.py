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
from test_hf_parity import ATOL, torch_logits, zf_logits  # noqa: E402

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


def _blocks(x: np.ndarray) -> np.ndarray:
    """``x``'s entries in blocks of 64 consecutive ones (the last padded with its last entry)."""
    flat = np.asarray(x, np.float32).ravel()
    return np.pad(flat, (0, -flat.size % 64), constant_values=flat[-1]).reshape(-1, 64)


def _distinct_per_block(x: np.ndarray) -> int:
    """The most distinct values any block of 64 consecutive entries of ``x`` holds."""
    return max(len(np.unique(block)) for block in _blocks(x))


@pytest.mark.parametrize("name", ["gemma3-pattern2-linear", "phi3-window"])
def test_nf4_base_at_stage3_runs_as_transformers_on_its_weights(name, saved, tmp_path):
    """QLoRA's base read straight into NF4 shards at ZeRO-3 (Phi-3's fused tensors quantized
    part by part, Gemma's norm and qk-norm vectors kept as they are): every matrix holds at
    most 16 values per block of 64 (a 4-bit code times the block's scale), and transformers
    running the dequantized weights (saved back in its layout) gives our logits."""
    from zeroflow.engine import quantized
    from zeroflow.util.tree import path_str
    folder, reference_model, tokens, original = saved[name]
    plan = zf.ZeroPlan(zf.make_mesh(data=8), stage=3)
    model, params, cfg = hf.from_pretrained(folder, plan=plan, quantize="nf4")
    _, loaded, _ = hf.from_pretrained(folder)
    weights = jax.device_get(quantized.dequantized(params))
    quantized_leaves = jax.tree.leaves(params, is_leaf=lambda x: isinstance(x, zf.QuantizedArray))
    for (path, weight), leaf in zip(jax.tree_util.tree_leaves_with_path(loaded), quantized_leaves):
        matrix = weight.ndim - path_str(path).startswith("layers") >= 2
        assert isinstance(leaf, zf.QuantizedArray) == matrix, path_str(path)  # vectors kept
    for (path, weight), exact in zip(jax.tree_util.tree_leaves_with_path(weights),
                                     jax.tree.leaves(loaded)):
        if weight.ndim - path_str(path).startswith("layers") >= 2:
            stacked = weight if path_str(path).startswith("layers") else weight[None]
            exact = np.asarray(exact).reshape(stacked.shape)
            for w, x in zip(stacked, exact):
                assert _distinct_per_block(w) <= 16, path_str(path)
                # within half NF4's widest gap (-1 to -0.696) of each block's largest entry,
                # plus the 8-bit error of the block's (double-quantized) scale
                w, x = _blocks(w), _blocks(x)
                ratio = (np.abs(w - x) / np.abs(x).max(-1, keepdims=True)).max()
                assert ratio <= 0.16, (path_str(path), ratio)
    logits = jax.jit(lambda p, t: model.apply({"params": quantized.dequantized(p)}, t))
    ours = np.asarray(logits(params, jnp.asarray(tokens)))
    assert np.abs(ours - original).max() > 0.05  # NF4 moves the logits well above the tolerance
    assert np.abs(ours - zf_logits(model, loaded, tokens)).max() > 0.05
    hf.save_pretrained(model, weights, cfg, tmp_path / "nf4")
    theirs = torch_logits(type(reference_model).from_pretrained(tmp_path / "nf4").eval(), tokens)
    np.testing.assert_allclose(ours, theirs, atol=ATOL, rtol=0)


@pytest.mark.parametrize("config, name", [
    ("configs/finetune-qwen3-8b.yaml", "qwen3-gqa-headdim"),
    ("configs/qlora-gemma3-12b.yaml", "gemma3-pattern2-linear"),
])
def test_shipped_configs_train_a_tiny_model_of_their_architecture(config, name, tmp_path):
    """The two configs as shipped (offload and host update, or an NF4 base with adapters; the
    chunked loss) on a tiny random model of the same architecture, with byte tokens, XLA
    attention and the 8 emulated devices on the data axis: a few steps train, losses finite."""
    from test_hf_architectures import CASES, scrambled
    from zeroflow.config.io import load_config
    from zeroflow.trainer import train
    model_class, config_class, kwargs = CASES[name]
    scrambled(model_class, config_class, {**kwargs, "vocab_size": 256}).save_pretrained(
        tmp_path / "base")
    cfg = load_config(config, [
        f"model.init_from={tmp_path / 'base'}", "data.tokenizer=byte", "model.seq_len=16",
        "model.attention=xla", "model.loss_chunk=8", "parallel.data=-1", "train.batch_size=64",
        "data.max_bytes=100000", "train.steps=3", "train.warmup_steps=0", "train.eval_every=0",
        "train.eval_batches=1", "train.log_every=1", "checkpoint.every=0",
        "run.progress=false", "run.tensorboard=false", "run.plot=false",
        f"run.dir={tmp_path / 'run'}"])
    result = train(cfg)
    assert len(result.losses) == 3 and all(np.isfinite(list(result.losses.values())))
