"""Training with FP8 matmuls: the unmodified fp32 Flax transformer of test_autocast_train with
its loss under ``zf.autocast(dtype="fp8")`` (every eligible matmul in FP8, per-tensor and
per-row scaling), plain optax, against its fp32 run on the same batches."""
import jax
import jax.numpy as jnp
import optax
import pytest

import zeroflow as zf
from helpers import walk
from test_autocast_train import init_params, lm_loss, markov_batches, plain_optax_losses

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("scaling", ["tensor", "row"])
def test_unmodified_flax_transformer_trains_in_fp8_within_2_percent_of_fp32(scaling):
    data = markov_batches(60, 16)
    tx = optax.adam(3e-3)
    ref, *_ = plain_optax_losses(lm_loss, tx, data)
    policy = zf.AutocastPolicy(fp8_cost_model=False, fp8_scaling=scaling)
    got, step, params, opt_state = plain_optax_losses(
        zf.autocast(lm_loss, dtype="fp8", policy=policy), tx, data)
    assert ref[-20:].mean() < 0.75 * ref[:5].mean()  # it learned something
    assert abs(got[-20:].mean() - ref[-20:].mean()) < 0.02 * ref[-20:].mean()
    closed = jax.make_jaxpr(step)(params, opt_state, data[0])
    f8 = [e for e in walk(closed) if e.primitive.name == "dot_general"
          and all("float8" in jnp.dtype(v.aval.dtype).name for v in e.invars)]
    # the projections of both blocks (q, k, v, out, up, down) and the head, 3 products each
    assert len(f8) == 3 * (2 * 6 + 1)


def test_unmodified_flax_transformer_trains_with_delayed_scaling_within_2_percent_of_fp32():
    """Delayed scaling (history 16): the amax histories ride along as the gradient with
    respect to the fp8 state (``f(state, params, batch)``), one per matmul site; the loss
    tracks fp32's as current scaling does, and every history has filled up."""
    data = markov_batches(60, 16)
    tx = optax.adam(3e-3)
    ref, *_ = plain_optax_losses(lm_loss, tx, data)
    policy = zf.AutocastPolicy(fp8_cost_model=False, fp8_scaling="delayed", fp8_history=16)
    f = zf.autocast(lm_loss, dtype="fp8", policy=policy)
    params = init_params()
    opt_state = tx.init(params)
    fp8_state = f.init(params, {"tokens": data[0]})
    assert len(fp8_state) == 2 * 6 + 1  # q, k, v, out, up, down of both blocks, the head

    @jax.jit
    def step(fp8_state, params, opt_state, tokens):
        loss, (fp8_state, grads) = jax.value_and_grad(f, argnums=(0, 1))(
            fp8_state, params, {"tokens": tokens})
        updates, opt_state = tx.update(grads, opt_state, params)
        return fp8_state, optax.apply_updates(params, updates), opt_state, loss

    got = []
    for tokens in data:
        fp8_state, params, opt_state, loss = step(fp8_state, params, opt_state, tokens)
        got.append(float(loss))
    got = jnp.asarray(got)
    assert abs(got[-20:].mean() - ref[-20:].mean()) < 0.02 * ref[-20:].mean()
    for site in fp8_state.values():
        for meta in site:
            assert bool(jnp.all(meta.history > 0)) and bool(jnp.all(meta.scale > 0))
