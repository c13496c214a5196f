"""Offload, the tiled MLP and bf16 autocast on Qwen3, Gemma 2, Gemma 3 and Phi-3: tiny random
models made on the spot by transformers (nothing downloaded), three full fine-tuning steps of
the ZeRO-3 step over the 8 emulated devices with each feature, against the same steps without
it. The run without the feature is anchored to transformers: its first loss is transformers'
cross-entropy on the same rows."""
import dataclasses

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
from test_hf_architectures_lora import _reference_loss  # noqa: E402

pytestmark = pytest.mark.fast

SEQ, STEPS = 12, 3
MLP_CHUNK = 5
"Chunks of 5, 5 and 2 (+3 zero rows padded) positions: 5 does not divide the 12 tokens."

FP32_RTOL = 1e-5
"""Offload and the tiled MLP change where and in which pieces the same fp32 arithmetic runs
(the update on the host, the MLP's matmuls and its weight gradients summed chunk by chunk), not
what it computes: they may reorder fp32 sums, a relative error of a few float32 epsilons
(1.2e-7) per sum, which three Adam steps do not grow near 1e-5."""

BF16_RTOL = 2.0**-6
"""bf16 keeps 8 significant bits: each matmul operand is rounded by up to 2**-9 (0.2%)
relative, and the loss (a mean cross-entropy of 3 to 10 on these scrambled weights) moves by
a few such roundings through the layers and the three steps of updates from bf16 gradients:
2**-6 (1.6%, eight unit roundoffs) relative allows that (measured at most 0.4%), while a
wrong model (a dropped layer, an unscaled embedding) moves it far more."""


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    return save_cases(tmp_path_factory, ONE_EACH)


def _rows(reference_model) -> np.ndarray:
    """8 rows of SEQ + 1 tokens (one per emulated device): inputs and next-token targets."""
    vocab = reference_model.config.vocab_size
    return np.random.default_rng(5).integers(0, vocab, (8, SEQ + 1))


def _losses(folder, rows, plan, prec, **model_options) -> list[float]:
    """The losses of STEPS Adam steps of the ZeRO step on the checkpoint in ``folder``."""
    _, params, cfg = hf.from_pretrained(folder, plan=plan, seq_len=SEQ)
    model_cfg = dataclasses.replace(cfg.model, **model_options)
    tx = optax.adam(1e-2)
    state = zf.init_train_state(params, tx, plan, prec)
    step = zf.make_train_step(make_loss_fn(model_cfg), tx, plan, prec)
    batch = {"tokens": jnp.asarray(rows, jnp.int32)}
    losses = []
    for _ in range(STEPS):
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
    return losses


def _stage3(**options) -> zf.ZeroPlan:
    return zf.ZeroPlan(zf.make_mesh(data=8), stage=3, **options)


@pytest.fixture(scope="module")
def plain(saved):
    """Each architecture's losses without any of the features, first checked on transformers."""
    out = {}
    for name in ONE_EACH:
        folder, reference_model, _, _ = saved[name]
        rows = _rows(reference_model)
        losses = _losses(folder, rows, _stage3(), zf.Precision(params="fp32"))
        np.testing.assert_allclose(losses[0], _reference_loss(reference_model, rows), rtol=1e-5)
        assert losses[-1] < losses[0]  # the steps train
        out[name] = losses
    return out


@pytest.mark.parametrize("update_on", ["host", "device"])
@pytest.mark.parametrize("name", ONE_EACH)
def test_offload_gives_the_same_losses(name, update_on, saved, plain):
    """The optimizer offloaded at stage 3 (master weights and Adam's state in pinned host
    memory), the update run on the host (ZeRO-Offload) or brought to the device: the same
    three losses within fp32 rounding."""
    folder, reference_model, _, _ = saved[name]
    plan = _stage3(offload="optimizer", update_on=update_on)
    losses = _losses(folder, _rows(reference_model), plan, zf.Precision(params="fp32"))
    np.testing.assert_allclose(losses, plain[name], rtol=FP32_RTOL)


@pytest.mark.parametrize("name", ONE_EACH)
def test_tiled_mlp_gives_the_same_losses(name, saved, plain):
    """model.mlp_chunk=5 on 12 tokens (the GeGLU / SwiGLU and Phi-3's fused gate_up inside each
    chunk, Gemma's post-MLP norm outside): the same three losses within fp32 rounding."""
    folder, reference_model, _, _ = saved[name]
    losses = _losses(folder, _rows(reference_model), _stage3(), zf.Precision(params="fp32"),
                     mlp_chunk=MLP_CHUNK)
    np.testing.assert_allclose(losses, plain[name], rtol=FP32_RTOL)


@pytest.mark.parametrize("name", ONE_EACH)
def test_bf16_autocast_gives_the_losses_within_bf16_precision(name, saved, plain):
    """precision.autocast=bf16 on the fp32 weights: the three losses within bf16's precision
    of the fp32 ones, and not equal to them (the matmuls did run in bf16)."""
    folder, reference_model, _, _ = saved[name]
    losses = _losses(folder, _rows(reference_model), _stage3(),
                     zf.Precision(params="fp32", autocast="bf16"))
    np.testing.assert_allclose(losses, plain[name], rtol=BF16_RTOL)
    assert np.abs(np.subtract(losses, plain[name])).max() > 1e-5
