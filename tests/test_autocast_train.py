"""Training under zf.autocast: an unmodified fp32 Flax transformer in bf16 with plain optax, in
fp16 with dynamic loss scaling through the engine at ZeRO stage 3, and the trainer's GPT
(layer-wise gathering, nn.scan, remat, custom_vjp) at stage 3. Each is compared with an fp32
run of the same model on the same batches."""
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

import zeroflow as zf
from helpers import walk
import pytest

pytestmark = pytest.mark.fast

VOCAB, SEQ, WIDTH, HEADS, LAYERS = 32, 16, 32, 2, 2


class Block(nn.Module):
    """Pre-norm transformer block in plain flax.linen: no dtype argument anywhere."""

    @nn.compact
    def __call__(self, x):
        h = nn.LayerNorm()(x)
        mask = nn.make_causal_mask(jnp.ones(x.shape[:2]))
        x = x + nn.MultiHeadDotProductAttention(num_heads=HEADS)(h, h, mask=mask)
        h = nn.Dense(4 * WIDTH)(nn.LayerNorm()(x))
        return x + nn.Dense(WIDTH)(nn.gelu(h))


class TinyLM(nn.Module):
    @nn.compact
    def __call__(self, tokens):
        x = nn.Embed(VOCAB, WIDTH)(tokens)
        x = x + self.param("pos", nn.initializers.normal(0.02), (SEQ, WIDTH))
        for _ in range(LAYERS):
            x = Block()(x)
        return nn.Dense(VOCAB)(nn.LayerNorm()(x))


MODEL = TinyLM()


def lm_loss(params, batch):
    tokens = batch["tokens"]
    logits = MODEL.apply({"params": params}, tokens[:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()


def markov_batches(steps, batch, seed=0):
    """Sequences from a fixed, peaked bigram chain: learnable, with a known floor."""
    rng = np.random.default_rng(seed)
    logits = rng.normal(size=(VOCAB, VOCAB)) * 3.0
    trans = np.exp(logits) / np.exp(logits).sum(1, keepdims=True)
    cum = trans.cumsum(1)
    out = np.zeros((steps, batch, SEQ + 1), np.int32)
    out[:, :, 0] = rng.integers(0, VOCAB, (steps, batch))
    for t in range(SEQ):
        u = rng.random((steps, batch, 1))
        out[:, :, t + 1] = (u > cum[out[:, :, t]]).sum(-1).clip(max=VOCAB - 1)
    return out


def init_params():
    return MODEL.init(jax.random.key(0), jnp.zeros((1, SEQ), jnp.int32))["params"]


def half_dots(closed, dtype) -> int:
    return sum(1 for e in walk(closed) if e.primitive.name == "dot_general"
               and {jnp.dtype(v.aval.dtype) for v in e.invars} == {jnp.dtype(dtype)})


def plain_optax_losses(loss_fn, tx, data):
    """The reference: jit(value_and_grad) + optax, one batch per step."""
    params = init_params()
    opt_state = tx.init(params)

    @jax.jit
    def step(params, opt_state, tokens):
        loss, grads = jax.value_and_grad(loss_fn)(params, {"tokens": tokens})
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    losses = []
    for tokens in data:
        params, opt_state, loss = step(params, opt_state, tokens)
        losses.append(float(loss))
    return np.array(losses), step, params, opt_state


def test_unmodified_flax_transformer_trains_in_bf16_within_2_percent():
    data = markov_batches(60, 16)
    tx = optax.adam(3e-3)
    ref, _, params, opt_state = plain_optax_losses(lm_loss, tx, data)
    got, step, _, _ = plain_optax_losses(zf.autocast(lm_loss, dtype="bf16"), tx, data)
    assert ref[-20:].mean() < 0.75 * ref[:5].mean()  # it learned something
    assert abs(got[-20:].mean() - ref[-20:].mean()) < 0.02 * ref[-20:].mean()
    # ... and in half precision: every projection of both blocks and the head is a bf16 matmul
    closed = jax.make_jaxpr(step)(params, opt_state, data[0])
    assert half_dots(closed, jnp.bfloat16) >= 3 * (LAYERS * 6 + 1)  # forward + 2 backward each


def test_fp16_with_dynamic_scaling_through_the_engine_at_stage_3():
    data = markov_batches(60, 64, seed=1)
    tx = optax.adam(3e-3)
    ref, *_ = plain_optax_losses(lm_loss, tx, data)
    plan = zf.ZeroPlan(zf.make_mesh(data=8, model=1), stage=3)
    prec = zf.Precision(params="fp32", loss_scale="dynamic", autocast="fp16")
    state = zf.init_train_state(init_params(), tx, plan, prec)
    step = zf.make_train_step(lm_loss, tx, plan, prec)
    assert half_dots(step.trace(state, {"tokens": data[0]}).jaxpr, jnp.float16) >= 3 * LAYERS * 6
    losses, skipped = [], 0
    for tokens in data:
        state, metrics = step(state, {"tokens": tokens})
        losses.append(float(metrics["loss"]))
        skipped += int(metrics["skipped"])
    losses = np.array(losses)
    assert np.isfinite(losses).all() and skipped < 6  # a tenth of the steps at most
    assert state.master["Dense_0"]["kernel"].dtype == jnp.float32  # weights stay fp32 at rest
    assert abs(losses[-20:].mean() - ref[-20:].mean()) < 0.02 * ref[-20:].mean()


def test_trainer_gpt_layerwise_stage_3_bf16_with_offload():
    from zeroflow.config.io import load_config
    from zeroflow.trainer import build_run

    shrunk = ["model.vocab_size=64", "model.seq_len=16", "model.num_layers=2", "model.embed_dim=32",
              "model.num_heads=2", "model.mlp_dim=64", "model.remat=full", "train.batch_size=64",
              "train.warmup_steps=1", "parallel.zero_stage=3"]
    tokens = markov_batches(6, 64, seed=2) * 2  # values < 64
    runs = {}
    # bf16 also streams the layer weights from host memory (another custom_vjp, host arrays)
    for autocast, extra in (("none", []), ("bf16", ["parallel.offload=optimizer+params"])):
        run = build_run(load_config(None, shrunk + extra + [f"precision.autocast={autocast}"]),
                        with_data=False)
        state, step = run.init_state(), run.make_step()
        batch = run.global_batch(tokens[0])
        if autocast == "bf16":
            # the layer-wise path: scan over layers, remat, the gather custom_vjp, all under autocast
            assert half_dots(step.trace(state, batch).jaxpr, jnp.bfloat16) >= 3 * 2 * 6
        losses = []
        for t in tokens:
            state, metrics = step(state, run.global_batch(t))
            losses.append(float(metrics["loss"]))
        runs[autocast] = np.array(losses)
    assert np.isfinite(runs["bf16"]).all()
    assert runs["bf16"][-1] < runs["bf16"][0]
    np.testing.assert_allclose(runs["bf16"], runs["none"], rtol=0.02)
