"""Flash attention (Mosaic GPU kernels) vs the fp32 reference (precision="highest"), run by the
Mosaic GPU interpreter on CPU.

Every kernel's q tile is 64 rows, so lengths over 64 that are not multiples of 64 give several
blocks and a partial last one. Stated tolerances: fp32 2e-5 (the interpreter's products are
true fp32); bf16 and fp16 at most twice the error of a softmax attention computed in the same
dtype, and within 3e-2 (bf16) / 4e-3 (fp16) of the output's and each gradient's largest value.
"""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import TuningConfig, flash_attention, reference_attention

SMALL = TuningConfig(block_k=64, block_k_dq=64)
FP32_TOL = 2e-5
SCALED_TOL = {jnp.bfloat16: 3e-2, jnp.float16: 4e-3}


def _qkv(batch, q_len, kv_len, heads, kv_heads, head_dim, dtype=jnp.float32, seed=0):
    rng = np.random.default_rng(seed)  # numpy: nothing to compile
    q_shape, kv_shape = (batch, q_len, heads, head_dim), (batch, kv_len, kv_heads, head_dim)
    shapes = (q_shape, kv_shape, kv_shape, q_shape)
    return tuple(jnp.asarray(rng.standard_normal(s, dtype=np.float32), dtype) for s in shapes)


# Each interpreted program is compiled once and run once: skip LLVM's optimisation (2-3x faster).
FAST_COMPILE = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}


def _run(fn, *args):
    return jax.jit(fn).lower(*args).compile(compiler_options=FAST_COMPILE)(*args)


def _value_and_grads(attention, q, k, v, d_out):
    """(attention(q, k, v), its vjp at d_out), compiled as one program."""
    def run(q, k, v, d_out):
        out, vjp = jax.vjp(attention, q, k, v)
        return out, vjp(d_out.astype(out.dtype))

    return _run(run, q, k, v, d_out)


def _naive_attention(q, k, v, causal=False):
    """Plain softmax attention entirely in the input dtype (the low-precision baseline)."""
    group = q.shape[2] // k.shape[2]
    k, v = jnp.repeat(k, group, axis=2), jnp.repeat(v, group, axis=2)
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(jnp.asarray(q.shape[-1], q.dtype))
    if causal:
        scores = jnp.where(jnp.tril(jnp.ones(scores.shape[-2:], bool)), scores, -jnp.inf)
    return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(scores, axis=-1), v)


def _packed_ids(batch, length, cuts):
    """[batch, length] segment ids: a new segment starts at each of ``cuts``."""
    ids = np.zeros((batch, length), np.int32)
    for cut in cuts:
        ids[:, cut:] += 1
    return jnp.asarray(ids)


# Lengths 72, 136, 130, 160 leave a partial last tile; every case mixes several features.
CASES = {
    "mha-d32-unequal-lengths": dict(shape=dict(batch=1, q_len=72, kv_len=136, heads=2, kv_heads=2,
                                               head_dim=32)),
    "gqa-causal-packed-d16": dict(shape=dict(batch=1, q_len=130, kv_len=130, heads=4, kv_heads=2,
                                             head_dim=16), causal=True, cuts=(50, 100)),
    "mqa-two-sided-window-d80": dict(shape=dict(batch=1, q_len=160, kv_len=160, heads=3,
                                                kv_heads=1, head_dim=80), window=(9, 70)),
}


def _check_case(case):
    spec = CASES[case]
    causal, window = spec.get("causal", False), spec.get("window")
    q, k, v, d_out = _qkv(**spec["shape"])
    ids = _packed_ids(q.shape[0], q.shape[1], spec["cuts"]) if "cuts" in spec else None
    band = dict(causal=causal, window=window, segment_ids=ids)
    kernel = functools.partial(flash_attention, tuning=SMALL, **band)
    out, grads = _value_and_grads(kernel, q, k, v, d_out)
    ref_out, ref_grads = _value_and_grads(functools.partial(reference_attention, **band),
                                          q, k, v, d_out)
    np.testing.assert_allclose(out, ref_out, atol=FP32_TOL, rtol=FP32_TOL)
    for name, got, want in zip("qkv", grads, ref_grads):
        assert got.shape == want.shape, name
        np.testing.assert_allclose(got, want, atol=FP32_TOL, rtol=FP32_TOL, err_msg=f"d{name}")


@pytest.mark.fast
def test_forward_and_gradients_match_reference_gqa_causal_packed():
    _check_case("gqa-causal-packed-d16")


@pytest.mark.slow
@pytest.mark.parametrize("case", ["mha-d32-unequal-lengths", "mqa-two-sided-window-d80"])
def test_forward_and_gradients_match_reference(case):
    _check_case(case)


@pytest.mark.slow
def test_blocks_outside_the_causal_window_are_skipped_not_masked():
    # NaN would leak through a masked block (0 * NaN = NaN); a skipped block is never read.
    # 64-row tiles, window (8, 0): q block 2 (rows 128..191) needs kv blocks 1-2 only, and kv
    # block 1 (rows 64..127) is seen by q blocks 1-2 only; blocks 0 and 3 are poisoned with NaN,
    # in k/v for batch 0 (checks forward and dQ) and in q/dO for batch 1 (checks dK and dV).
    q, k, v, d_out = _qkv(2, 256, 256, 1, 1, 16)
    poison = lambda x, b: x.at[b, :64].set(jnp.nan).at[b, 192:].set(jnp.nan)  # noqa: E731
    band = dict(causal=True, window=(8, 0))
    kernel = functools.partial(flash_attention, tuning=SMALL, **band)
    out, (dq, dk, dv) = _value_and_grads(kernel, poison(q, 1), poison(k, 0), poison(v, 0),
                                         poison(d_out, 1))
    ref_out, (ref_dq, ref_dk, ref_dv) = _value_and_grads(
        functools.partial(reference_attention, **band), q, k, v, d_out)

    for name, x, ref, batch, rows in [("out", out, ref_out, 0, slice(128, 192)),
                                      ("dq", dq, ref_dq, 0, slice(128, 192)),
                                      ("dk", dk, ref_dk, 1, slice(64, 128)),
                                      ("dv", dv, ref_dv, 1, slice(64, 128))]:
        np.testing.assert_allclose(x[batch, rows], ref[batch, rows], atol=FP32_TOL, rtol=FP32_TOL,
                                   err_msg=name)


@pytest.mark.slow
def test_rows_that_see_no_key_and_a_kv_block_their_segments_empty():
    """Queries of segment 7, absent from the keys, see nothing: output 0, gradients 0. Keys
    64..127 are segment 2, which no query has: that whole kv block is masked for every row."""
    q, k, v, d_out = _qkv(1, 96, 192, 2, 1, 64)
    q_ids = np.ones((1, 96), np.int32)
    q_ids[:, 40:60] = 7
    q_ids[:, 60:] = 3
    kv_ids = np.ones((1, 192), np.int32)
    kv_ids[:, 64:128] = 2
    kv_ids[:, 128:] = 3
    ids = (jnp.asarray(q_ids), jnp.asarray(kv_ids))
    kernel = functools.partial(flash_attention, tuning=SMALL, segment_ids=ids)
    out, grads = _value_and_grads(kernel, q, k, v, d_out)
    ref_out, ref_grads = _value_and_grads(
        functools.partial(reference_attention, segment_ids=ids), q, k, v, d_out)
    assert not np.any(out[:, 40:60]) and not np.any(grads[0][:, 40:60])
    assert not np.any(grads[1][:, 64:128]) and not np.any(grads[2][:, 64:128])
    np.testing.assert_allclose(out, ref_out, atol=FP32_TOL, rtol=FP32_TOL)
    for name, got, want in zip("qkv", grads, ref_grads):
        np.testing.assert_allclose(got, want, atol=FP32_TOL, rtol=FP32_TOL, err_msg=f"d{name}")


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_low_precision_error_is_at_most_twice_naive(dtype):
    """Forward and all gradients, against a softmax attention computed in the same dtype."""
    q, k, v, d_out = _qkv(1, 100, 100, 4, 2, 64, dtype=dtype, seed=1)
    kernel = functools.partial(flash_attention, causal=True, tuning=SMALL)
    naive = functools.partial(_naive_attention, causal=True)
    reference = functools.partial(reference_attention, causal=True)

    out, grads = _value_and_grads(kernel, q, k, v, d_out)
    naive_out, naive_grads = _value_and_grads(naive, q, k, v, d_out)
    ref_out, ref_grads = _value_and_grads(reference, q, k, v, d_out.astype(jnp.float32))

    assert out.dtype == dtype and all(g.dtype == dtype for g in grads)
    error = lambda got, want: float(jnp.max(jnp.abs(got.astype(jnp.float32) - want)))  # noqa: E731
    tol = SCALED_TOL[dtype]
    assert error(out, ref_out) <= 2 * error(naive_out, ref_out)
    assert error(out, ref_out) <= tol * float(jnp.max(jnp.abs(ref_out)))
    for name, got, base, want in zip("qkv", grads, naive_grads, ref_grads):
        assert error(got, want) <= 2 * error(base, want), f"d{name}"
        assert error(got, want) <= tol * float(jnp.max(jnp.abs(want))), f"d{name}"


@pytest.mark.slow
@pytest.mark.parametrize("devices", [1, 2])
def test_inside_shard_map_with_replicated_kv(devices):
    """As in zeroflow's train step: jax.shard_map (check_vma=True) over the batch. k/v are
    replicated here, so their gradients must come back summed over the devices. On two devices
    each device's kernels run in a program of their own (``_mgpu.on_host``)."""
    mesh = jax.make_mesh((devices,), ("data",), axis_types=(jax.sharding.AxisType.Auto,),
                         devices=jax.devices()[:devices])
    q, k, v, _ = _qkv(devices, 72, 72, 2, 1, 16)  # one example per device
    k, v = k[:1], v[:1]
    attention = functools.partial(flash_attention, causal=True, tuning=SMALL)
    loss = lambda attention, q, k, v: jnp.sum(attention(q, k, v) ** 2)  # noqa: E731
    spec = jax.sharding.PartitionSpec
    sharded = jax.shard_map(jax.grad(functools.partial(loss, attention), argnums=(0, 1, 2)),
                            mesh=mesh, in_specs=(spec("data"), spec(), spec()),
                            out_specs=(spec("data"), spec(), spec()))
    grads = _run(sharded, q, k, v)

    per_example = lambda q, k, v: jax.vmap(  # noqa: E731
        lambda qi: reference_attention(qi[None], k, v, causal=True)[0])(q)
    ref_grads = _run(jax.grad(functools.partial(loss, per_example), argnums=(0, 1, 2)), q, k, v)
    for name, got, want in zip("qkv", grads, ref_grads):
        np.testing.assert_allclose(got, want, atol=FP32_TOL, rtol=FP32_TOL, err_msg=f"d{name}")


@pytest.mark.fast
@pytest.mark.parametrize("bad", [dict(block_k=32), dict(block_k=256), dict(block_k_dq=0),
                                 dict(block_k_dq=True), dict(block_k="64")])
def test_tuning_config_rejects_bad_values(bad):
    with pytest.raises(ValueError, match="TuningConfig"):
        TuningConfig(**bad)


@pytest.mark.fast
def test_bad_shapes_dtypes_and_windows_raise_one_line():
    q, k, v, _ = _qkv(1, 16, 16, 3, 2, 16)
    with pytest.raises(ValueError, match="multiple of kv heads"):
        flash_attention(q, k, v)
    q, k, v, _ = _qkv(1, 16, 16, 2, 2, 16)
    with pytest.raises(ValueError, match="window"):
        flash_attention(q, k, v, window=-1)
    wide = _qkv(1, 16, 16, 2, 2, 192)[:3]
    with pytest.raises(ValueError, match=r"head_dim 1\.\.128.*got 192"):
        flash_attention(*wide)
    # fp32 runs only in the interpreter: compiled, one line before any tracing of the kernel.
    with pytest.raises(ValueError, match="bf16 or fp16 q, k and v") as err:
        flash_attention(q, k, v, interpret=False)
    assert "\n" not in str(err.value)
    with pytest.raises(ValueError, match="block_k_dq=128 needs head_dim <= 64"):
        flash_attention(*_qkv(1, 16, 16, 2, 2, 128)[:3], tuning=TuningConfig(block_k_dq=128))
    with pytest.raises(ValueError, match="segment ids must be"):
        flash_attention(q, k, v, segment_ids=jnp.zeros((1, 15), jnp.int32))


@pytest.mark.fast
def test_a_jax_without_mosaic_gpu_is_named_in_one_line(monkeypatch):
    """As with a jax whose Pallas has no Mosaic GPU backend: the import fails (None in
    sys.modules), ``mosaic_gpu_problem`` says so in one line, and so does the kernel."""
    import sys

    import jax.experimental.pallas

    from pallas_kernels import _mgpu, mosaic_gpu_problem

    _mgpu.plgpu.cache_clear()
    try:
        with monkeypatch.context() as patch:
            patch.setitem(sys.modules, "jax.experimental.pallas.mosaic_gpu", None)
            patch.delattr(jax.experimental.pallas, "mosaic_gpu", raising=False)
            problem = mosaic_gpu_problem()
            assert problem and "\n" not in problem
            assert "jax.experimental.pallas.mosaic_gpu" in problem and "supported: jax" in problem
            q, k, v, _ = _qkv(1, 16, 16, 2, 2, 16)
            with pytest.raises(_mgpu.MosaicGPUUnavailable, match="mosaic_gpu"):
                flash_attention(q, k, v)
            _mgpu.plgpu.cache_clear()
    finally:
        _mgpu.plgpu.cache_clear()
    assert mosaic_gpu_problem() is None


@pytest.mark.fast
def test_backward_refuses_forward_results_that_do_not_fit_q_in_one_line():
    """``flash_attention_backward`` takes the forward's ``out`` and ``lse`` from its caller (the
    context ring): a wrong shape is named before any kernel is traced. Empty sequences too."""
    from pallas_kernels import flash_attention_backward, flash_attention_forward

    q, k, v, _ = _qkv(1, 16, 16, 2, 2, 16)
    out, lse = flash_attention_forward(q, k, v)
    cases = [((out, lse.transpose(0, 2, 1), out), r"lse must be \[B,H,Sq\] \(1, 2, 16\)"),
             ((out[:, :8], lse, out), "out and d_out must have q's shape"),
             ((out, lse, out[..., :8]), "out and d_out must have q's shape")]
    for (o, l, d), message in cases:
        with pytest.raises(ValueError, match=message) as err:
            flash_attention_backward(q, k, v, o, l, d)
        assert "\n" not in str(err.value)
    with pytest.raises(ValueError, match="non-empty q and k, v"):
        flash_attention(q[:, :0], k, v)


@pytest.mark.fast
def test_compiled_kernels_refuse_a_gpu_without_sm_90_in_one_line(monkeypatch):
    """Where the GPU a kernel is compiled for is known and is not Hopper (wgmma, TMA), flash
    attention and the block-sparse matmul say so before tracing a kernel, as a ValueError."""
    from pallas_kernels import _backend, block_sparse_matmul

    monkeypatch.setattr(_backend, "target_device_kind", lambda: "NVIDIA A100-SXM4-80GB")
    q, k, v, _ = _qkv(1, 16, 16, 2, 2, 64, jnp.bfloat16)
    x, blocks = jnp.ones((64, 32), jnp.bfloat16), jnp.ones((1, 32, 32), jnp.bfloat16)
    calls = [lambda: flash_attention(q, k, v, interpret=False),
             lambda: block_sparse_matmul(x, blocks, np.ones((1, 1), bool), 32, interpret=False)]
    for call in calls:
        with pytest.raises(ValueError, match=r"sm_90 GPUs \(H100, H200\), not for "
                                             r"'NVIDIA A100-SXM4-80GB'") as err:
            call()
        assert "\n" not in str(err.value)
    monkeypatch.setattr(_backend, "target_device_kind", lambda: "NVIDIA H100 80GB HBM3")
    assert flash_attention(q, k, v, interpret=True).shape == q.shape  # interpreted: any device
