"""4-bit (NF4) and int8 frozen weights (zeroflow/engine/quantized, zf.quantize_frozen).

- bitsandbytes is the reference of the format: our packed words, block scales and dequantized
  values equal its own on random tensors of 7 to a million values, each library dequantizes the
  other's double-quantized state to the same bits, and the scales' 8-bit codes are the nearest ones;
  without bitsandbytes too, our round trip is the format's definition written out in numpy
  (tests/nf4_reference.py) and within NF4's error bound;
- int8 blocks follow their formula, and the stored bytes per weight follow theirs;
- a LoRA run on an NF4 base follows a hand-written reference (the dequantization written out
  plainly, the matmuls, the adapters, plain optax) step for step, at ZeRO stages 0, 2 and 3;
- the dequantized weights never exist for a whole layer stack at once;
- the trainer's model.lora.quantize trains the tiny model, and bad settings are one line.
"""
import functools
import math

import jax
import jax.numpy as jnp
import nf4_reference
import numpy as np
import optax
import pytest

import zeroflow as zf
from zeroflow.config.io import ConfigError, load_config
from zeroflow.engine import quantized
from zeroflow.engine.grads.dequantized import dequantized_on_use
from zeroflow.engine.quantized import codes, nf4

pytestmark = pytest.mark.fast

BNB_REASON = ("bitsandbytes (the reference) is in the test extra for Python 3.11 only: it needs "
              "torch, whose CPU wheel the package index has for 3.11 only")


@pytest.fixture(scope="module")
def bnb():
    pytest.importorskip("torch", reason=BNB_REASON)
    return pytest.importorskip("bitsandbytes.functional", reason=BNB_REASON)


def _tensor(shape, dtype_name, seed=0):
    """A weight-like tensor (std 0.02) as torch (in ``dtype_name``) and as a jax array of the
    same values; where it is long enough, its second block of 64 is all zeros."""
    import torch

    x = np.random.default_rng(seed).standard_normal(shape).astype(np.float32) * 0.02
    if x.size >= 128:
        x.reshape(-1)[64:128] = 0.0
    t = torch.from_numpy(x).to(getattr(torch, dtype_name))
    return t, jnp.asarray(t.float().numpy()).astype(dtype_name)


# (1000, 1000) holds 15,625 blocks of 64: 61 full groups of 256 block scales for the double
# quantization and a last group of 9, and enough scales that bitsandbytes' table misses the
# nearest code at some (28 in float32, 29 in bfloat16), where ours must be the nearer.
# (64, 4, 16) is a query kernel's layout [hidden, heads, head dim]: rows shorter than a block.
SHAPES = [((1000, 1000), "float32"), ((1000, 1000), "bfloat16"), ((33, 37), "float32"),
          ((5, 129), "bfloat16"), ((7,), "float32"), ((3, 64), "float32"),
          ((64, 4, 16), "float32")]


def _bnb_dequantized(bnb, q, state) -> np.ndarray:
    """bitsandbytes' dequantize_4bit of ``(q, state)``, flattened. Asked for the flat tensor:
    the format's blocks run over the flattened entries, and bitsandbytes 0.50's native CPU
    kernel (unlike its reference code, its CUDA kernel and its releases before) dequantizes a
    shape whose rows are shorter than a block with the wrong scales."""
    import copy

    flat = copy.copy(state)
    flat.shape = (math.prod(state.shape),)
    return bnb.dequantize_4bit(q, flat).float().numpy().reshape(-1)


def test_code_books_are_bitsandbytes_own(bnb):
    np.testing.assert_array_equal(codes.NF4, bnb.get_4bit_type("nf4", device="cpu").numpy())
    np.testing.assert_array_equal(codes.dynamic_map(), bnb.create_dynamic_map(True).numpy())


@pytest.mark.parametrize("shape,dtype", SHAPES)
def test_words_scales_and_values_equal_bitsandbytes(bnb, shape, dtype):
    """Single quantization (compress_statistics=False): everything is compared bit for bit."""
    t, x = _tensor(shape, dtype)
    q, state = bnb.quantize_4bit(t, blocksize=64, quant_type="nf4", compress_statistics=False)
    words, scales = jax.jit(nf4.quantize)(x.reshape(1, -1))
    np.testing.assert_array_equal(np.asarray(words[0]), q.numpy().reshape(-1))
    np.testing.assert_array_equal(np.asarray(scales[0]), state.absmax.numpy())
    ours = nf4.dequantize(words, scales, x.size, x.dtype)[0]
    theirs = _bnb_dequantized(bnb, q, state)
    np.testing.assert_array_equal(np.asarray(ours.astype(jnp.float32)), theirs)


def _bnb_state(bnb, parts: quantized.Parts, shape, torch_dtype):
    """Our double-quantized arrays as bitsandbytes' QuantState."""
    import torch

    nested = bnb.QuantState(absmax=torch.from_numpy(np.array(parts.maxima)),
                            code=torch.from_numpy(codes.dynamic_map().copy()), blocksize=256,
                            dtype=torch.float32)
    return bnb.QuantState(absmax=torch.from_numpy(np.array(parts.scale_codes)),
                          shape=torch.Size(shape), dtype=torch_dtype, blocksize=64,
                          code=torch.from_numpy(codes.NF4.copy()), quant_type="nf4",
                          offset=torch.tensor(float(parts.offset)), state2=nested)


@pytest.mark.parametrize("shape,dtype", SHAPES)
def test_double_quantization_is_bitsandbytes_format(bnb, shape, dtype):
    import torch

    t, x = _tensor(shape, dtype, seed=1)
    q_bnb, s_bnb = bnb.quantize_4bit(t, blocksize=64, quant_type="nf4", compress_statistics=True)
    q = jax.jit(lambda v: quantized.quantize(v, "nf4"))(x)  # one matrix (or vector): no stack
    parts = quantized.unpack(q)
    np.testing.assert_array_equal(np.asarray(parts.codes), q_bnb.numpy().reshape(-1))
    # The offset is a mean: each library sums in its own order.
    np.testing.assert_allclose(float(parts.offset), s_bnb.offset.item(), rtol=1e-6)

    # Each dequantizes the other's state to the same bits.
    theirs_of_ours = _bnb_dequantized(
        bnb, torch.from_numpy(np.array(parts.codes).reshape(-1, 1)),
        _bnb_state(bnb, parts, t.shape, t.dtype))
    np.testing.assert_array_equal(
        np.asarray(quantized.dequantize(q).astype(jnp.float32)).reshape(-1), theirs_of_ours)
    from_bnb = quantized.pack(quantized.Parts(
        jnp.asarray(q_bnb.numpy().reshape(-1)), jnp.asarray(s_bnb.absmax.numpy()),
        jnp.asarray(s_bnb.state2.absmax.numpy()), jnp.asarray(s_bnb.offset.item(), jnp.float32)),
        shape, dtype, "nf4")
    np.testing.assert_array_equal(
        np.asarray(quantized.dequantize(from_bnb).astype(jnp.float32)).reshape(-1),
        _bnb_dequantized(bnb, q_bnb, s_bnb))

    # The scales' codes, given bitsandbytes' offset: the same block maxima, and each code the
    # nearest value of the map, which bitsandbytes' CPU build (a 65,536-bin table) misses at
    # a few; where the two differ, ours is never the farther.
    _, scales = jax.jit(nf4.quantize)(x.reshape(1, -1))
    centred = np.asarray(scales[0]) - np.float32(s_bnb.offset.item())
    ours, maxima = nf4.code_blockwise(jnp.asarray(centred)[None])
    np.testing.assert_array_equal(np.asarray(maxima[0]), s_bnb.state2.absmax.numpy())
    table = codes.dynamic_map().astype(np.float64)
    block_max = np.repeat(s_bnb.state2.absmax.numpy().astype(np.float64), 256)[: centred.size]
    # Normalized as the format does it, in float32 by the reciprocal (a value on a midpoint
    # then takes the lower code, where argmin's first minimum lands too).
    inverse = np.divide(1, block_max.astype(np.float32), out=np.zeros(centred.size, np.float32),
                        where=block_max > 0)
    normed = (centred * inverse).astype(np.float64)
    nearest = np.argmin(np.abs(normed[:, None] - table[None, :]), axis=1)
    ours = np.asarray(ours[0])
    np.testing.assert_array_equal(ours[block_max > 0], nearest[block_max > 0])
    theirs = s_bnb.absmax.numpy()
    differ = (ours != theirs) & (block_max > 0)
    assert np.all(np.abs(table[ours] - normed)[differ] <= np.abs(table[theirs] - normed)[differ])
    assert differ.mean() < 0.01


@pytest.mark.parametrize("shape,dtype", SHAPES)
def test_round_trip_is_the_formats_definition_within_its_bound(shape, dtype):
    """Without bitsandbytes: our NF4 round trip (double quantized) is the format's, written out
    in numpy, and moves no entry by more than NF4's error bound."""
    x = np.random.default_rng(4).standard_normal(shape).astype(np.float32) * 0.02
    if x.size >= 128:
        x.reshape(-1)[64:128] = 0.0  # an all-zero block
    x = np.asarray(jnp.asarray(x).astype(dtype).astype(jnp.float32))
    ours = np.asarray(jax.jit(lambda v: quantized.dequantize(quantized.quantize(v, "nf4"),
                                                             jnp.float32))(jnp.asarray(x, dtype)))
    want = nf4_reference.round_trip(x)
    # The map's float32 values (ours, bitsandbytes') and its float64 definition (the
    # reference's) differ in the last bit at some entries; the offset (a mean) may too, with
    # the order of its sum, and move a scale to the neighbouring code at one block in 10,000.
    close = np.abs(ours - want) <= 1e-6 * np.abs(x).max()
    assert close.mean() > 0.999, close.mean()
    assert np.all(np.abs(ours - x) <= nf4_reference.error_bound(x))


def test_a_stack_is_quantized_tensor_by_tensor(bnb):
    """With a stack axis each layer's tensor is its own bitsandbytes tensor."""
    t, x = _tensor((3, 40, 64), "bfloat16", seed=2)
    parts = quantized.unpack(quantized.quantize(x, "nf4", stack_axes=1))
    for i in range(3):
        q_bnb, s_bnb = bnb.quantize_4bit(t[i], blocksize=64, quant_type="nf4",
                                         compress_statistics=True)
        np.testing.assert_array_equal(np.asarray(parts.codes[i]), q_bnb.numpy().reshape(-1))
        np.testing.assert_allclose(float(parts.offset[i]), s_bnb.offset.item(), rtol=1e-6)


def test_int8_blocks_follow_their_formula():
    x = jax.random.normal(jax.random.key(3), (2, 33, 70), jnp.float32)
    q = quantized.quantize(x, "int8", stack_axes=1)
    parts = quantized.unpack(q)
    for i in range(2):
        flat = np.asarray(x[i]).reshape(-1)
        blocks = np.pad(flat, (0, 64 * math.ceil(flat.size / 64) - flat.size)).reshape(-1, 64)
        scale = np.abs(blocks).max(axis=1) / np.float32(127)
        values = np.clip(np.round(blocks / scale[:, None]), -127, 127).astype(np.int8)
        np.testing.assert_array_equal(np.asarray(parts.codes[i]), values)
        # XLA divides by the constant 127 as a product with its reciprocal: one ulp apart.
        np.testing.assert_allclose(np.asarray(parts.scale_codes[i]), scale, rtol=2e-7)
        ours = np.asarray(parts.scale_codes[i])
        expected = (values.astype(np.float32) * ours[:, None]).reshape(-1)[: flat.size]
        np.testing.assert_array_equal(np.asarray(quantized.dequantize(q)[i]).reshape(-1), expected)
        assert np.abs(expected - flat).max() <= np.abs(flat).max() / 254 * 1.0001
    assert quantized.dequantize(q, jnp.bfloat16).dtype == jnp.bfloat16


def _formula_bytes(n: int, kind: str) -> int:
    """NF4: half a byte per weight, a uint8 code per 64, an fp32 maximum per 256 codes and an
    fp32 offset per matrix; int8: a byte per weight (padded to 64) and an fp32 scale per 64;
    each tensor's bytes padded to a multiple of 512."""
    blocks = math.ceil(n / 64)
    if kind == "int8":
        raw = 64 * blocks + 4 * blocks
    else:
        raw = math.ceil(n / 2) + blocks + 4 * math.ceil(blocks / 256) + 4
    return -(-raw // 512) * 512


@pytest.mark.parametrize("kind", ["nf4", "int8"])
@pytest.mark.parametrize("shape", [(4096, 4096), (4, 1024, 2752), (33, 37)])
def test_stored_bytes_follow_the_formula(kind, shape):
    q = quantized.quantize_shape(jax.ShapeDtypeStruct(shape, jnp.bfloat16), kind,
                                 stack_axes=len(shape) - 2)
    matrices = math.prod(shape[:-2])
    assert q.nbytes == matrices * _formula_bytes(shape[-2] * shape[-1], kind)
    if shape == (4096, 4096):
        per_weight = q.nbytes / math.prod(shape)
        assert per_weight == pytest.approx(0.516, abs=0.001) if kind == "nf4" else 1.0625


# --- training on a quantized base ------------------------------------------------------------

LAYERS, WIDTH, OUT, RANK, ALPHA = 3, 64, 16, 4, 8.0


def _model_loss(params, batch):
    """A scanned stack of tanh layers, a head and a frozen vector (never quantized)."""
    h, _ = jax.lax.scan(lambda h, w: (jnp.tanh(h @ w), None), batch["x"], params["layers"])
    out = (h * params["gain"]) @ params["head"]
    return jnp.mean((out - batch["y"]) ** 2)


def _base():
    k = jax.random.split(jax.random.key(0), 2)
    return {"layers": jax.random.normal(k[0], (LAYERS, WIDTH, WIDTH)) * 0.2,
            "head": jax.random.normal(k[1], (WIDTH, OUT)) * 0.2,
            "gain": jnp.linspace(0.5, 1.5, WIDTH)}


def _batches():
    rng = np.random.default_rng(0)
    return [{"x": rng.normal(size=(16, WIDTH)).astype(np.float32),
             "y": rng.normal(size=(16, OUT)).astype(np.float32)} for _ in range(4)]


def _plain_dequantize(q) -> np.ndarray:
    """bitsandbytes' dequantize_4bit written out, one matrix at a time: a scale is its code's
    value in the dynamic map times its block's maximum plus the offset; an entry is its
    nibble's NF4 value (high nibble first) times its block's scale."""
    stack, shape = q.stack_shape, q.shape
    n = shape[0] * shape[1]
    parts = quantized.unpack(q)  # the byte layout; its values are checked against bitsandbytes
    words = np.asarray(parts.codes).reshape(-1, parts.codes.shape[-1])
    scale_codes = np.asarray(parts.scale_codes).reshape(len(words), -1)
    maxima = np.asarray(parts.maxima).reshape(len(words), -1)
    offsets = np.asarray(parts.offset).reshape(len(words))
    out = []
    for w, c, m, off in zip(words, scale_codes, maxima, offsets):
        scale = codes.dynamic_map()[c] * np.repeat(m, 256)[: c.size] + off
        nibbles = np.stack([w >> 4, w & 15], axis=1).reshape(-1)[:n]
        out.append(codes.NF4[nibbles] * np.repeat(scale, 64)[:n])
    return np.stack(out).reshape(*stack, *shape)


def _reference_run(base_q, adapters, batches, tx):
    """Hand-written: the adapted model on the plainly dequantized base, plain optax."""
    layers = jnp.asarray(_plain_dequantize(base_q["layers"]))
    head = jnp.asarray(_plain_dequantize(base_q["head"]))
    gain, s = base_q["gain"], ALPHA / RANK

    def loss(ad, batch):
        h = batch["x"]
        for i in range(LAYERS):
            a, b = ad["layers"]["a"][i, :, 0, :], ad["layers"]["b"][i, 0, :, :]
            h = jnp.tanh(h @ layers[i] + s * (h @ a) @ b.T)
        h = h * gain
        a, b = ad["head"]["a"][:, 0, :], ad["head"]["b"][0]
        out = h @ head + s * (h @ a) @ b.T
        return jnp.mean((out - batch["y"]) ** 2)

    opt, losses = tx.init(adapters), []
    value_and_grad = jax.jit(jax.value_and_grad(loss))  # one program, not op by op
    for batch in batches:
        value, grads = value_and_grad(adapters, batch)
        updates, opt = tx.update(grads, opt, adapters)
        adapters = optax.apply_updates(adapters, updates)
        losses.append(float(value))
    return losses, adapters


def _lora_on_nf4():
    """The LoRA on an NF4 base of the stage tests: the adapted loss, its parameters (base
    quantized, adapters trainable) and the adapters."""
    lo = zf.lora(_model_loss, rank=RANK, alpha=ALPHA, targets="layers|head")
    adapters = lo.init(jax.random.key(1), _base(), _batches()[0])
    # b starts at zero: perturb it so that the first step already reads the adapters.
    adapters = jax.tree_util.tree_map_with_path(
        lambda p, x: x + 0.05 if p[-1].key == "b" else x, adapters)
    params, trainable = zf.quantize_frozen({"base": _base(), "lora": adapters},
                                           lambda path, _: path.startswith("lora/"), kind="nf4",
                                           stacked="base/layers")
    return lo, params, trainable, adapters


@functools.cache
def _lora_reference():
    """``_reference_run`` of ``_lora_on_nf4()`` with adam(1e-2): the same for every stage, so
    run once for all of them."""
    _, params, _, adapters = _lora_on_nf4()
    return _reference_run(params["base"], adapters, _batches(), optax.adam(1e-2))


@pytest.mark.parametrize("stage,devices", [(0, 1), (2, 8), (3, 8)])
def test_lora_on_an_nf4_base_follows_a_hand_written_reference(stage, devices):
    lo, params, trainable, _ = _lora_on_nf4()
    batches = _batches()
    assert isinstance(params["base"]["layers"], zf.QuantizedArray)
    assert not isinstance(params["base"]["gain"], zf.QuantizedArray)  # a vector stays whole
    tx = optax.adam(1e-2)
    want_losses, want = _lora_reference()

    mesh = zf.make_mesh(data=devices, devices=jax.devices()[:devices])
    plan = zf.ZeroPlan(mesh, stage=stage)
    prec = zf.Precision(params="fp32", master="fp32", loss_scale="none")
    state = zf.init_train_state(params, tx, plan, prec, trainable=trainable)
    stored = state.frozen["base"]["layers"].data
    row = _formula_bytes(WIDTH**2, "nf4")
    assert stored.dtype == jnp.uint8 and stored.shape == (LAYERS, 1, row)
    if stage == 3:  # each device keeps its shard of the 4-bit words and scales
        assert stored.addressable_shards[0].data.shape == (LAYERS, 1, row // 8)
    step = zf.make_train_step(lo.loss, tx, plan, prec)
    losses = []
    for batch in batches:
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
    np.testing.assert_allclose(losses, want_losses, rtol=2e-6)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=2e-6),
                 state.params["lora"], want)
    # The base comes out as it went in, bit for bit.
    jax.tree.map(np.testing.assert_array_equal, state.params["base"], params["base"])


# Stage 3 variants that each device's 4-bit shard goes through: hpZ keeps one copy per host
# (two emulated hosts of four devices) and gathers within the host; qwZ gathers the trained
# weights in int8 blocks but the packed bytes as they are, here with the base kept in host
# memory (offload). Plain stage 3 is checked against the hand-written reference above.
STAGE_3_VARIANTS = {
    "hpZ": dict(stage=3, hierarchical=True, hosts=2),
    "qwZ, offload": dict(stage=3, quantize_weights="int8", offload="optimizer+params"),
}


def test_bf16_steps_at_stage_3_follow_stage_0(tmp_path):
    """bf16 compute (the base dequantized to bf16): ZeRO-3's hpZ on 8 devices, the bytes
    gathered within each host, gives stage 0's losses on one device, and qwZ with the base in
    host memory the same within the error of its int8 gathers of the adapters (the base's
    bytes quantized again would be far off). An hpZ checkpoint restores the base bit for bit."""
    lo = zf.lora(_model_loss, rank=RANK, alpha=ALPHA, targets="layers|head")
    batches = _batches()
    adapters = lo.init(jax.random.key(1), _base(), batches[0])
    params, trainable = zf.quantize_frozen({"base": _base(), "lora": adapters},
                                           lambda path, _: path.startswith("lora/"),
                                           stacked="base/layers")
    prec = zf.Precision(params="bf16", master="fp32", loss_scale="none")
    tx = optax.adam(1e-2)
    row = _formula_bytes(WIDTH**2, "nf4")
    losses, states = {}, {}
    for name, kw in {"stage 0": dict(stage=0), **STAGE_3_VARIANTS}.items():
        devices = 1 if kw["stage"] == 0 else 8
        plan = zf.ZeroPlan(zf.make_mesh(data=devices, devices=jax.devices()[:devices]), **kw)
        state = zf.init_train_state(params, tx, plan, prec, trainable=trainable)
        stored = state.frozen["base"]["layers"].data
        if name == "hpZ":  # a whole copy per host, 1/4 of it on each of its 4 devices
            assert stored.addressable_shards[0].data.shape == (LAYERS, 1, row // 4)
        if name == "qwZ, offload":
            assert stored.sharding.memory_kind == "pinned_host"
        step = zf.make_train_step(lo.loss, tx, plan, prec)
        out = []
        for batch in batches:
            state, metrics = step(state, batch)
            out.append(float(metrics["loss"]))
        losses[name], states[name] = out, (state, step)
    np.testing.assert_allclose(losses["hpZ"], losses["stage 0"], rtol=2e-5)
    np.testing.assert_allclose(losses["qwZ, offload"], losses["stage 0"], rtol=3e-3)
    state, step = states["hpZ"]
    zf.save_checkpoint(tmp_path / "hpz", state)
    restored = zf.restore_checkpoint(tmp_path / "hpz", state)
    jax.tree.map(np.testing.assert_array_equal, restored.frozen, state.frozen)
    for name in ("layers", "head"):  # the 4-bit words and scales as quantize_frozen made them
        np.testing.assert_array_equal(restored.params["base"][name].data,
                                      params["base"][name].data)


def _layerwise_loss(params, batch, gather_layer):
    """``_model_loss`` with each layer fetched by the step's ``gather_layer``."""
    step = lambda h, w: (jnp.tanh(h @ gather_layer(w)), None)  # noqa: E731
    h, _ = jax.lax.scan(step, batch["x"], params["layers"])
    out = (h * params["gain"]) @ params["head"]
    return jnp.mean((out - batch["y"]) ** 2)


def test_gather_per_layer_streams_and_dequantizes_each_layer():
    """gather_per_layer with an NF4 stack kept in host memory at stage 3: each layer's bytes
    are copied in, gathered and dequantized when it runs; the trained gain follows plain
    optax on the plainly dequantized weights."""
    params, trainable = zf.quantize_frozen(_base(), lambda path, _: path == "gain",
                                           stacked="layers")
    tx = optax.sgd(0.1)
    layers = jnp.asarray(_plain_dequantize(params["layers"]))
    head = jnp.asarray(_plain_dequantize(params["head"]))
    gain, opt, want = params["gain"], tx.init(params["gain"]), []
    for batch in _batches():
        value, g = jax.value_and_grad(
            lambda gn: _model_loss({"layers": layers, "head": head, "gain": gn}, batch))(gain)
        updates, opt = tx.update(g, opt, gain)
        gain = optax.apply_updates(gain, updates)
        want.append(float(value))
    plan = zf.ZeroPlan(zf.make_mesh(data=8), stage=3, offload="optimizer+params")
    prec = zf.Precision(params="fp32", master="fp32", loss_scale="none")
    state = zf.init_train_state(params, tx, plan, prec, trainable=trainable)
    step = zf.make_train_step(_layerwise_loss, tx, plan, prec, gather_per_layer="layers")
    got = []
    for batch in _batches():
        state, metrics = step(state, batch)
        got.append(float(metrics["loss"]))
    np.testing.assert_allclose(got, want, rtol=2e-6)
    np.testing.assert_allclose(state.params["gain"], gain, atol=2e-6)


def _avals(jaxpr):
    """Every value a jaxpr computes, nested jaxprs (scan bodies, custom rules) included."""
    for eqn in jaxpr.eqns:
        yield from (v.aval for v in eqn.outvars)
        for param in eqn.params.values():
            for sub in param if isinstance(param, (list, tuple)) else [param]:
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    yield from _avals(inner)


@pytest.mark.parametrize("stage,devices", [(0, 1), (3, 8)])
def test_the_dequantized_stack_never_exists_whole(stage, devices):
    """Dequantized on use: one layer's matrix at a time inside the scan, forward and backward,
    in the train step and in a loss called outside it; the whole dequantized stack
    [layers, width, width] is never computed."""
    params, trainable = zf.quantize_frozen(_base(), lambda path, _: path == "gain",
                                           stacked="layers")
    mesh = zf.make_mesh(data=devices, devices=jax.devices()[:devices])
    plan = zf.ZeroPlan(mesh, stage=stage)
    prec = zf.Precision(params="fp32", master="fp32", loss_scale="none")
    tx = optax.sgd(0.1)
    state = zf.init_train_state(params, tx, plan, prec, trainable=trainable)
    step = zf.make_train_step(_model_loss, tx, plan, prec)
    outside = dequantized_on_use(_model_loss, jnp.float32)
    for jaxpr in [step.trace(state, _batches()[0]).jaxpr,
                  jax.make_jaxpr(jax.grad(lambda g, b: outside({**params, "gain": g}, b)))(
                      jnp.ones(WIDTH), _batches()[0])]:
        floats = [a.shape for a in _avals(jaxpr.jaxpr) if jnp.issubdtype(a.dtype, jnp.floating)]
        assert (WIDTH, WIDTH) in floats  # one layer's matrix, dequantized in the scan
        assert (LAYERS, WIDTH, WIDTH) not in floats
    # ... and the loss outside the step is the loss of the dequantized weights.
    whole = quantized.dequantized(params)
    np.testing.assert_allclose(outside(params, _batches()[0]), _model_loss(whole, _batches()[0]),
                               rtol=1e-6)


# --- the trainer ---------------------------------------------------------------------------

def test_trainer_quantizes_the_frozen_base_and_trains(tmp_path):
    from zeroflow.trainer import adapters, build_run, train
    from zeroflow.trainer.checkpoints import RunCheckpoints
    from zeroflow.trainer.setup import lm_loss_fn

    # The tiny model itself (4 layers, width 128) at a shorter sequence: a LoRA on its random
    # base learns within a few steps, which the width-32 test model does not show over noise.
    cfg = load_config("configs/tiny.yaml", [
        "model.seq_len=64", "train.batch_size=8", "data.max_bytes=400000", "train.steps=6",
        "train.warmup_steps=0", "train.lr=1e-2", "train.eval_every=0", "train.eval_batches=1",
        "train.log_every=1", "checkpoint.every=6", "run.progress=false", "model.lora.rank=4",
        "model.lora.quantize=nf4", f"run.dir={tmp_path}"])
    result = train(cfg)
    losses = [result.losses[s] for s in sorted(result.losses)]
    assert len(losses) == 6 and all(np.isfinite(losses))
    assert np.mean(losses[-3:]) < losses[0] - 0.2
    assert np.isfinite(result.eval["eval_loss"])
    run = build_run(cfg, with_data=False)
    checkpoints = RunCheckpoints(tmp_path / "checkpoints", 3, read_only=True)
    state, _ = checkpoints.read(run.abstract_state(), 6)
    checkpoints.close()
    fresh = run.init_state()  # the base as the run quantized it at step 0
    kernel = state.params["base"]["layers"]["attn"]["query"]["kernel"]
    assert isinstance(kernel, zf.QuantizedArray) and kernel.data.dtype == jnp.uint8
    jax.tree.map(np.testing.assert_array_equal, state.params["base"], fresh.params["base"])
    # Sampling and the merged export read W + alpha / r a b with W dequantized: the run's loss.
    batch = {"tokens": np.random.default_rng(0).integers(0, 256, (8, 65), dtype=np.int32)}
    # Each jitted: op by op, the model's many small operations each compile for the sharded
    # state, which costs several times the two programs.
    merged_loss = jax.jit(lambda p, b: lm_loss_fn(run.model_cfg)(adapters.merged(run.lora, p),
                                                                 b)[0])(state.params, batch)
    run_loss = jax.jit(lambda p, b: run.loss_fn(p, b)[0])(state.params, batch)
    np.testing.assert_allclose(merged_loss, run_loss, rtol=1e-5)


@pytest.mark.parametrize("overrides,needle", [
    (["model.lora.rank=4", "model.lora.quantize=nf3"], "model.lora.quantize must be one of"),
    (["model.lora.quantize=nf4"], "needs model.lora.rank > 0"),
])
def test_bad_quantize_settings_are_one_line(overrides, needle):
    with pytest.raises(ConfigError, match=needle):
        load_config("configs/tiny.yaml", overrides)


def test_the_config_choices_are_the_engines():
    from zeroflow.config.schema import LoraConfig, choices_of

    assert choices_of(LoraConfig) == {"quantize": ("none", *quantized.KINDS)}


def test_bad_arguments_are_one_line():
    base = _base()
    with pytest.raises(ValueError, match="kind='nf3'; expected one of nf4, int8"):
        zf.quantize_frozen(base, lambda p, _: p == "gain", kind="nf3")
    with pytest.raises(ValueError, match="freezes no parameter"):
        zf.quantize_frozen(base, None)
    params, _ = zf.quantize_frozen(base, lambda p, _: p == "gain")
    plan = zf.ZeroPlan(zf.make_mesh(data=1, devices=jax.devices()[:1]), stage=0)
    prec = zf.Precision(params="fp32", master="fp32", loss_scale="none")
    with pytest.raises(ValueError, match="quantized weights are frozen, but trainable marks layers"):
        zf.init_train_state(params, optax.adam(1e-3), plan, prec,
                            trainable=lambda p, _: p.startswith(("gain", "layers")))
