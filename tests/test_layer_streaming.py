"""offload="optimizer+params": the scanned layers' compute weights stay in pinned_host memory and
each layer is copied to the device only when it runs (make_train_step(gather_per_layer=...)).

On CPU every in-jit copy between memory kinds compiles to nothing (host and device are one
memory), so the copies are checked where they are real: in the step lowered for CUDA, which
works on this CPU-only jaxlib without a GPU.
"""
import re

import jax
import numpy as np
import optax
import pytest

import zeroflow as zf
from helpers import assert_leaves_equal, token_batches
from zeroflow.engine import offload
from zeroflow.config.schema import ModelConfig
from zeroflow.models import init_params, make_layerwise_loss_fn, make_loss_fn

pytestmark = pytest.mark.fast

CFG = ModelConfig(vocab_size=256, seq_len=32, num_layers=3, embed_dim=64, num_heads=4, mlp_dim=128,
                  remat="full")
BATCHES = token_batches(2, rows=16, seq_len=32, vocab=256)
BF16 = zf.Precision(params="bf16")


def _setup(stage, offload_kind="none", update_on="device", prec=BF16, grad_accum=1, devices=None):
    params, _ = init_params(CFG, jax.random.key(0))
    plan = zf.ZeroPlan(zf.make_mesh(devices=devices), stage=stage, offload=offload_kind, update_on=update_on)
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-3))
    state = zf.init_train_state(params, tx, plan, prec)
    step = zf.make_train_step(make_layerwise_loss_fn(CFG), tx, plan, prec, grad_accum,
                              gather_per_layer="layers")
    return state, step


def _run(stage, offload_kind="none", update_on="device", **kwargs):
    state, step = _setup(stage, offload_kind, update_on, **kwargs)
    losses = []
    for batch in BATCHES:
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
        if offload_kind == "optimizer+params" and state.compute is not None:
            # The stored compute weights stay on the host between steps, layers included.
            assert offload.memory_kinds(state.compute) == {"pinned_host"}
    return np.array(losses), jax.device_get(state)


def _assert_same(got, want):
    """Same losses, master weights, optimizer state and weights as used (an offloaded stage-3
    state keeps a compute copy in host memory; without offload stage 3 casts the master)."""
    (losses, state), (ref_losses, ref_state) = got, want
    np.testing.assert_array_equal(losses, ref_losses)
    pick = lambda s: (s.step, s.master, s.opt_state, s.params)  # noqa: E731
    assert_leaves_equal(pick(state), pick(ref_state))


@pytest.mark.parametrize("stage,update_on,grad_accum", [
    (0, "device", 1),
    (1, "host", 1),
    (3, "device", 2),
    (3, "host", 1),
])
def test_streamed_layers_match_unoffloaded_run(stage, update_on, grad_accum):
    ref = _run(stage, grad_accum=grad_accum)
    _assert_same(_run(stage, "optimizer+params", update_on, grad_accum=grad_accum), ref)


def test_fp32_stage1_gathers_from_master():
    """fp32 below stage 3 keeps no compute copy: nothing is streamed, the run still matches."""
    fp32 = zf.Precision()
    _assert_same(_run(1, "optimizer+params", "device", prec=fp32), _run(1, prec=fp32))


def _host_to_device_copies(step, state, batch):
    """``(where, operand type)`` of every copy to device memory in the CUDA lowering. ``where``
    is the function, and for a copy inside a loop of it, which loop (``"main/while1"``): jax 0.10
    lowers a scan's body as a function of its own, 0.11 inlines it into ``main``'s loop."""
    text = step.trace(state, batch).lower(lowering_platforms=("cuda",)).as_text()
    copies, func, depth, loops, loop = [], None, 0, 0, None
    for line in text.splitlines():
        if m := re.match(r"\s*func\.func \w+ @(\w+)", line):
            func, depth, loop = m.group(1), 0, None
        if "stablehlo.while" in line and loop is None:
            loops, loop = loops + 1, (depth, f"{func}/while{loops + 1}")
        if '_xla_buffer_placement = "device"' in line:
            where = func if loop is None else loop[1]
            copies.append((where, re.search(r": \((tensor<[^>]*>)\)", line).group(1)))
        depth += line.count("{") - line.count("}")
        if loop is not None and "}" in line and depth <= loop[0]:  # the loop's last region
            loop = None
    return copies


def _tensor_type(shape, dtype="bf16"):
    return "tensor<" + "x".join(map(str, shape)) + "x" + dtype + ">"


@pytest.mark.parametrize("stage,devices", [(0, 1), (3, 8)])
def test_each_layer_is_copied_in_when_it_runs(stage, devices):
    state, step = _setup(stage, "optimizer+params", "device", devices=jax.devices()[:devices])
    copies = _host_to_device_copies(step, state, BATCHES[0])
    layers = jax.tree.leaves(state.compute["layers"])
    per_device = [a.sharding.shard_shape(a.shape) for a in layers]
    stacked = {_tensor_type(s) for s in per_device} | {_tensor_type(a.shape) for a in layers}
    one_layer = {_tensor_type(s[1:]) for s in per_device}
    copied = {t for _, t in copies}
    # No layer stack crosses whole ...
    assert not stacked & copied, sorted(stacked & copied)
    # ... each layer's slice does, in the forward scan and again in the backward's recompute.
    for t in one_layer:
        assert len({f for f, c in copies if c == t and f != "main"}) >= 2, (t, copies)


def test_not_streamed_without_layer_hook():
    """Without gather_per_layer the engine cannot reach the layers: they come in whole."""
    params, _ = init_params(CFG, jax.random.key(0))
    plan = zf.ZeroPlan(zf.make_mesh(devices=jax.devices()[:1]), stage=0, offload="optimizer+params")
    tx = optax.adam(1e-3)
    state = zf.init_train_state(params, tx, plan, BF16)
    step = zf.make_train_step(make_loss_fn(CFG), tx, plan, BF16)
    copied = {t for _, t in _host_to_device_copies(step, state, BATCHES[0])}
    assert {_tensor_type(a.shape) for a in jax.tree.leaves(state.compute["layers"])} <= copied


def test_gradient_stand_in_costs_no_memory():
    """The zeros the streamed layers' gradients are taken against are never materialised: the
    compiled step needs no more temporary memory than the run that offloads only the optimizer
    state (the same update, the compute weights on the device)."""
    def temp(offload_kind):
        state, step = _setup(3, offload_kind, devices=jax.devices())
        return step.lower(state, BATCHES[0]).compile().memory_analysis().temp_size_in_bytes
    assert temp("optimizer+params") <= temp("optimizer")
