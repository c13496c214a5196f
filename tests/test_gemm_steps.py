"""``experiments/gemm_steps.py`` (the GEMMs of a whole step, each counted as often as its loop
runs) against the matmuls a scanned stack of layers does, counted by hand: every layer's
forward product and weight gradient, and every layer's input gradient but the first's (nothing
asks for the gradient of the batch), 2 x M x K x N flops each, on an H100 target compiled
without the GPU."""
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import optax
import pytest
from helpers import require_cuda_plugin

require_cuda_plugin()

import zeroflow as zf  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "experiments"))
from gemm_steps import step_gemms  # noqa: E402

pytestmark = pytest.mark.slow

LAYERS, DEVICES, BATCH, TIME, D = 6, 2, 4, 128, 256


def loss_fn(params, batch):
    """A residual stack of square matmuls, scanned."""
    def layer(x, w):
        return x + jax.nn.relu(x @ w), None

    x, _ = jax.lax.scan(layer, batch["x"], params["w"])
    return jnp.mean(x.astype(jnp.float32) ** 2)


def test_step_gemms_count_each_layers_products_once_per_layer():
    params = {"w": jax.ShapeDtypeStruct((LAYERS, D, D), jnp.float32)}
    batch = {"x": jax.ShapeDtypeStruct((BATCH, TIME, D), jnp.float32)}
    plan = zf.ZeroPlan(zf.target_mesh("h100", data=DEVICES), stage=3)
    prec = zf.Precision(params="bf16", autocast="fp8", fp8_select="all")
    compiled, _ = zf.memory.compile_step(loss_fn, params, batch, optax.sgd(1e-3), plan, prec)
    text = compiled.as_text()
    assert " while(" in text  # the layers stay a loop: the count has to weigh its body
    got = step_gemms(text)
    rows = BATCH * TIME // DEVICES  # each device's share of the batch
    products = 3 * LAYERS - 1  # forward, weight and input gradients; no input gradient of x
    assert got["fp8"]["gemms"] == products and got["other"]["gemms"] == 0
    assert got["fp8"]["flops"] == pytest.approx(products * 2 * rows * D * D)
    # one byte per FP8 operand element: at least the two operands of every product
    assert got["fp8"]["bytes"] >= products * (rows * D + D * D)
