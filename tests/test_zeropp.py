"""ZeRO++ pieces: blockwise int8 quantization against a numpy reference, cross-host bytes of
collectives, and stage 3 with quantized weight gathers trained against plain stage 3."""
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from zeroflow import zeropp


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


@pytest.mark.parametrize("shape, block", [((37, 5), 16), ((64,), 64), ((3, 4, 10), 7), ((5,), 256)])
def test_quantize_matches_numpy_and_round_trips_within_half_a_step(shape, block):
    x = np.random.default_rng(0).normal(size=shape).astype(np.float32) * np.float32(3)
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
    pytest.importorskip("jax_plugins.xla_cuda12", reason="the CUDA plugin (jax-cuda12-plugin) "
                        "is not installed: pip install -e '.[test]'")
    import zeroflow as zf
    return zf.target_mesh("h100", **kw)


def test_target_devices_are_numbered_host_major():
    """What the cross-host counts rest on: a compiled program's logical device ids index
    ``mesh.devices.flat``, and on the 1x2x8 target ids 0-7 are host 0 and 8-15 host 1."""
    from zeroflow.zeropp.hosts import hosts_of
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
