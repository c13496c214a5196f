"""model.attention=pallas and model.mlp=block_sparse, through the GPT and the ZeRO engine."""
import dataclasses

import jax
import numpy as np
import optax

import zeroflow as zf
from zeroflow.config.schema import ModelConfig
from zeroflow.models import init_params, make_loss_fn
from helpers import assert_leaves_close, train_losses

CFG = ModelConfig(vocab_size=64, seq_len=16, num_layers=1, embed_dim=32, num_heads=2, mlp_dim=64)


def _batch():
    return {"tokens": np.random.default_rng(0).integers(0, 64, size=(4, CFG.seq_len + 1), dtype=np.int32)}


def test_pallas_attention_matches_xla_loss_and_grads():
    params, _ = init_params(CFG, jax.random.key(0))
    grads = {}
    for impl in ("xla", "pallas"):
        loss_fn = make_loss_fn(dataclasses.replace(CFG, attention=impl))
        (loss, _), g = jax.value_and_grad(loss_fn, has_aux=True)(params, _batch())
        grads[impl] = (float(loss), g)
    assert abs(grads["xla"][0] - grads["pallas"][0]) < 1e-5
    assert_leaves_close(grads["xla"][1], grads["pallas"][1], rtol=1e-4, atol=1e-6)


def test_block_sparse_mlp_trains_under_zero3_with_pallas_attention():
    cfg = dataclasses.replace(CFG, attention="pallas", mlp="block_sparse", mlp_block_size=32, mlp_density=0.5)
    params, _ = init_params(cfg, jax.random.key(0))
    blocks = params["layers"]["mlp"]["up"]["blocks"]
    # [layers, nnz, bs, bs]: half of the (32/32) x (64/32) = 2 weight blocks exist.
    assert blocks.shape == (1, 1, 32, 32)
    plan = zf.ZeroPlan(zf.make_mesh(devices=jax.devices()[:2]), stage=3)
    prec, tx = zf.Precision(params="bf16"), optax.adam(3e-3)
    state = zf.init_train_state(params, tx, plan, prec)
    step = zf.make_train_step(make_loss_fn(cfg), tx, plan, prec)
    losses, state, _ = train_losses(step, state, [_batch() for _ in range(3)])
    assert np.isfinite(losses).all() and losses[-1] < losses[0]
