"""The fit table's host column on abstract GPUs (``zf.target_mesh``): their devices expose no
memories, yet XLA:GPU's compile (through CPU stand-ins that keep the host memory) puts the
offloaded master and Adam moments in host memory, the ZeRO formula's 12 bytes per parameter,
on a model whose layers are a ``lax.scan`` over stacked weights."""
import jax
import jax.numpy as jnp
import optax
import pytest
from helpers import require_cuda_plugin

pytestmark = pytest.mark.slow

require_cuda_plugin()

import zeroflow as zf  # noqa: E402

D, F, V, LAYERS = 512, 2048, 512, 8
BATCH = {"tokens": jax.ShapeDtypeStruct((1, 9), jnp.int32)}


def _params():
    p = {"embed": jax.ShapeDtypeStruct((V, D), jnp.float32),
         "head": jax.ShapeDtypeStruct((D, V), jnp.float32)}
    for name, shape in (("up1", (LAYERS, D, F)), ("down1", (LAYERS, F, D)),
                        ("up2", (LAYERS, D, F)), ("down2", (LAYERS, F, D))):
        p[name] = jax.ShapeDtypeStruct(shape, jnp.float32)
    return p


def loss_fn(p, b):
    x = p["embed"][b["tokens"][:, :-1]]

    def layer(x, w):
        x = x + jnp.tanh(x @ w["up1"]) @ w["down1"]
        return x + jnp.tanh(x @ w["up2"]) @ w["down2"], None

    x, _ = jax.lax.scan(layer, x, {k: p[k] for k in ("up1", "down1", "up2", "down2")})
    logits = (x @ p["head"]).astype(jnp.float32)
    return optax.softmax_cross_entropy_with_integer_labels(logits, b["tokens"][:, 1:]).mean()


def test_offloaded_state_is_host_memory_on_abstract_gpus():
    params = _params()
    psi = sum(x.size for x in jax.tree.leaves(params))
    plan = zf.ZeroPlan(zf.target_mesh("h100", data=1), stage=3, offload="optimizer",
                       update_on="host")
    got, peak = zf.memory.measure_step(loss_fn, params, BATCH, optax.adamw(1e-3), plan,
                                       zf.Precision(params="bf16"))
    # (the step counter and Adam's count: a few scalars beside the 12 bytes per parameter)
    assert got.host_argument_bytes == pytest.approx(12 * psi, rel=1e-3)
    assert peak >= 2 * psi and peak < 12 * psi  # the bf16 weights stay, the fp32 state does not
