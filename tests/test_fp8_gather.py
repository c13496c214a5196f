"""Stage-3 weights all-gathered in FP8 (``ZeroPlan(quantize_weights="fp8")``,
``zeroflow/engine/zeropp/fp8_gather.py``): the step's gradient is plain autodiff's at the
weights rounded to e4m3 with the whole weight's scale (a NumPy reference), the FP8 matmul casts
a gathered weight back to exactly the gathered e4m3 values, and the trainer's GPT gathers only
float8 weights and trains like plain gathers, with FP8 matmuls."""
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest

import zeroflow as zf
from zeroflow.autocast import fp8


def np_e4m3_round_trip(w):
    """``w`` as the devices see it after the FP8 gather: one scale, the whole weight's amax
    over 448, each entry rounded to e4m3 and scaled back (fp32)."""
    w = np.asarray(w, np.float32)
    amax = np.float32(np.abs(w).max())
    scale = amax / np.float32(448.0) if amax > 0 else np.float32(1.0)
    q = np.clip(w / scale, -448, 448).astype(ml_dtypes.float8_e4m3fn)
    return q.astype(np.float32) * scale


def _mlp_loss(params, batch):
    h = jnp.tanh(batch["x"] @ params["w1"])
    return jnp.mean((h @ params["w2"] - batch["y"]) ** 2)


def _mlp(seed=0):
    rng = np.random.default_rng(seed)
    params = {"w1": rng.normal(size=(64, 32)).astype(np.float32) * 0.2,
              "w2": rng.normal(size=(32, 8)).astype(np.float32) * 0.2}
    batch = {"x": jnp.asarray(rng.normal(size=(16, 64)), jnp.float32),
             "y": jnp.asarray(rng.normal(size=(16, 8)), jnp.float32)}
    return params, batch


@pytest.mark.fast
def test_gradient_is_plain_gradient_at_the_e4m3_weights_and_the_master_stays_exact():
    params, batch = _mlp()
    lr = 0.5
    seen = {k: jnp.asarray(np_e4m3_round_trip(v)) for k, v in params.items()}
    grads = jax.grad(_mlp_loss)(seen, batch)
    want = {k: params[k] - lr * np.asarray(grads[k]) for k in params}

    def one_step(**options):
        plan, prec, tx = zf.ZeroPlan(zf.make_mesh(), stage=3, **options), zf.Precision(), optax.sgd(lr)
        state = zf.init_train_state(params, tx, plan, prec)
        step = zf.make_train_step(_mlp_loss, tx, plan, prec)
        text = step.lower(state, batch).as_text()
        state, _ = step(state, batch)
        return jax.tree.map(np.asarray, state.master_params), text

    got, text = one_step(quantize_weights="fp8")
    plain, _ = one_step()
    for k in params:
        np.testing.assert_allclose(got[k], want[k], rtol=1e-5, atol=1e-6)
        assert np.abs(plain[k] - want[k]).max() > 1e-5  # the rounding is really applied
    gathers = [line for line in text.splitlines() if "all_gather" in line and "->" in line]
    assert gathers and all("f8E4M3FN" in line or "tensor<8xf32>" in line for line in gathers)


@pytest.mark.fast
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_the_fp8_matmul_casts_a_gathered_weight_back_to_the_gathered_values(dtype):
    w = jnp.asarray(np.random.default_rng(1).standard_t(3, size=(256, 128)), jnp.float32)
    scale = fp8.scale_of(w, fp8.E4M3)
    q = fp8.quantize(w, scale, fp8.E4M3)
    gathered = (q.astype(jnp.float32) * scale).astype(dtype)  # what fp8_all_gather returns
    again = fp8.quantize(gathered, fp8.scale_of(gathered, fp8.E4M3), fp8.E4M3)
    assert bool(jnp.all(again.view(jnp.uint8) == q.view(jnp.uint8)))  # bit for bit: one rounding



@pytest.mark.slow
def test_trainer_gpt_gathers_fp8_layer_by_layer_and_trains_like_plain_gathers():
    """The trainer's GPT (scanned layers, ``gather_per_layer``, full remat) under
    autocast='fp8' with every eligible matmul in FP8: every matrix is all-gathered in e4m3
    (the norms' gains in bf16, one fp32 amax per device and matrix), and 4 Adam steps stay
    within 1% of the same run with plain bf16 gathers: each layer's weight is gathered with
    that layer's scale, the one its FP8 matmul computes, so both runs multiply the same e4m3
    weights."""
    from helpers import token_batches, train_losses
    from zeroflow.config.schema import ModelConfig
    from zeroflow.models import init_params, make_layerwise_loss_fn
    cfg = ModelConfig(vocab_size=256, seq_len=32, num_layers=2, embed_dim=64, num_heads=4,
                      mlp_dim=256, remat="full")
    batches = token_batches(1, rows=16, seq_len=32, vocab=256) * 4

    def run(**options):
        plan = zf.ZeroPlan(zf.make_mesh(), stage=3, **options)
        prec, tx = zf.Precision(params="bf16", autocast="fp8", fp8_select="all"), optax.adam(3e-3)
        state = zf.init_train_state(init_params(cfg, jax.random.key(0))[0], tx, plan, prec)
        step = zf.make_train_step(make_layerwise_loss_fn(cfg), tx, plan, prec,
                                  gather_per_layer="layers")
        text = step.lower(state, batches[0]).as_text()
        return np.array(train_losses(step, state, batches)[0]), text

    plain, _ = run()
    got, text = run(quantize_weights="fp8")
    gathers = [line for line in text.splitlines() if "all_gather" in line and "->" in line]
    results = [line.rsplit("->", 1)[1].strip(" >)").split("<")[-1].split("x") for line in gathers]
    matrices = {r[-1] for r in results if len(r) > 2}
    vectors = {r[-1] for r in results if len(r) <= 2}
    assert matrices == {"f8E4M3FN"} and vectors == {"bf16", "f32"}, (matrices, vectors)
    assert plain[-1] < plain[0]
    np.testing.assert_allclose(got, plain, rtol=0.01)
