"""FP8 matmuls that gather their own FP8 weight (``ZeroPlan(quantize_weights="fp8")`` with
``autocast="fp8"``, a scanned and rematerialised layer stack: ``zeroflow.engine.zeropp.fp8_dot``)
on the 8 emulated devices, against the recipe written out in NumPy: each device casts its rows
with its own scale (current scaling) or every tensor with the scale of its amax history
(delayed scaling, ``fp8_reference.NpTensor``), the weight with one scale for the whole weight,
e4m3 operands and an e5m2 gradient, fp32 accumulation; the weight gradients of the devices
summed, plain SGD. The gathered e4m3 weight must reach the GEMM as gathered (no dequantize and
cast again)."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from fp8_reference import E4M3, E5M2, NpTensor, np_bf16

import zeroflow as zf

pytestmark = pytest.mark.fast

N_DEV, LAYERS, D, ROWS = 8, 2, 32, 256
LR = 0.1


def stack_loss(params, batch):
    """``x`` through ``LAYERS`` matmuls (a remat layer scan); mean over rows of ``sum(y * c)``."""

    def layer(x, w):
        return x @ w, None

    body = jax.checkpoint(layer, policy=jax.checkpoint_policies.checkpoint_dots)
    y, _ = jax.lax.scan(body, batch["x"], params["w"])
    return jnp.mean(jnp.sum(y.astype(jnp.float32) * batch["c"], axis=-1))


def data(steps):
    rng = np.random.default_rng(0)
    w = (rng.normal(size=(LAYERS, D, D)) * 0.3).astype(np.float32)
    out = []
    for k in range(steps):
        loud = np.repeat(rng.uniform(0.5, 4.0, size=(N_DEV, 1)), ROWS // N_DEV, 0)
        out.append({"x": (rng.normal(size=(ROWS, D)) * loud).astype(np.float32),
                    "c": (rng.normal(size=(ROWS, D)) * (1 + k)).astype(np.float32)})
    return {"w": w}, out


def np_cast(x, fmt, scale):
    top = 448.0 if fmt is E4M3 else 57344.0
    return np.clip(x.astype(np.float32) / np.float32(scale), -top, top).astype(fmt).astype(np.float64)


def amax_scale(x, fmt):
    amax = float(np.max(np.abs(x)))
    return amax / (448.0 if fmt is E4M3 else 57344.0) if amax > 0 else 1.0


class Recipe:
    """The step in NumPy. ``scales(kind, layer, tensors)``: one scale per device tensor
    (current: each its own amax; delayed: the history's, the global amax recorded)."""

    def __init__(self, w, delayed, bf16_weights=False):
        self.w, self.delayed, self.bf16_weights = w, delayed, bf16_weights
        self.hist = {(k, i): NpTensor(fmt, 16, 0) for i in range(LAYERS)
                     for k, fmt in (("lhs", E4M3), ("rhs", E4M3), ("grad", E5M2))}

    def cast(self, kind, layer, parts, fmt):
        """``parts`` (one array per device, or one for the weight) cast, with their scales."""
        if not self.delayed:
            return [(np_cast(p, fmt, s), s) for p in parts for s in [amax_scale(p, fmt)]]
        t = self.hist[kind, layer]
        whole, scale = t.cast(np.concatenate([p.reshape(-1) for p in parts]))
        del whole
        return [(np_cast(p, fmt, scale), scale) for p in parts]

    def step(self, batch):
        r = ROWS // N_DEV
        hs = [np_bf16(batch["x"][i * r:(i + 1) * r]) for i in range(N_DEV)]
        saved = []
        for layer in range(LAYERS):
            w = np_bf16(self.w[layer]) if self.bf16_weights else self.w[layer]
            (qw, sw), = self.cast("rhs", layer, [w], E4M3)
            qs = self.cast("lhs", layer, hs, E4M3)
            saved.append((qs, qw, sw))
            hs = [np_bf16((q @ qw) * (s * sw)) for q, s in qs]
        gs = [np_bf16(batch["c"][i * r:(i + 1) * r] / r) for i in range(N_DEV)]
        grads = np.zeros_like(self.w, dtype=np.float64)
        for layer in reversed(range(LAYERS)):
            qs, qw, sw = saved[layer]
            qg = self.cast("grad", layer, gs, E5M2)
            for (q, s), (g, sg) in zip(qs, qg):
                grads[layer] += np_bf16((q.T @ g) * (s * sg)) / N_DEV
            gs = [np_bf16((g @ qw.T) * (sg * sw)) for g, sg in qg]
        self.w = (self.w - LR * grads).astype(np.float32)


def zeroflow_steps(w, batches, scaling, params="fp32", **options):
    plan = zf.ZeroPlan(zf.make_mesh(), stage=3, quantize_weights="fp8", **options)
    prec = zf.Precision(params=params, autocast="fp8", fp8_select="all", fp8_scaling=scaling,
                        fp8_history=16)
    tx = optax.sgd(LR)
    state = zf.init_train_state({"w": w}, tx, plan, prec)
    step = zf.make_train_step(stack_loss, tx, plan, prec)
    text = step.lower(state, batches[0]).as_text()
    for batch in batches:
        state, _ = step(state, batch)
    return np.asarray(state.master_params["w"]), text


@pytest.mark.parametrize("scaling,options", [
    ("tensor", {}), ("delayed", {}),
    ("delayed", {"hierarchical": True, "hosts": 2, "params": "bf16"})])
def test_the_step_follows_the_recipe_with_the_gathered_e4m3_weight_in_the_gemm(scaling, options):
    """Also with hpZ (each host's 4 devices gather from their bf16 copy: the weights the
    matmuls cast are the bf16 ones)."""
    params, batches = data(2)
    got, text = zeroflow_steps(params["w"], batches, scaling, **options)
    recipe = Recipe(params["w"].astype(np.float64), delayed=scaling == "delayed",
                    bf16_weights=options.get("params") == "bf16")
    for batch in batches:
        recipe.step(batch)
    moved = np.abs(recipe.w - params["w"]).max()
    assert moved > 0.05  # the steps really change the weights
    np.testing.assert_allclose(got, recipe.w, rtol=0, atol=0.05 * moved)  # e4m3 rounding flips
    # the gathered weight (D x D, e4m3) reaches the GEMM as gathered: never converted back
    whole = f"tensor<{D}x{D}xf8E4M3FN>"
    assert "all_gather" in text and f"{whole}) -> tensor<{D}x{D}xf32>" not in text


@pytest.mark.parametrize("reduce,autocast,pipelined", [
    ("bf16", "fp8", True), ("fp32", "fp8", False), ("bf16", "bf16", False)])
def test_fp8_steps_summing_in_bf16_pipeline_their_reduce_scatters_on_gpus(reduce, autocast,
                                                                         pipelined):
    """On an abstract H100 mesh: the collective pipeliner may move the backward loop's
    reduce-scatters only for FP8 matmuls with a bf16 reduction (XLA's option spelled by
    jaxlib version); an explicit option of the caller still wins."""
    import jaxlib

    plan = zf.ZeroPlan(zf.target_mesh("h100", data=8), stage=3, quantize_weights="fp8")
    prec = zf.Precision(params="bf16", autocast=autocast, reduce=reduce)
    old = tuple(int(p) for p in jaxlib.__version__.split(".")[:2]) < (0, 11)
    key = "xla_gpu_enable_pipelined_reduce_scatter" if old else "xla_gpu_pipeline_reduce_scatter"
    on = True if old else "COLLECTIVE_PIPELINING_MODE_ON"
    options = zf.make_train_step(stack_loss, optax.sgd(LR), plan, prec).compiler_options
    assert (options[key] == on) is pipelined
    off = {key: False if old else "COLLECTIVE_PIPELINING_MODE_OFF"}
    kept = zf.make_train_step(stack_loss, optax.sgd(LR), plan, prec, compiler_options=off)
    assert kept.compiler_options[key] == off[key]
