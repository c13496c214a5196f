"""Flash attention vs the fp32 reference (precision="highest"), in Pallas interpret mode on CPU.

Shapes are tiny: the interpreter runs grid steps one by one and compiling dominates.
"""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import BlockSizes, flash_attention, reference_attention
from pallas_kernels._backend import lower_for_cuda

pytestmark = pytest.mark.fast

# Backward q tile differs from the forward one on purpose (padding to the larger tile).
SMALL = BlockSizes(block_q=16, block_k=16, block_q_bwd=32, block_k_bwd=16)
# A compiled GPU run would use TF32 dots for fp32 inputs.
FP32_TOL = 2e-2 if jax.default_backend() == "gpu" else 2e-5


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


# Lengths 24, 40, 56 leave a partial last tile; every case mixes several features.
CASES = {
    "mha-d32-unequal-lengths": dict(batch=2, q_len=24, kv_len=40, heads=2, kv_heads=2,
                                    head_dim=32),
    "gqa-causal": dict(batch=1, q_len=40, kv_len=40, heads=4, kv_heads=2, head_dim=16,
                       causal=True),
    "mqa-two-sided-window": dict(batch=1, q_len=56, kv_len=56, heads=3, kv_heads=1, head_dim=16,
                                 window=(9, 20)),
}


@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_forward_and_gradients_match_reference(case):
    shape = dict(CASES[case])
    causal, window = shape.pop("causal", False), shape.pop("window", None)
    q, k, v, d_out = _qkv(**shape)
    kernel = functools.partial(flash_attention, causal=causal, window=window, block_sizes=SMALL)
    reference = functools.partial(reference_attention, causal=causal, window=window)

    out, grads = _value_and_grads(kernel, q, k, v, d_out)
    ref_out, ref_grads = _value_and_grads(reference, q, k, v, d_out)

    np.testing.assert_allclose(out, ref_out, atol=FP32_TOL, rtol=FP32_TOL)
    for name, got, want in zip("qkv", grads, ref_grads):
        assert got.shape == want.shape, name
        np.testing.assert_allclose(got, want, atol=FP32_TOL, rtol=FP32_TOL, err_msg=f"d{name}")


def test_blocks_outside_the_causal_window_are_skipped_not_masked():
    # NaN would leak through a masked block (0 * NaN = NaN); a skipped block is never read.
    # 16-row tiles, window (8, 0): q block 2 (rows 32..47) needs kv blocks 1-2 only, and kv
    # block 1 (rows 16..31) is seen by q blocks 1-2 only; blocks 0 and 3 are poisoned with NaN,
    # in k/v for batch 0 (checks forward and dQ) and in q/dO for batch 1 (checks dK and dV).
    q, k, v, d_out = _qkv(2, 64, 64, 2, 2, 16)
    poison = lambda x, b: x.at[b, :16].set(jnp.nan).at[b, 48:].set(jnp.nan)
    band = dict(causal=True, window=(8, 0))
    kernel = functools.partial(flash_attention, block_sizes=BlockSizes(16, 16, 16, 16), **band)
    out, (dq, dk, dv) = _value_and_grads(kernel, poison(q, 1), poison(k, 0), poison(v, 0),
                                         poison(d_out, 1))
    ref_out, (ref_dq, ref_dk, ref_dv) = _value_and_grads(
        functools.partial(reference_attention, **band), q, k, v, d_out)

    for name, x, ref, batch, rows in [("out", out, ref_out, 0, slice(32, 48)),
                                      ("dq", dq, ref_dq, 0, slice(32, 48)),
                                      ("dk", dk, ref_dk, 1, slice(16, 32)),
                                      ("dv", dv, ref_dv, 1, slice(16, 32))]:
        np.testing.assert_allclose(x[batch, rows], ref[batch, rows], atol=FP32_TOL, rtol=FP32_TOL,
                                   err_msg=name)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_low_precision_error_is_at_most_twice_naive(dtype):
    """Forward and all gradients, against a softmax attention computed in the same dtype."""
    q, k, v, d_out = _qkv(1, 40, 40, 4, 2, 32, dtype=dtype, seed=1)
    kernel = functools.partial(flash_attention, causal=True, block_sizes=SMALL)
    naive = functools.partial(_naive_attention, causal=True)
    reference = functools.partial(reference_attention, causal=True)

    out, grads = _value_and_grads(kernel, q, k, v, d_out)
    naive_out, naive_grads = _value_and_grads(naive, q, k, v, d_out)
    ref_out, ref_grads = _value_and_grads(reference, q, k, v, d_out.astype(jnp.float32))

    assert out.dtype == dtype and all(g.dtype == dtype for g in grads)
    error = lambda got, want: float(jnp.max(jnp.abs(got.astype(jnp.float32) - want)))
    assert error(out, ref_out) <= 2 * error(naive_out, ref_out)
    for name, got, base, want in zip("qkv", grads, naive_grads, ref_grads):
        assert error(got, want) <= 2 * error(base, want), f"d{name}"


def test_inside_shard_map_with_replicated_kv():
    """As in zeroflow's train step: jax.shard_map (check_vma=True) over the batch. k/v are
    replicated here, so their gradients must come back summed over the devices."""
    mesh = jax.make_mesh((2,), ("data",), axis_types=(jax.sharding.AxisType.Auto,),
                         devices=jax.devices()[:2])
    q, k, v, _ = _qkv(2, 24, 24, 2, 1, 16)
    k, v = k[:1], v[:1]
    attention = functools.partial(flash_attention, causal=True, block_sizes=SMALL)
    loss = lambda attention, q, k, v: jnp.sum(attention(q, k, v) ** 2)
    spec = jax.sharding.PartitionSpec
    sharded = jax.shard_map(jax.grad(functools.partial(loss, attention), argnums=(0, 1, 2)),
                            mesh=mesh, in_specs=(spec("data"), spec(), spec()),
                            out_specs=(spec("data"), spec(), spec()))
    grads = _run(sharded, q, k, v)

    per_example = lambda q, k, v: jax.vmap(
        lambda qi: reference_attention(qi[None], k, v, causal=True)[0])(q)
    ref_grads = _run(jax.grad(functools.partial(loss, per_example), argnums=(0, 1, 2)), q, k, v)
    for name, got, want in zip("qkv", grads, ref_grads):
        np.testing.assert_allclose(got, want, atol=FP32_TOL, rtol=FP32_TOL, err_msg=f"d{name}")


def test_triton_lowering_for_cuda_fwd_and_bwd():
    q = jax.ShapeDtypeStruct((2, 100, 6, 64), jnp.bfloat16)  # GQA 3:1, tail, default tiles
    kv = jax.ShapeDtypeStruct((2, 100, 2, 64), jnp.bfloat16)
    attention = functools.partial(flash_attention, causal=True, window=(32, 0), interpret=False)
    loss = lambda q, k, v: attention(q, k, v).astype(jnp.float32).sum()

    assert lower_for_cuda(attention, q, kv, kv) == ["flash_attention_fwd"]
    bwd = lower_for_cuda(jax.grad(loss, argnums=(0, 1, 2)), q, kv, kv)
    assert sorted(bwd) == ["flash_attention_dkv", "flash_attention_dq", "flash_attention_fwd"]


@pytest.mark.parametrize("bad", [dict(block_q=48), dict(block_k=0), dict(block_q_bwd=-16),
                                 dict(block_k_bwd=True), dict(num_warps=3), dict(num_stages=0)])
def test_block_sizes_reject_bad_values(bad):
    with pytest.raises(ValueError, match="BlockSizes"):
        BlockSizes(**bad)


def test_bad_shapes_and_windows_raise():
    q, k, v, _ = _qkv(1, 16, 16, 3, 2, 16)
    with pytest.raises(ValueError, match="multiple of kv heads"):
        flash_attention(q, k, v)
    q, k, v, _ = _qkv(1, 16, 16, 2, 2, 16)
    with pytest.raises(ValueError, match="window"):
        flash_attention(q, k, v, window=-1)
