"""ZeRO++ pieces: blockwise int8 quantization against a numpy reference, cross-host bytes of
collectives, and stage 3 with quantized weight gathers trained against plain stage 3."""
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from zeroflow.engine import zeropp

pytestmark = pytest.mark.fast


def numpy_quantize(x, block_size):
    """The reference: absmax per block of the flattened array, scale = absmax / 127, codes
    rounded half to even and clipped to [-127, 127]."""
    flat = np.asarray(x, np.float32).reshape(-1)
    blocks = max(1, math.ceil(flat.size / block_size))
    padded = np.zeros(blocks * block_size, np.float32)
    padded[:flat.size] = flat
    padded = padded.reshape(blocks, block_size)
    absmax = np.abs(padded).max(axis=1)
    scales = (absmax / np.float32(127)).astype(np.float32)
    safe = np.where(scales > 0, scales, np.float32(1))
    codes = np.clip(np.round(padded / safe[:, None]), -127, 127).astype(np.int8)
    return codes, scales, absmax


def away_from_ties(x, block_size):
    """``x`` with every entry whose ``x / scale`` lies within 1e-3 of a rounding boundary
    (k + 1/2) moved off it (scaled by 0.99; a block's largest entry never is). At a boundary
    the code depends on the last bit of the fp32 scale, which XLA may compute as
    ``absmax * (1/127)``; everywhere else the reference fixes every code."""
    x = np.array(x, np.float32)
    flat = x.reshape(-1)
    _, scales, _ = numpy_quantize(x, block_size)
    step = np.repeat(scales, block_size)[:flat.size]
    ratio = np.abs(flat) / np.where(step > 0, step, 1)
    near = np.abs(ratio - np.floor(ratio) - 0.5) < 1e-3
    flat[near] *= np.float32(0.99)
    return x


@pytest.mark.parametrize("shape, block", [((37, 5), 16), ((64,), 64), ((3, 4, 10), 7), ((5,), 256)])
def test_quantize_matches_numpy_and_round_trips_within_half_a_step(shape, block):
    x = np.random.default_rng(0).normal(size=shape).astype(np.float32) * np.float32(3)
    x = away_from_ties(x, block)
    zero_block = x.size > block  # then the first block is all zeros: scale 0, codes 0
    if zero_block:
        x.reshape(-1)[:block] = 0.0
    q = zeropp.quantize(jnp.asarray(x), block)
    codes, scales, absmax = numpy_quantize(x, block)
    assert q.values.dtype == jnp.int8 and q.scales.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(q.values), codes)
    np.testing.assert_array_equal(np.asarray(q.scales), scales)
    back = np.asarray(zeropp.dequantize(q, shape))
    assert back.shape == shape
    err = np.zeros(codes.size, np.float32)
    err[:x.size] = np.abs(back - x).reshape(-1)
    bound = absmax / 254 * (1 + 1e-6) + 1e-30
    assert (err.reshape(codes.shape) <= bound[:, None]).all()
    if zero_block:
        np.testing.assert_array_equal(back.reshape(-1)[:block], 0.0)


def test_dequantize_keeps_leading_axes_and_casts():
    x = np.random.default_rng(1).normal(size=(4, 6, 3)).astype(np.float32)
    stacked = [zeropp.quantize(jnp.asarray(x[i]), 5) for i in range(4)]
    q = zeropp.Quantized(jnp.stack([s.values for s in stacked]), jnp.stack([s.scales for s in stacked]))
    back = zeropp.dequantize(q, (6, 3), jnp.bfloat16)
    assert back.shape == (4, 6, 3) and back.dtype == jnp.bfloat16
    for i in range(4):
        np.testing.assert_allclose(np.asarray(back[i], np.float32),
                                   np.asarray(zeropp.dequantize(stacked[i], (6, 3))), rtol=1e-2)


def test_transit_bytes_counts_padding_and_scales():
    assert zeropp.transit_bytes((37, 5), 16) == 12 * 16 + 4 * 12
    codes, _, _ = numpy_quantize(np.ones((37, 5)), 16)
    q = zeropp.quantize(jnp.ones((37, 5)), 16)
    assert zeropp.transit_bytes((37, 5), 16) == q.values.nbytes + q.scales.nbytes == codes.nbytes + 4 * len(codes)


# --- bytes inside and across hosts, read from XLA:GPU programs for two hosts of eight H100s ---

def _target(**kw):
    from helpers import require_cuda_plugin
    require_cuda_plugin()
    import zeroflow as zf
    return zf.target_mesh("h100", **kw)


def test_target_devices_are_numbered_host_major():
    """What the cross-host counts rest on: a compiled program's logical device ids index
    ``mesh.devices.flat``, and on the 1x2x8 target ids 0-7 are host 0 and 8-15 host 1."""
    from zeroflow.engine.hosts import hosts_of
    mesh = _target(data=16, hosts=2)
    assert [d.id for d in mesh.devices.flat] == list(range(16))
    assert hosts_of(mesh) == (0,) * 8 + (1,) * 8
    # emulated hosts: the data axis cut into (hosts, local)
    emulated = jax.make_mesh((8, 1), ("data", "model"))
    assert hosts_of(emulated, hosts=2) == (0,) * 4 + (1,) * 4
    with pytest.raises(ValueError, match="hosts must be a positive int dividing data=8"):
        hosts_of(emulated, hosts=3)


def test_collectives_split_bytes_by_host_for_each_group_form():
    """Hand-counted bytes of three collectives on data=8 x model=2 over two hosts (device
    ``2 * data + model``, host 0 holds data rows 0-3): a gather over ``data`` (groups of 8, 4
    per host), a sum over ``model`` (pairs inside a host), a shift along ``data`` (3 -> 4 and
    7 -> 0 cross)."""
    import zeroflow as zf
    from jax.sharding import NamedSharding, PartitionSpec as P
    mesh = _target(data=8, model=2, hosts=2)

    def f(x, y):
        return (jax.lax.all_gather(x, "data", tiled=True), jax.lax.psum(y, "model"),
                jax.lax.ppermute(x, "data", [(i, (i + 1) % 8) for i in range(8)]))
    fn = jax.jit(jax.shard_map(f, mesh=mesh, in_specs=(P("data"), P("model")),
                               out_specs=(P(), P(), P("data")), check_vma=False))
    x = jax.ShapeDtypeStruct((32, 64), jnp.float32, sharding=NamedSharding(mesh, P("data")))
    y = jax.ShapeDtypeStruct((16, 16), jnp.float32, sharding=NamedSharding(mesh, P("model")))
    colls = {c.kind: c for c in zf.memory.collectives(fn.lower(x, y).compile())}
    shard = 4 * 64 * 4  # one device's rows of x
    assert (colls["all-gather"].within_host, colls["all-gather"].cross_host) == (3 * shard, 4 * shard)
    half_y = 8 * 16 * 4
    assert (colls["all-reduce"].within_host, colls["all-reduce"].cross_host) == (half_y, 0)
    assert (colls["collective-permute"].within_host,
            colls["collective-permute"].cross_host) == (shard, shard)


def _stage3_on_two_hosts(**plan_options):
    import optax

    import zeroflow as zf
    mesh = _target(data=16, hosts=2)
    params = jax.eval_shape(lambda: {"w": jnp.zeros((256, 256)), "v": jnp.zeros((256, 64))})
    batch = {"x": jax.ShapeDtypeStruct((16, 256), jnp.float32)}

    def loss(p, b):
        return jnp.mean(((b["x"].astype(p["w"].dtype) @ p["w"]) @ p["v"]).astype(jnp.float32) ** 2)
    plan = zf.ZeroPlan(mesh, stage=3, **plan_options)
    compiled, _ = zf.memory.compile_step(loss, params, batch, optax.sgd(0.1), plan,
                                         zf.Precision(params="bf16"))
    return zf.memory.collectives(compiled)


W, V = 256 * 256, 256 * 64  # elements of the two weights


def test_stage3_traffic_across_two_hosts_is_the_zero_count():
    """Plain stage 3 on 2 x 8: bf16 weights gathered forward, ``v`` again for the backward
    pass (``w`` meets only the batch, whose gradient nobody needs, so XLA drops its second
    gather), every fp32 gradient reduce-scattered once; a device gets 8/16 of each from the
    other host and 7/16 from its own host's other devices."""
    import zeroflow as zf
    moved = zf.memory.traffic(_stage3_on_two_hosts())
    gathered = 2 * (W + 2 * V)
    assert moved["all-gather"]["cross_host"] == gathered * 8 // 16
    assert moved["all-gather"]["within_host"] == gathered * 7 // 16
    assert moved["reduce-scatter"]["cross_host"] == 4 * (W + V) * 8 // 16


# --- qwZ: stage 3 with weights gathered as int8, on 8 emulated CPU devices ------------------

def _mlp_params(block=None):
    """Two matrices; with ``block``, each row-shard of 8 devices kept off rounding ties."""
    k1, k2 = jax.random.split(jax.random.key(0))
    p = {"w1": jax.random.normal(k1, (64, 48)) * 0.3, "w2": jax.random.normal(k2, (48, 8)) * 0.3}
    if block is None:
        return p
    return {k: jnp.asarray(np.concatenate([away_from_ties(s, block) for s in np.split(
        np.asarray(v), 8, axis=0)])) for k, v in p.items()}


def _mlp_loss(p, b):
    h = jnp.tanh(b["x"].astype(p["w1"].dtype) @ p["w1"])
    return jnp.mean(((h @ p["w2"]).astype(jnp.float32) - b["y"]) ** 2)


def _mlp_batches(steps):
    rng = np.random.default_rng(0)
    return [{"x": jnp.asarray(rng.normal(size=(16, 64)), jnp.float32),
             "y": jnp.asarray(rng.normal(size=(16, 8)), jnp.float32)} for _ in range(steps)]


def _reference_dequantized(w, devices, block):
    """What the devices compute with: each row-shard of ``w`` quantized by the numpy reference
    and dequantized (the ZeRO dimension of these matrices is their rows)."""
    out = []
    for shard in np.split(np.asarray(w, np.float32), devices, axis=0):
        codes, scales, _ = numpy_quantize(shard, block)
        out.append((codes.astype(np.float32) * scales[:, None]).reshape(-1)[:shard.size]
                   .reshape(shard.shape))
    return np.concatenate(out, axis=0)


@pytest.mark.parametrize("block", [16, 100])
def test_qwz_gradient_is_plain_gradient_at_the_dequantized_weights(block):
    """One SGD step at stage 3 with int8 gathers: the new master is the exact master minus
    lr x the gradient that jax.grad gives at the weights the devices gathered (each shard
    through the numpy quantizer): the gradient travels unquantized, the master is untouched
    by the quantizer. Plain stage 3 lands elsewhere (the quantization is really applied)."""
    import optax

    import zeroflow as zf
    params, batch, lr = _mlp_params(block), _mlp_batches(1)[0], 0.5
    seen = {k: _reference_dequantized(v, 8, block) for k, v in params.items()}
    grads = jax.grad(_mlp_loss)(jax.tree.map(jnp.asarray, seen), batch)
    want = jax.tree.map(lambda p, g: np.asarray(p) - lr * np.asarray(g), params, grads)

    def one_step(**options):
        plan, prec, tx = zf.ZeroPlan(zf.make_mesh(), stage=3, **options), zf.Precision(), optax.sgd(lr)
        state = zf.init_train_state(params, tx, plan, prec)
        state, _ = zf.make_train_step(_mlp_loss, tx, plan, prec)(state, batch)
        return jax.tree.map(np.asarray, state.master_params)

    got = one_step(quantize_weights="int8", quantize_block=block)
    plain = one_step()
    for k in params:
        np.testing.assert_allclose(got[k], want[k], rtol=1e-5, atol=1e-6)
        assert np.abs(plain[k] - want[k]).max() > 1e-5


def test_qwz_trains_like_plain_stage3():
    """30 Adam steps in bf16, weights gathered as int8 blocks of 64: each gathered entry is off
    by at most absmax/254 of its block (0.4%), below bf16's own rounding of 2^-8 = 0.4% per
    entry, so the losses stay within 2% of plain stage 3's throughout."""
    import optax

    import zeroflow as zf
    from helpers import train_losses
    batches = _mlp_batches(30)

    def losses(**options):
        plan, prec, tx = (zf.ZeroPlan(zf.make_mesh(), stage=3, **options),
                          zf.Precision(params="bf16"), optax.adam(3e-3))
        state = zf.init_train_state(_mlp_params(), tx, plan, prec)
        return np.array(train_losses(zf.make_train_step(_mlp_loss, tx, plan, prec), state,
                                     batches)[0])

    plain, qwz = losses(), losses(quantize_weights="int8", quantize_block=64)
    assert plain[-1] < 0.8 * plain[0]  # it trains
    np.testing.assert_allclose(qwz, plain, rtol=0.02)


def test_qwz_gathers_int8_one_layer_at_a_time_and_trains_like_plain_stage3():
    """The trainer's GPT (layers scanned, ``gather_per_layer``, full remat) in bf16: the step's
    only all-gathers of weights move int8 values and fp32 scales, and 4 Adam steps on one
    batch stay within 1% of plain stage 3's losses (per-entry error at most 0.4% of a block's
    largest, like bf16's own rounding)."""
    import optax

    import zeroflow as zf
    from helpers import token_batches, train_losses
    from zeroflow.config.schema import ModelConfig
    from zeroflow.models import init_params, make_layerwise_loss_fn
    cfg = ModelConfig(vocab_size=256, seq_len=32, num_layers=2, embed_dim=64, num_heads=4,
                      mlp_dim=256, remat="full")
    batches = token_batches(1, rows=16, seq_len=32, vocab=256) * 4

    def run(**options):
        plan, prec, tx = (zf.ZeroPlan(zf.make_mesh(), stage=3, **options),
                          zf.Precision(params="bf16"), optax.adam(3e-3))
        state = zf.init_train_state(init_params(cfg, jax.random.key(0))[0], tx, plan, prec)
        step = zf.make_train_step(make_layerwise_loss_fn(cfg), tx, plan, prec,
                                  gather_per_layer="layers")
        text = step.lower(state, batches[0]).as_text()
        return np.array(train_losses(step, state, batches)[0]), text

    plain, _ = run()
    qwz, text = run(quantize_weights="int8", quantize_block=128)
    gathers = [line for line in text.splitlines() if "all_gather" in line and "->" in line]
    gathered_types = {line.rsplit("->", 1)[1].split("x")[-1].strip(" >)") for line in gathers}
    assert gathered_types == {"i8", "f32"}, gathered_types  # int8 values and their fp32 scales, no bf16 weight
    assert plain[-1] < plain[0]
    np.testing.assert_allclose(qwz, plain, rtol=0.01)


def test_trainer_keys_reach_the_plan_and_bad_combinations_are_one_line():
    from zeroflow.config.io import ConfigError, load_config
    from zeroflow.trainer.setup import build_run
    cfg = load_config("configs/tiny.yaml", ["parallel.zero_stage=3", "parallel.quantize_weights=int8",
                                            "parallel.quantize_block=64"])
    plan = build_run(cfg, with_data=False).plan
    assert (plan.quantize_weights, plan.quantize_block) == ("int8", 64)
    with pytest.raises(ConfigError, match="parallel.quantize_weights=int8 quantizes stage-3 weight "
                                          "gathers; parallel.zero_stage is 2") as e:
        load_config("configs/tiny.yaml", ["parallel.zero_stage=2", "parallel.quantize_weights=int8"])
    assert "\n" not in str(e.value)
    with pytest.raises(ConfigError, match="parallel.quantize_weights must be one of none, int8"):
        load_config("configs/tiny.yaml", ["parallel.quantize_weights=int4"])


def test_gathers_inside_a_scan_count_once_per_iteration():
    """A stack of 4 layers under ``lax.scan`` at stage 3 on 2 x 8: the gathers sit in loop
    bodies, and only their trip counts make the per-step bytes every layer twice (forward and
    backward; the input layer's ``x`` needs no gradient, but a loop body is one program for
    all iterations)."""
    import optax

    import zeroflow as zf
    mesh = _target(data=16, hosts=2)
    params = jax.eval_shape(lambda: {"w": jnp.zeros((4, 256, 256))})
    batch = {"x": jax.ShapeDtypeStruct((16, 256), jnp.float32)}

    def loss(p, b):
        def body(x, w):
            return jnp.tanh(x @ w.astype(x.dtype)), None
        x, _ = jax.lax.scan(body, b["x"].astype(p["w"].dtype), p["w"])
        return jnp.mean(x.astype(jnp.float32) ** 2)
    compiled, _ = zf.memory.compile_step(loss, params, batch, optax.sgd(0.1),
                                         zf.ZeroPlan(mesh, stage=3), zf.Precision(params="bf16"))
    colls = zf.memory.collectives(compiled)
    assert any(c.in_loop and c.runs > 1 for c in colls if c.kind == "all-gather")
    moved = zf.memory.traffic(colls)
    assert moved["all-gather"]["cross_host"] == 2 * (4 * 256 * 256 * 2) * 8 // 16
    assert moved["reduce-scatter"]["cross_host"] == 4 * (4 * 256 * 256) * 8 // 16


def test_stage3_collectives_are_always_passed_never_defaulted():
    """The plan's stage-3 collectives (plain or ZeRO++'s) reach every gather and reduction
    because each function on the step's path requires them: a stage-3 source built without
    them is a TypeError naming the argument, not a silently plain gather where the plan asked
    for int8 or within-host ones."""
    import inspect

    from zeroflow.engine.grads import local, sources
    with pytest.raises(TypeError, match="collectives"):
        sources.Sharded(0, jnp.float32)
    plain = sources.Stage3Collectives(reduce_dtype=jnp.float32)
    assert sources.Sharded(1, jnp.float32, collectives=plain).layer().collectives is plain
    required = inspect.Parameter.empty
    for fn in (local.local_grads, local._accumulated, local._layer_gatherer, local._source,
               local._call_gathering):
        assert inspect.signature(fn).parameters["collectives"].default is required, fn.__name__
    assert inspect.signature(sources.Stage3Collectives.of).parameters["reduce_dtype"].default \
        is required
