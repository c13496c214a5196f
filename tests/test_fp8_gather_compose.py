"""FP8 stage-3 weight gathers (``ZeroPlan(quantize_weights="fp8")``) combined with hpZ, host
offload and LoRA / QLoRA frozen base weights, each against references written here:

- numerics on 8 emulated CPU devices: the step's loss is plain JAX's loss at the weights
  rounded by hand (NumPy and ml_dtypes: one scale per matrix, ``amax / 448``, each entry to
  e4m3; a scanned stack one scale per layer), and its gradient plain autodiff's there;
  vectors (norm gains) are not rounded, an NF4 base is rounded by ``tests/nf4_reference.py``
  instead and never cast to e4m3;
- the gathered types read from the lowered program: matrices in e4m3 (NF4 bases as their
  packed bytes), vectors in the compute dtype, one fp32 amax per device and matrix;
- bytes on the wire from XLA:GPU programs compiled for abstract H100s: the all-gathers'
  result types read from the compiled HLO text, e4m3 weight bytes exactly half of the bf16
  gathers' and the rest one scale per device; hpZ's within-host gathers in e4m3, its refresh
  across hosts in bf16 (2 bytes per parameter over the host's devices).
"""

import math
import re

import jax
import jax.numpy as jnp
import ml_dtypes
import nf4_reference
import numpy as np
import optax
import pytest

import zeroflow as zf
from zeroflow.xla import hlo

pytestmark = pytest.mark.fast

LR = 0.5
RANK, ALPHA = 2, 4.0


def np_e4m3(w, scale_of=lambda amax: amax * np.float32(1.0 / 448.0)):
    """``(e4m3 values, scale)`` of the matrix ``w``: one scale for the whole weight, its largest
    magnitude over 448 (1 when all zero), each entry divided by it and rounded to e4m3. XLA
    divides by the constant 448 as a product with its fp32 reciprocal (``scale_of``), a scale
    one ulp above the quotient for some weights; with bf16 weights entries then often sit on
    an exact tie between two e4m3 values, which that ulp decides (the error is half a step
    either way)."""
    w32 = np.asarray(w).astype(np.float32)
    amax = np.float32(np.abs(w32).max())
    scale = scale_of(amax) if amax > 0 else np.float32(1.0)
    return np.clip(w32 / scale, -448, 448).astype(ml_dtypes.float8_e4m3fn), scale


def np_gathered(w):
    """``w`` (as stored: fp32 or bf16) as an FP8 gather hands it to the loss, in fp32: its
    e4m3 values (``np_e4m3``) times the scale in fp32, cast to the stored dtype. A vector
    (fewer than 2 dimensions) is gathered as it is stored."""
    stored = np.asarray(w)
    if stored.ndim < 2:
        return stored.astype(np.float32)
    q, scale = np_e4m3(stored)
    return (q.astype(np.float32) * scale).astype(stored.dtype).astype(np.float32)


def np_nf4(w):
    """A frozen matrix as ``zf.quantize_frozen(kind="nf4")`` keeps it (vectors stay as they are)."""
    return nf4_reference.round_trip(w) if np.ndim(w) >= 2 else np.asarray(w, np.float32)


def np_bf16(tree):
    return jax.tree.map(lambda x: np.asarray(x, np.float32).astype(ml_dtypes.bfloat16), tree)


def as_fp32(tree):
    return jax.tree.map(lambda x: np.asarray(x, np.float32), tree)


def loss_fn(p, b):
    """fp32 arithmetic on whatever dtype the weights arrive in: the loss then reads exactly
    the gathered values, and a reference in fp32 computes the same numbers."""
    h = jnp.tanh(b["x"] @ p["w1"].astype(jnp.float32)) * p["gain"].astype(jnp.float32)
    return jnp.mean((h @ p["w2"].astype(jnp.float32) - b["y"]) ** 2)


def _params(seed=0):
    """Two matrices and a gain vector far from e4m3's values (1 + 0.3 x normal)."""
    rng = np.random.default_rng(seed)
    return {
        "w1": rng.normal(size=(64, 32)).astype(np.float32) * 0.2,
        "gain": 1 + 0.3 * rng.normal(size=(32,)).astype(np.float32),
        "w2": rng.normal(size=(32, 8)).astype(np.float32) * 0.2,
    }


_rng = np.random.default_rng(9)
BATCH = {
    "x": _rng.normal(size=(16, 64)).astype(np.float32),
    "y": _rng.normal(size=(16, 8)).astype(np.float32),
}


def one_step(params, loss, prec, trainable=None, **options):
    """``(loss, gradient of the trained leaves, lowered text)`` of one stage-3 SGD step on 8
    devices; the gradient read back from the fp32 master's update."""
    plan = zf.ZeroPlan(zf.make_mesh(), stage=3, **options)
    tx = optax.sgd(LR)
    state = zf.init_train_state(params, tx, plan, prec, trainable=trainable)
    step = zf.make_train_step(loss, tx, plan, prec)
    text = step.lower(state, BATCH).as_text()
    before = jax.tree.map(np.asarray, state.master_params)
    state, metrics = step(state, BATCH)
    grads = jax.tree.map(lambda a, b: (a - np.asarray(b)) / LR, before, state.master_params)
    return float(metrics["loss"]), grads, text


def reference(seen, loss, argnums=0):
    """Plain JAX on one device: the loss and gradient at the weights the gathers hand over."""
    value, grads = jax.jit(jax.value_and_grad(loss, argnums=argnums))(*seen, BATCH)
    return float(value), grads


def assert_close_to_max(got, want, tol):
    """Every entry within ``tol`` of the largest magnitude of ``want``, leaf by leaf: bf16
    weights make the per-device gradients bf16 before the fp32 sum over devices."""
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        w = np.asarray(w, np.float32)
        assert np.abs(np.asarray(g) - w).max() <= tol * np.abs(w).max()


def check_at_rounded_weights(got_loss, grads, seen, plain, loss, tol, argnums=0):
    """The step's loss equals plain JAX's at the rounded weights, its gradient autodiff's
    there; and the rounding matters: at the unrounded weights both are further off."""
    want_loss, want_grads = reference(seen, loss, argnums)
    plain_loss, plain_grads = reference(plain, loss, argnums)
    np.testing.assert_allclose(got_loss, want_loss, rtol=1e-5)
    assert abs(plain_loss - want_loss) > 100 * 1e-5 * abs(want_loss)
    assert_close_to_max(grads, want_grads, tol)
    gaps = [
        np.abs(np.asarray(p) - np.asarray(w)).max() / np.abs(np.asarray(w)).max()
        for p, w in zip(jax.tree.leaves(plain_grads), jax.tree.leaves(want_grads))
    ]
    assert max(gaps) > 3 * tol, gaps


def lowered_gathers(text, local=8):
    """``[(result shape, element type, crosses hosts)]`` of the all_gathers in lowered
    (StableHLO) text; a group crosses hosts when its devices are on two hosts of ``local``.
    Groups are listed (``dense<[[...]]>``) or, from jax 0.11, named by mesh axes."""
    meshes = {
        name: [(a, int(n)) for a, n in re.findall(r'"(\w+)"=(\d+)', axes)]
        for name, axes in re.findall(r"sdy.mesh @(\w+) = <\[([^\]]*)\]>", text)
    }
    rows = []
    for line in text.splitlines():
        found = re.search(
            r"all_gather.*replica_groups = (dense<\[\[.*?\]\]>|#stablehlo.replica_group_mesh_axes"
            r"<.*?\]>).*->\s*tensor<([^>]*)>",
            line,
        )
        if not found:
            continue
        groups, result = found.groups()
        *dims, dtype = result.split("x")
        members = _lowered_groups(groups, meshes)
        across = any(len({d // local for d in g}) > 1 for g in members)
        rows.append((tuple(int(d) for d in dims), dtype, across))
    return rows


def _lowered_groups(groups, meshes):
    """Device ids of each replica group: listed, or every device along the named mesh axes."""
    if groups.startswith("dense<"):
        return [[int(d) for d in g.split(",")] for g in re.findall(r"\[([\d, ]+)\]", groups)]
    axes = meshes[re.search(r"mesh = @(\w+)", groups)[1]]
    grouped = re.findall(r'axis_ref<name = "(\w+)"', groups)
    return hlo.mesh_axis_groups([a for a, _ in axes], [n for _, n in axes], grouped)


def check_gathers(text, compute, packed=False, local=8):
    """Every matrix gathered as e4m3 (an NF4 base, ``packed``, as bytes), vectors in the
    ``compute`` dtype, one fp32 amax per device and matrix; a gather across hosts (hpZ's
    refresh, hosts of ``local`` devices) in bf16."""
    rows = lowered_gathers(text, local)
    inside = [(shape, t) for shape, t, across in rows if not across]
    matrices = {t for shape, t in inside if len(shape) >= 2}
    vectors = {t for shape, t in inside if len(shape) < 2}
    bytes_ = {"ui8"} if packed else set()  # packed bytes: flat, or one row per layer
    assert "f8E4M3FN" in matrices and matrices <= {"f8E4M3FN"} | bytes_, matrices
    assert {"f32", compute} <= vectors <= {"f32", compute} | bytes_, vectors
    assert bytes_ <= matrices | vectors
    assert {t for _, t, across in rows if across} <= {"bf16"}


def test_hpz_gathers_within_the_host_in_e4m3_at_plain_autodiffs_gradient():
    """hpZ on 2 hosts of 4 devices with bf16 weights: each host's secondary copy is gathered
    among its 4 devices as e4m3 with the whole weight's scale (the copy is whole within the
    host, so the host's amax is the weight's)."""
    params = _params()
    bf16 = np_bf16(params)
    loss, grads, text = one_step(
        params,
        loss_fn,
        zf.Precision(params="bf16"),
        quantize_weights="fp8",
        hierarchical=True,
        hosts=2,
    )
    seen = jax.tree.map(np_gathered, bf16)
    check_at_rounded_weights(loss, grads, (seen,), (as_fp32(bf16),), loss_fn, tol=1e-2)
    check_gathers(text, "bf16", local=4)
    weights = [shape[0] for shape, t, _ in lowered_gathers(text, 4) if t == "f8E4M3FN"]
    assert weights and set(weights) == {4}  # one piece from each of the host's 4 devices


@pytest.mark.parametrize(
    "offload, update_on", [("optimizer", "host"), ("optimizer+params", "device")]
)
def test_offload_gathers_e4m3_at_plain_autodiffs_gradient(offload, update_on):
    """The master and optimizer state in host memory (and the bf16 weights too, with
    optimizer+params): every matrix gather still moves e4m3."""
    params = _params(1)
    bf16 = np_bf16(params)
    loss, grads, text = one_step(
        params,
        loss_fn,
        zf.Precision(params="bf16"),
        quantize_weights="fp8",
        offload=offload,
        update_on=update_on,
    )
    seen = jax.tree.map(np_gathered, bf16)
    check_at_rounded_weights(loss, grads, (seen,), (as_fp32(bf16),), loss_fn, tol=1e-2)
    check_gathers(text, "bf16")


def stack_loss(p, b):
    """A scanned stack of 3 layers (each fetched on its own, a gain vector per layer) and a
    head, fp32 arithmetic."""

    def layer(h, w):
        return jnp.tanh(h @ w["w"].astype(jnp.float32)) * w["gain"].astype(jnp.float32), None

    h, _ = jax.lax.scan(layer, b["x"], p["layers"])
    return jnp.mean((h @ p["head"].astype(jnp.float32) - b["y"]) ** 2)


def _stack_params():
    """Layers of very different sizes, so that one scale per layer and one for the whole
    stack round differently."""
    rng = np.random.default_rng(5)
    sizes = np.array([0.15, 0.45, 0.05], np.float32)[:, None, None]
    return {
        "layers": {
            "w": rng.normal(size=(3, 64, 64)).astype(np.float32) * sizes,
            "gain": 1 + 0.3 * rng.normal(size=(3, 64)).astype(np.float32),
        },
        "head": rng.normal(size=(64, 8)).astype(np.float32) * 0.2,
    }


MODELS = {
    "mlp": (loss_fn, lambda: _params(2), r"^w"),
    "stack": (stack_loss, _stack_params, "layers/w"),
}


def per_layer(round_trip, model):
    """``round_trip`` applied as the step fetches each leaf: a scanned stack one layer at a
    time (each layer with its own scale), any other leaf whole."""

    def one(path, x):
        if model == "stack" and jax.tree_util.keystr(path).find("layers") >= 0:
            return np.stack([round_trip(layer) for layer in np.asarray(x)])
        return round_trip(x)

    return lambda tree: jax.tree_util.tree_map_with_path(one, tree)


def _lora(model):
    """The model with rank-2 adapters, factors perturbed off LoRA's zero B."""
    loss, make_params, targets = MODELS[model]
    params = make_params()
    lo = zf.lora(loss, rank=RANK, alpha=ALPHA, targets=targets)
    adapters = lo.init(jax.random.key(3), params, BATCH)
    rng = np.random.default_rng(4)
    adapters = jax.tree.map(
        lambda a: np.asarray(a) + 0.3 * rng.normal(size=a.shape).astype(np.float32), adapters
    )
    trainable = {
        "base": jax.tree.map(lambda _: False, params),
        "lora": jax.tree.map(lambda _: True, adapters),
    }
    return lo, params, adapters, trainable


def _adapted(lo):
    return lambda base, adapters, batch: lo.loss({"base": base, "lora": adapters}, batch)


HPZ = {"hierarchical": True, "hosts": 2}
OFFLOAD = {"offload": "optimizer+params"}


@pytest.mark.parametrize(
    "model, options",
    [("mlp", {}), ("stack", {}), ("mlp", HPZ), ("stack", OFFLOAD)],
    ids=["mlp", "stack", "mlp-hpz", "stack-offload"],
)
def test_lora_frozen_bf16_base_gathers_e4m3_at_plain_autodiffs_gradient(model, options):
    """LoRA at stage 3 with bf16 weights: the frozen base's matrices (stored bf16, no master)
    and the adapters are gathered as e4m3, a scanned stack's layers each with its own scale,
    the base's gains in bf16; the adapters' gradient is autodiff's at those weights. With hpZ
    the frozen base's copy per host is gathered within the host; with offload it streams from
    host memory."""
    lo, params, adapters, trainable = _lora(model)
    loss, grads, text = one_step(
        {"base": params, "lora": adapters},
        lo.loss,
        zf.Precision(params="bf16"),
        trainable=trainable,
        quantize_weights="fp8",
        **options,
    )
    base, ad = np_bf16(params), np_bf16(adapters)
    rounded = per_layer(np_gathered, model)
    seen = (rounded(base), rounded(ad))
    plain = as_fp32((base, ad))
    check_at_rounded_weights(loss, grads["lora"], seen, plain, _adapted(lo), tol=1e-2, argnums=1)
    check_gathers(text, "bf16", local=4 if "hierarchical" in options else 8)


@pytest.mark.parametrize(
    "model, options",
    [("mlp", {}), ("stack", {}), ("stack", HPZ)],
    ids=["mlp", "stack", "stack-hpz"],
)
def test_qlora_nf4_base_is_gathered_as_its_packed_bytes_and_the_adapters_in_e4m3(model, options):
    """QLoRA: the NF4 base (about half a byte a weight) is gathered as the packed bytes it is
    stored in, never cast to e4m3 (that would double its bytes and round it twice); the
    adapters are gathered in e4m3, the base's gains as they are. The loss reads the NF4 round
    trip of the format's NumPy reference (in bf16 with hpZ, which keeps a bf16 copy)."""
    lo, params, adapters, trainable = _lora(model)
    qparams, qtrainable = zf.quantize_frozen(
        {"base": params, "lora": adapters},
        trainable,
        kind="nf4",
        stacked="base/layers" if model == "stack" else None,
    )
    bf16 = "hierarchical" in options
    prec = zf.Precision(params="bf16" if bf16 else "fp32")
    loss, grads, text = one_step(
        qparams, lo.loss, prec, trainable=qtrainable, quantize_weights="fp8", **options
    )
    base, ad = per_layer(np_nf4, model)(params), adapters
    if bf16:  # NF4 dequantized to bf16, the adapters' bf16 copy gathered
        base, ad = np_bf16(base), np_bf16(adapters)
    seen = as_fp32((base, per_layer(np_gathered, model)(ad)))
    tol = 1e-2 if bf16 else 1e-5
    check_at_rounded_weights(loss, grads["lora"], seen, as_fp32((base, ad)), _adapted(lo), tol, 1)
    check_gathers(text, "bf16" if bf16 else "f32", packed=True, local=4 if bf16 else 8)


def test_the_fp8_matmul_recasts_jitted_bf16_gathers_to_the_numpy_bytes():
    """Compiled (where XLA's reciprocal of 448 decides the ties of bf16 weights), the e4m3
    bytes of a bf16 weight, and those the FP8 matmul's own cast makes of the bf16 weight the
    gather hands back, are both the NumPy reference's: the weight is rounded once."""
    from zeroflow.autocast import fp8

    def cast_twice(w):
        q = fp8.quantize(w, fp8.scale_of(w, fp8.E4M3), fp8.E4M3)
        gathered = fp8.dequantize(q, fp8.scale_of(w, fp8.E4M3), jnp.bfloat16)
        return q, fp8.quantize(gathered, fp8.scale_of(gathered, fp8.E4M3), fp8.E4M3)

    rng = np.random.default_rng(7)
    ties = 0
    for size in np.geomspace(0.01, 100.0, 24):
        w = (rng.normal(size=(64, 64)) * size).astype(ml_dtypes.bfloat16)
        first, again = jax.jit(cast_twice)(jnp.asarray(w))
        want = np_e4m3(w)[0].view(np.uint8)
        quotient = np_e4m3(w, scale_of=lambda amax: amax / np.float32(448.0))[0]
        ties += int(np.sum(quotient.view(np.uint8) != want))
        for got in (first, again):
            assert np.array_equal(np.asarray(got).view(np.uint8), want)
    assert ties > 0  # the reciprocal's ulp decided some ties: the check sees it


def test_trainer_qlora_keys_gather_nf4_bytes_adapters_in_e4m3_and_gains_in_bf16():
    """The trainer's GPT with ``model.lora.quantize=nf4`` and ``parallel.quantize_weights=fp8``
    at stage 3 (the config's keys reach the step): its lowered step gathers the NF4 base as
    bytes, the adapters in e4m3, the frozen norms' gains in bf16."""
    from zeroflow.config.io import load_config
    from zeroflow.trainer.setup import abstract_batch, build_run

    keys = ["parallel.zero_stage=3", "parallel.quantize_weights=fp8", "model.lora.rank=4"]
    keys += ["model.lora.quantize=nf4", "precision.params=bf16"]
    cfg = load_config("configs/tiny.yaml", keys)
    run = build_run(cfg, with_data=False)
    text = run.make_step().lower(run.abstract_state(), abstract_batch(cfg)).as_text()
    check_gathers(text, "bf16", packed=True)


def test_hpz_with_offload_is_one_line_with_fp8_gathers_too():
    """hpZ keeps its copy in device memory, which offload does not: refused, naming both."""
    with pytest.raises(ValueError, match=r"^hierarchical=True .*offload='optimizer'") as e:
        zf.ZeroPlan(
            zf.make_mesh(),
            stage=3,
            quantize_weights="fp8",
            hierarchical=True,
            hosts=2,
            offload="optimizer",
        )
    assert "\n" not in str(e.value)


# -- bytes on the wire: XLA:GPU programs compiled for abstract H100s --------------------------

ITEMSIZE = {"f8e4m3fn": 1, "bf16": 2, "f32": 4, "u8": 1}


def compiled_gathers(text, num_devices):
    """``[(element type, result bytes, replica groups)]`` of every all-gather in compiled HLO
    text, one row per gathered array (an async start's type is (operands, results): the
    second half are the results)."""
    rows = []
    for line in text.splitlines():
        m = re.search(r"= (.+?) all-gather(-start)?\(", line)
        if not m:
            continue
        shapes = re.findall(r"(\w+)\[([\d,]*)\]", m.group(1))
        if m.group(2):
            shapes = shapes[len(shapes) // 2 :]
        # Listed ({{0,1},...}) or, from jax 0.11, in iota form ([2,8]<=[16]): read by the
        # engine's HLO reader, whose group forms tests/test_zeropp.py checks by hand.
        listed = hlo.groups_of(line, num_devices)
        assert listed, f"replica groups not read: {line.strip()[:160]}"
        groups = [tuple(g) for g in listed]
        for dtype, dims in shapes:
            size = math.prod(int(d) for d in dims.split(",") if d)
            rows.append((dtype, ITEMSIZE[dtype] * size, groups))
    return rows


def _mlp_on_h100():
    def loss(p, b):
        h = jnp.tanh(b["x"] @ p["w1"])
        return jnp.mean((h @ p["w2"]).astype(jnp.float32) ** 2)

    params = jax.eval_shape(lambda: {"w1": jnp.zeros((256, 512)), "w2": jnp.zeros((512, 256))})
    batch = {"x": jax.ShapeDtypeStruct((16, 256), jnp.bfloat16)}
    return loss, params, batch


def _compiled_rows(data, hosts=1, trainable=None, **options):
    from helpers import require_cuda_plugin

    require_cuda_plugin()
    loss, params, batch = _mlp_on_h100()
    plan = zf.ZeroPlan(zf.target_mesh("h100", data=data, hosts=hosts), stage=3, **options)
    compiled, _ = zf.memory.compile_step(
        loss, params, batch, optax.sgd(0.1), plan, zf.Precision(params="bf16"), trainable=trainable
    )
    return compiled_gathers(compiled.as_text(), data * hosts)


def _bytes(rows, dtype):
    return sum(b for t, b, _ in rows if t == dtype)


@pytest.mark.parametrize("frozen", [False, True], ids=["trained", "frozen-w1"])
def test_e4m3_gathers_move_half_the_bytes_of_bf16_on_h100(frozen):
    """8 H100s, bf16 weights: the e4m3 weight gathers' bytes are exactly half of plain stage
    3's bf16 gathers; all else gathered is one scale per device. ``frozen-w1``: w1 frozen, as
    a LoRA base is (stored bf16, no master)."""
    trainable = {"w1": not frozen, "w2": True}
    plain = _compiled_rows(8, trainable=trainable)
    fp8 = _compiled_rows(8, trainable=trainable, quantize_weights="fp8")
    assert plain and {t for t, _, _ in plain} == {"bf16"}
    weights = [b for t, b, _ in fp8 if t == "f8e4m3fn"]
    assert len(weights) == len(plain) and sum(weights) * 2 == _bytes(plain, "bf16")
    scales = [(t, b) for t, b, _ in fp8 if t != "f8e4m3fn"]
    assert len(scales) == len(plain) and all(b == 8 * ITEMSIZE[t] for t, b in scales)


def test_hpz_gathers_in_host_move_e4m3_and_its_refresh_across_hosts_bf16_on_h100():
    """2 hosts of 8 H100s: with hpZ every gather inside a host moves e4m3 (half of hpZ's bf16
    gathers there); the refresh of the secondary copy after the update crosses hosts in bf16,
    2 bytes per parameter over the host's 8 devices, as without FP8."""
    hpz = _compiled_rows(16, hosts=2, hierarchical=True)
    both = _compiled_rows(16, hosts=2, hierarchical=True, quantize_weights="fp8")

    def split(rows):
        inside = [r for r in rows if all(max(g) // 8 == min(g) // 8 for g in r[2])]
        across = [r for r in rows if all(len({d // 8 for d in g}) == 2 for g in r[2])]
        assert len(inside) + len(across) == len(rows)
        return inside, across

    (hpz_in, hpz_across), (in_host, across) = split(hpz), split(both)
    params = 2 * 256 * 512
    assert {t for t, _, _ in hpz_in} == {"bf16"}
    assert _bytes(in_host, "f8e4m3fn") * 2 == _bytes(hpz_in, "bf16")
    assert all(b == 8 * ITEMSIZE[t] for t, b, _ in in_host if t != "f8e4m3fn")
    assert {t for t, _, _ in across} == {"bf16"} and _bytes(across, "bf16") == 2 * params // 8
    assert _bytes(hpz_across, "bf16") == _bytes(across, "bf16")
