"""XLA:GPU programs compiled for abstract H100s on a CPU-only machine (``zf.target_mesh``): the
peak per device against the ZeRO formula, and the overlap of the collectives in XLA's schedule.

The model is plain JAX (dicts of arrays, 16 unrolled layers, no hints), as a user outside the
project writes it. Its activations are kept small (8 sequences of 64 tokens) so that the
model states dominate, as the formula assumes; each weight is under 3% of the model, as in
models of realistic depth (a model of a few huge weights pays each one's transients, see
docs/gpu_compile.md)."""
import json
import re

import jax
import jax.numpy as jnp
import optax
import pytest
from helpers import require_cuda_plugin

pytestmark = pytest.mark.slow

require_cuda_plugin()

import zeroflow as zf  # noqa: E402
from zeroflow.backend import targets  # noqa: E402
from zeroflow.memory.measure import analysed, device_peak  # noqa: E402

D, F, V, LAYERS, N = 512, 2048, 4096, 16, 8


def _params(width=D, hidden=F, layers=LAYERS):
    k = jax.random.key(0)
    p = {"embed": jax.random.normal(k, (V, width)) * 0.02,
         "head": jax.random.normal(k, (width, V)) * 0.02}
    for i in range(layers):
        p[f"up{i}"] = jax.random.normal(k, (width, hidden)) * 0.02
        p[f"down{i}"] = jax.random.normal(k, (hidden, width)) * 0.02
    return jax.eval_shape(lambda: p)


def loss_fn(p, b):
    x = p["embed"][b["tokens"][:, :-1]]
    for i in range(sum(name.startswith("up") for name in p)):
        x = x + jax.nn.gelu(x @ p[f"up{i}"]) @ p[f"down{i}"]
    logits = (x @ p["head"]).astype(jnp.float32)
    return optax.softmax_cross_entropy_with_integer_labels(logits, b["tokens"][:, 1:]).mean()


BATCH = {"tokens": jax.ShapeDtypeStruct((8, 65), jnp.int32)}


def zero_formula(stage, psi, n):
    """The ZeRO paper's model states per device (bf16 weights and gradients, K = 12)."""
    return {2: 2 * psi + 14 * psi / n, 3: 16 * psi / n}[stage]


def _compile(stage, **step_options):
    params = _params()
    plan = zf.ZeroPlan(zf.target_mesh("h100", data=N), stage=stage)
    compiled, state = zf.memory.compile_step(loss_fn, params, BATCH, optax.adamw(1e-3), plan,
                                             zf.Precision(params="bf16"), **step_options)
    peak = device_peak(analysed(compiled), state)
    return compiled, peak, sum(x.size for x in jax.tree.leaves(params))


@pytest.fixture(scope="module")
def stage3():
    return _compile(3)


def test_target_mesh_is_eight_abstract_h100s():
    mesh = zf.target_mesh("h100", data=4, model=2)
    assert mesh.shape == {"data": 4, "model": 2}
    assert {d.device_kind for d in mesh.devices.flat} == {"NVIDIA H100 80GB HBM3"}
    traits = zf.backend.of(mesh)
    assert traits.platform == "gpu" and traits.separate_host_memory and traits.has_cudnn
    assert traits.compiles_pallas and traits.overlaps_collectives
    assert not traits.widens_half_precision
    assert traits.memory_bytes == int(targets.spec_field(targets.spec_text("h100"),
                                                         "device_memory_size"))
    two_hosts = zf.target_mesh("h100", data=16, hosts=2)
    assert {d.process_index for d in two_hosts.devices.flat} == {0, 1}


def test_h200_target_is_an_h100_with_141_gb():
    """The H200 (same GH100 die, 141 GB HBM3e): its abstract devices report its name and memory,
    and a step compiled for it has the H100's peak (the same program) but fits where the H100's
    80 GB does not."""
    mesh = zf.target_mesh("h200", data=8)
    assert {d.device_kind for d in mesh.devices.flat} == {"NVIDIA H200"}
    traits = zf.backend.of(mesh)
    assert traits.platform == "gpu" and traits.separate_host_memory and traits.compiles_pallas
    assert traits.memory_bytes == 143771 * 2**20  # nvidia-smi's 143771 MiB (141 GB)
    assert traits.memory_bytes > 1.7 * zf.backend.of(zf.target_mesh("h100", data=8)).memory_bytes

    def peak(gpu):
        mesh = zf.target_mesh(gpu, data=8)
        x = jax.ShapeDtypeStruct((512, 1024), jnp.float32,
                                 sharding=jax.sharding.NamedSharding(mesh, jax.P("data")))
        w = jax.ShapeDtypeStruct((1024, 1024), jnp.float32,
                                 sharding=jax.sharding.NamedSharding(mesh, jax.P()))
        compiled = jax.jit(lambda x, w: jnp.tanh(x @ w) @ w.T).lower(x, w).compile()
        assert "__triton_nested_gemm_fusion" in compiled.as_text()  # XLA:GPU's, not XLA:CPU's
        m = compiled.memory_analysis()
        return (m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes
                - m.alias_size_in_bytes)
    assert peak("h200") == peak("h100") > 4 * 2**20  # at least w itself


def test_cpu_mesh_traits():
    traits = zf.backend.of(zf.make_mesh())
    assert traits.platform == "cpu" and traits.widens_half_precision
    assert not (traits.separate_host_memory or traits.has_cudnn or traits.compiles_pallas)


@pytest.mark.parametrize("call, message", [
    (lambda: zf.target_mesh("b200", data=8), "unknown target GPU 'b200'; choose one of h100, h200"),
    (lambda: zf.target_mesh("h100", data=3, hosts=2), "do not split into 2 hosts"),
    (lambda: zf.target_mesh("h100", data=0), "data must be a positive int"),
])
def test_target_mesh_errors_are_one_line(call, message):
    with pytest.raises(ValueError, match=message) as e:
        call()
    assert "\n" not in str(e.value)


def test_missing_plugin_says_what_to_install(monkeypatch):
    monkeypatch.setattr(targets, "plugin_installed", lambda: False)
    targets._topology.cache_clear()
    try:
        with pytest.raises(targets.TargetUnavailable, match=r"pip install jax-cuda1[23]-plugin=="):
            zf.target_mesh("a100", data=2)
    finally:
        targets._topology.cache_clear()


def test_stage3_peak_is_near_the_zero_formula_on_xla_gpu(stage3):
    """Besides the model states: one whole fp32 gradient on its way to its reduce-scatter, the
    weights of the unit being computed and of the one prefetched (1.33x on jax 0.10.2)."""
    _, peak, psi = stage3
    assert peak <= 1.5 * zero_formula(3, psi, N), (peak, zero_formula(3, psi, N))


def test_few_large_weights_reduce_one_gradient_at_a_time():
    """Six layers of 1024 x 4096, each weight 7% of the model: the transients of a unit are
    large against the formula, and two whole fp32 gradients alive at once (one reduce-
    scattering while the next is widened) made the peak 1.56x. The backward pass reduces one
    unit's gradient after the other (1.47x on jax 0.10.2)."""
    params = _params(width=1024, hidden=4096, layers=6)
    plan = zf.ZeroPlan(zf.target_mesh("h100", data=N), stage=3)
    compiled, state = zf.memory.compile_step(
        loss_fn, params, {"tokens": jax.ShapeDtypeStruct((8, 17), jnp.int32)}, optax.adamw(1e-3),
        plan, zf.Precision(params="bf16"))
    psi = sum(x.size for x in jax.tree.leaves(params))
    peak = device_peak(analysed(compiled), state)
    assert peak <= 1.5 * zero_formula(3, psi, N), (peak / zero_formula(3, psi, N))


ONE_PASS_DOTS = {"xla_gpu_experimental_force_split_k": 1}
"""XLA:GPU's split-K off: every dot reduces over its whole contraction in one pass."""

TOKENS_PER_DEVICE = BATCH["tokens"].shape[0] * (BATCH["tokens"].shape[1] - 1) // N


@pytest.fixture(scope="module")
def stage2_one_pass():
    return _compile(2, compiler_options=ONE_PASS_DOTS)


def test_stage2_peak_is_the_zero_formula_on_xla_gpu(stage2_one_pass):
    """The model states of stage 2 (whole bf16 weights and gradients, sharded optimizer), with
    the dots' tiling fixed to one pass over the contraction (1.10x on jax 0.10.2, 0.11.2 and
    0.12.0.1). Without an autotuner (a deviceless compile) XLA:GPU splits the 64-token dots'
    contraction 4 ways (split-K) and sums the fp32 partials in the consumer; from jax 0.12 it
    sums them again in the backward pass instead of keeping the summed bf16 pre-activation, so
    each layer's partials (2 MiB, 8x the 256 KiB activation) stay alive through the backward
    pass: 1.28x. Those are activations, which the formula does not count and this model keeps
    small on purpose; the next test accounts for them."""
    _, peak, psi = stage2_one_pass
    assert peak <= 1.25 * zero_formula(2, psi, N), (peak, zero_formula(2, psi, N))


def test_split_k_partials_are_all_that_xla_tiling_adds_at_stage_2(stage2_one_pass):
    """The control, XLA:GPU's own tiling: the peak exceeds the one-pass program's by at most the
    split-K partials of every layer's up-projection kept in place of its bf16 output (jax
    0.12.0.1: +26.5 MB against 29.4 MB of partials; 0.10.2 and 0.11.2: +0.1 MB)."""
    compiled, peak, _ = _compile(2)
    one_pass_peak = stage2_one_pass[1]
    splits = [int(k) for k in re.findall(rf"f32\[(\d+),{TOKENS_PER_DEVICE},{F}\]",
                                         compiled.as_text())]
    partials = LAYERS * (max(splits, default=1) * TOKENS_PER_DEVICE * F * 4
                         - TOKENS_PER_DEVICE * F * 2)
    assert peak - one_pass_peak <= partials, (peak - one_pass_peak, partials)


def test_combined_gradient_reduction_breaks_the_bound():
    """The control: with XLA:GPU's default combining (every reduce-scatter merged into one at
    the end of the backward pass) all whole fp32 gradients are alive at once, unless the
    reductions are ordered one after another, as the prefetching backward pass orders them."""
    combining = {"xla_gpu_reduce_scatter_combine_threshold_bytes": 2**30,
                 "xla_gpu_all_gather_combine_threshold_bytes": 2**30}
    _, peak, psi = _compile(3, prefetch=0, compiler_options=combining)
    assert peak > 1.6 * zero_formula(3, psi, N)
    _, peak, psi = _compile(3, compiler_options=combining)
    assert peak <= 1.5 * zero_formula(3, psi, N)


def test_stage3_collectives_overlap_compute(stage3):
    compiled, _, _ = stage3
    colls = zf.memory.collectives(compiled)
    summary = zf.memory.overlap(colls)
    # every weight gathered in the forward and again in the backward pass; every gradient
    # reduce-scattered once
    assert summary["all-gather"]["count"] >= 2 * (2 * LAYERS + 2) - 1
    # (a layer's two gradients, 0.5 MB shards, may travel in one combined reduce-scatter)
    assert summary["reduce-scatter"]["count"] >= LAYERS + 2
    assert summary["all-gather"]["fraction"] >= 0.9, summary
    assert summary["reduce-scatter"]["fraction"] >= 0.9, summary
    gathered = [c.bytes for c in colls if c.kind == "all-gather"]
    # Each gather brings whole arrays: bf16 weights (a combined gather several: its bytes a sum
    # of weights' sizes from the parameter shapes), or, for the embedding and the head, the
    # whole batch's activations (the embedding is looked up where its rows are, so every
    # device gathers all the tokens; the head, split by columns, is multiplied where its
    # columns are, so the hidden state is gathered, in the forward and the backward pass).
    # A shard (1/8 of one) is none of these, so a parser that read any gather's operand
    # instead of its result fails here.
    tokens, width = BATCH["tokens"].shape[0], BATCH["tokens"].shape[1] - 1
    activations = {tokens * width * 4, tokens * width * D * 2}  # int32 tokens, bf16 hidden
    whole = _sums_of_whole_weights([2 * x.size for x in jax.tree.leaves(_params())])
    shards = sorted({b for b in gathered if b not in whole | activations})
    assert not shards, f"{len(shards)} gathers of {len(gathered)} are not whole arrays: {shards}"
    # every layer weight gathered whole in the forward and the backward pass (one may be kept
    # from the forward's last gather), one weight per gather, never several combined: the
    # largest gathered is a layer's
    assert sum(b == D * F * 2 for b in gathered) >= 2 * 2 * LAYERS - 1
    assert max(gathered) == D * F * 2


def _sums_of_whole_weights(sizes: list[int]) -> set[int]:
    """Every byte count a gather of one or more whole weights of ``sizes`` can have."""
    sums = {0}
    for size in sizes:
        sums |= {s + size for s in sums}
    return sums - {0}


def test_without_prefetch_gathers_wait_for_their_own_operation():
    """The control: a fetch that waits for its own operation's inputs has nothing to overlap."""
    compiled, _, _ = _compile(3, prefetch=0)
    summary = zf.memory.overlap(zf.memory.collectives(compiled))
    assert summary["all-gather"]["fraction"] < 0.75, summary


def test_collectives_on_xla_cpu_are_in_line():
    plan = zf.ZeroPlan(zf.make_mesh(), stage=3)
    small = {"w": jax.ShapeDtypeStruct((64, 64), jnp.float32)}
    compiled, _ = zf.memory.compile_step(
        lambda p, b: jnp.mean((b["x"] @ p["w"]) ** 2), small,
        {"x": jax.ShapeDtypeStruct((16, 64), jnp.float32)}, optax.sgd(0.1), plan, zf.Precision())
    colls = zf.memory.collectives(compiled)
    assert any(c.kind == "all-gather" for c in colls)
    assert not any(c.asynchronous for c in colls)


def test_memory_cli_compiles_for_the_target(capsys):
    from zeroflow.memory import __main__ as cli
    assert cli.main(["--config", "configs/tiny.yaml", "--target", "h100", "--devices", "8",
                     "--stages", "3", "--offloads", "none,optimizer", "--remats", "full",
                     "--json", "precision.params=bf16", "train.batch_size=16"]) == 0
    row, offloaded = [json.loads(line) for line in capsys.readouterr().out.strip().splitlines()[-2:]]
    assert row["target"] == "h100" and row["fits"] is True
    assert row["device_memory_bytes"] == zf.backend.of(zf.target_mesh("h100", 8)).memory_bytes
    assert row["measured_peak_bytes"] > 0
    assert row["overlap"]["all-gather"]["count"] > 0
    # The offloaded choice is compiled through CPU stand-ins (abstract GPUs carry no host
    # memory): XLA:GPU keeps at least the fp32 master and the two Adam moments (12 bytes per
    # parameter, over 8 devices) in host memory, and less on the device than without offload.
    assert offloaded["offload"] == "optimizer" and "note" not in offloaded
    psi = zf.memory.count_gpt_params(_tiny_model())
    assert offloaded["measured_host_bytes"] >= 12 * psi / 8
    assert offloaded["measured_peak_bytes"] < row["measured_peak_bytes"]


def _tiny_model():
    from zeroflow.config.io import load_config
    return load_config("configs/tiny.yaml", []).model


def scan_loss(p, b):
    """Plain JAX with ``lax.scan`` over stacked weights and no hints."""
    def body(x, wb):
        w, bias = wb
        return jax.nn.relu(x @ w.astype(x.dtype) + bias.astype(x.dtype)), None
    x, _ = jax.lax.scan(body, b["x"].astype(p["w"].dtype), (p["w"], p["b"]))
    return optax.softmax_cross_entropy_with_integer_labels(
        (x @ p["head"]).astype(jnp.float32), b["y"]).mean()


@pytest.mark.parametrize("stage, bound", [(2, 1.25), (3, 1.5)])
def test_scan_model_peak_is_near_the_zero_formula_on_xla_gpu(stage, bound):
    """16 stacked 512 x 512 layers: stage 3 gathers each iteration's slice; stage 2 gathers the
    updated stack slice by slice (all at once, XLA:GPU lays the gathered rows out first and
    copies the whole stack again: 1.73x). At stage 3 the gathers and reduce-scatters inside the
    loops overlap compute. (From jax 0.11 XLA:GPU's analytical speed-of-light latency estimator
    leaves the backward loop's reduce-scatter synchronous, and on 0.12 the final one too: the
    stage-3 case fails there; with that estimator off both overlap. .ci/run says more.)"""
    params = jax.eval_shape(lambda: {"w": jnp.zeros((16, D, D)), "b": jnp.zeros((16, D)),
                                     "head": jnp.zeros((D, 10))})
    batch = {"x": jax.ShapeDtypeStruct((16, D), jnp.float32),
             "y": jax.ShapeDtypeStruct((16,), jnp.int32)}
    plan = zf.ZeroPlan(zf.target_mesh("h100", data=N), stage=stage)
    compiled, state = zf.memory.compile_step(scan_loss, params, batch, optax.adamw(1e-3), plan,
                                             zf.Precision(params="bf16"))
    peak = device_peak(analysed(compiled), state)
    psi = sum(x.size for x in jax.tree.leaves(params))
    assert peak <= bound * zero_formula(stage, psi, N), (peak / zero_formula(stage, psi, N))
    if stage == 3:
        # Each iteration's own gather and reduce-scatter overlap its compute, also in the
        # backward loop (with XLA's reduce-scatter pipelining, that loop's gather ran in line).
        summary = zf.memory.overlap(zf.memory.collectives(compiled))
        assert summary["all-gather"]["fraction"] >= 0.9, summary
        assert summary["reduce-scatter"]["fraction"] >= 0.9, summary
