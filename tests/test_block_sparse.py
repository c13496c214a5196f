"""Block-sparse matmul and BlockSparseDense vs dense products: the Mosaic GPU kernels in jax's
GPU interpreter on CPU (compiled for Hopper in tests/test_gpu_compile_kernels.py)."""
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import (
    BlockSparseDense,
    banded_layout,
    block_diagonal_layout,
    block_sparse_matmul,
    from_dense,
    random_layout,
    reference_block_sparse_matmul,
    strided_layout,
    to_dense,
)

pytestmark = pytest.mark.fast

# Each interpreted program is compiled once and run once: skip LLVM's optimisation (2-3x faster).
FAST_COMPILE = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}
TOL = 2e-2 if jax.default_backend() == "gpu" else 2e-5  # GPU: TF32 dots for fp32 inputs
BS = 32
# Relative tolerance of a 16-bit output accumulated in fp32: the final rounding (half an ulp,
# 2^-8 for bf16, 2^-11 for fp16) with room for a rounded product; atol for outputs near zero.
RTOL_16 = {jnp.bfloat16: 2**-7, jnp.float16: 2**-10}


def _random(shape, dtype=jnp.float32, seed=0):
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape, dtype=np.float32), dtype)


def _run(fn, *args):
    return jax.jit(fn).lower(*args).compile(compiler_options=FAST_COMPILE)(*args)


def _layout_with_holes():
    """Random 5x6 layout with block row 2 and block column 4 empty."""
    layout = random_layout(5, 6, 0.5, seed=3)
    layout[2, :] = False
    layout[:, 4] = False
    return layout


@pytest.mark.parametrize("layout", [_layout_with_holes(), banded_layout(4, 2, 0)],
                         ids=["random-with-empty-row-and-column", "banded-rectangular"])
def test_product_and_gradients_match_dense(layout):
    k, n = layout.shape[0] * BS, layout.shape[1] * BS
    x = _random((3, 7, k))  # leading dims flattened; 21 rows is not a multiple of the row tile
    blocks = _random((int(layout.sum()), BS, BS), seed=1)
    dy = _random((3, 7, n), seed=2)

    def sparse_and_dense(x, blocks, dy):
        y, vjp = jax.vjp(lambda x, b: block_sparse_matmul(x, b, layout, BS, interpret=True), x,
                         blocks)
        w = to_dense(blocks, layout, BS)
        ref_y, ref_vjp = jax.vjp(lambda x, w: jnp.matmul(x, w, precision="highest"), x, w)
        return (y, *vjp(dy)), (ref_y, *ref_vjp(dy))

    (y, dx, dblocks), (ref_y, ref_dx, ref_dw) = _run(sparse_and_dense, x, blocks, dy)
    np.testing.assert_allclose(y, ref_y, atol=TOL, rtol=TOL)
    np.testing.assert_allclose(dx, ref_dx, atol=TOL, rtol=TOL)
    np.testing.assert_allclose(dblocks, from_dense(ref_dw, layout, BS), atol=TOL, rtol=TOL)
    for col in np.flatnonzero(~layout.any(axis=0)):  # empty block column: zero output
        assert not np.any(y[..., col * BS:(col + 1) * BS])
    for row in np.flatnonzero(~layout.any(axis=1)):  # empty block row: zero dx
        assert not np.any(dx[..., row * BS:(row + 1) * BS])


@pytest.mark.parametrize("dtype,block_size", [(jnp.bfloat16, 32), (jnp.float16, 64),
                                              (jnp.bfloat16, 128)])
def test_16_bit_product_and_gradients_per_block_size(dtype, block_size):
    """Every block size, both 16-bit dtypes: output, dx and dblocks against the fp32 product of
    the same (rounded) inputs, with an empty block row and column and 70 rows (padded to 128)."""
    layout = random_layout(3, 4, 0.5, seed=5)
    layout[2, :] = False
    layout[:, 2] = False
    # Block rows 0 and 1 both present: at bs 32 one dblocks program computes a pair of rows.
    layout[0, 0] = layout[1, 0] = layout[1, 3] = True
    k, n = 3 * block_size, 4 * block_size
    x, dy = _random((70, k), dtype), _random((70, n), dtype, seed=2)
    blocks = _random((int(layout.sum()), block_size, block_size), dtype, seed=1)
    sparse = lambda x, b: block_sparse_matmul(x, b, layout, block_size, interpret=True)
    y, dx, dblocks = _run(lambda x, b, dy: (lambda y, vjp: (y, *vjp(dy)))(
        *jax.vjp(sparse, x, blocks)), x, blocks, dy)
    assert y.dtype == dx.dtype == dblocks.dtype == dtype

    w = np.asarray(to_dense(blocks, layout, block_size), np.float32)
    x32, dy32 = np.asarray(x, np.float32), np.asarray(dy, np.float32)
    want = {"y": x32 @ w, "dx": dy32 @ w.T,
            "dblocks": np.asarray(from_dense(jnp.asarray(x32.T @ dy32), layout, block_size))}
    for name, got in (("y", y), ("dx", dx), ("dblocks", dblocks)):
        np.testing.assert_allclose(np.asarray(got, np.float32), want[name], rtol=RTOL_16[dtype],
                                   atol=RTOL_16[dtype] * np.abs(want[name]).max(), err_msg=name)
    assert not np.any(np.asarray(y, np.float32)[:, 2 * block_size:3 * block_size])  # empty column
    assert not np.any(np.asarray(dx, np.float32)[:, 2 * block_size:])  # empty row


def test_inside_shard_map_with_replicated_blocks():
    """As in zeroflow's train step: jax.shard_map (check_vma=True) over rows with replicated
    weights, whose gradient must come back summed over the devices. (On two CPU devices the
    product is XLA's, interpret=None; the kernels inside shard_map are compiled for eight H100s
    in test_gpu_compile_kernels.py.)"""
    mesh = jax.make_mesh((2,), ("data",), axis_types=(jax.sharding.AxisType.Auto,),
                         devices=jax.devices()[:2])
    layout = _layout_with_holes()
    x = _random((32, layout.shape[0] * BS))
    blocks = _random((int(layout.sum()), BS, BS), seed=1)
    loss = lambda matmul, x, b: jnp.sum(matmul(x, b) ** 2)
    sparse = lambda x, b: block_sparse_matmul(x, b, layout, BS)
    spec = jax.sharding.PartitionSpec
    sharded = jax.shard_map(jax.grad(lambda x, b: loss(sparse, x, b), argnums=(0, 1)), mesh=mesh,
                            in_specs=(spec("data"), spec()), out_specs=(spec("data"), spec()))
    dx, dblocks = _run(sharded, x, blocks)

    dense = lambda x, w: jnp.matmul(x, w, precision="highest")
    ref_dx, ref_dw = jax.grad(lambda x, w: loss(dense, x, w), argnums=(0, 1))(
        x, to_dense(blocks, layout, BS))
    # The gradients of sum(y^2) reach ~2e3, sums of ~160 products whose fp32 rounding depends
    # on the order of summation (the kernel's, XLA:CPU's dot's): an element where terms cancel
    # has an unbounded relative error, so the error is held to the gradient's scale instead.
    for got, want in ((dx, ref_dx), (dblocks, from_dense(ref_dw, layout, BS))):
        np.testing.assert_allclose(got, want, rtol=TOL, atol=TOL * float(np.abs(want).max()))


def test_bfloat16_accumulates_in_fp32():
    layout = strided_layout(4, 4, 2)
    x = _random((32, 4 * BS), jnp.bfloat16)
    blocks = _random((int(layout.sum()), BS, BS), jnp.bfloat16, seed=1)
    y = _run(lambda x, b: block_sparse_matmul(x, b, layout, BS, interpret=True), x, blocks)
    assert y.dtype == jnp.bfloat16
    want = reference_block_sparse_matmul(x, blocks, layout, BS)
    # fp32 accumulation: only the final rounding to bf16 (relative 2^-8) remains.
    np.testing.assert_allclose(y.astype(jnp.float32), want, rtol=2**-7, atol=1e-2)


def test_empty_layout_gives_zeros():
    layout = np.zeros((2, 3), bool)
    y = block_sparse_matmul(jnp.ones((4, 2 * BS)), jnp.zeros((0, BS, BS)), layout, BS)
    assert y.shape == (4, 3 * BS) and not np.any(y)


def test_layouts_and_dense_round_trip():
    layout = random_layout(8, 4, 0.25, seed=7)
    assert layout.shape == (8, 4) and layout.sum() == 8
    np.testing.assert_array_equal(layout, random_layout(8, 4, 0.25, seed=7))
    np.testing.assert_array_equal(banded_layout(3, 3, 1).sum(axis=1), [2, 3, 2])
    np.testing.assert_array_equal(strided_layout(4, 4, 2).sum(axis=0), [2, 2, 2, 2])
    assert block_diagonal_layout(4, 6, 2).sum() == 12
    blocks = _random((8, 4, 4))
    np.testing.assert_array_equal(from_dense(to_dense(blocks, layout, 4), layout, 4), blocks)


def test_block_sparse_dense_layer_matches_dense_and_accepts_bf16_params():
    layer = BlockSparseDense(features=4 * BS, block_size=BS, density=0.5, layout_seed=1,
                             use_bias=True, interpret=True)
    x = _random((2, 5, 3 * BS))
    variables = _run(layer.init, jax.random.key(0), x)
    boxed = variables["params"]["blocks"]
    assert isinstance(boxed, nn.LogicallyPartitioned) and boxed.names == (None, None, None)
    params = nn.meta.unbox(variables)
    layout = layer.layout(3 * BS)
    assert params["params"]["blocks"].shape == (int(layout.sum()), BS, BS)
    np.testing.assert_array_equal(layout, layer.layout(3 * BS))  # static and deterministic

    y = _run(layer.apply, params, x)
    dense = to_dense(params["params"]["blocks"], layout, BS)
    assert y.shape == (2, 5, 4 * BS)
    np.testing.assert_allclose(y, jnp.matmul(x, dense, precision="highest"), atol=TOL, rtol=TOL)

    bf16 = jax.tree.map(lambda p: p.astype(jnp.bfloat16), params)
    y16 = _run(layer.apply, bf16, x)
    assert y16.dtype == jnp.bfloat16
    np.testing.assert_allclose(y16.astype(jnp.float32), y, atol=0.1, rtol=0.05)


def test_block_sparse_dense_inside_nn_scan():
    class Stack(nn.Module):
        @nn.compact
        def __call__(self, x):
            layer = nn.scan(lambda module, carry, _: (module(carry), None),
                            variable_axes={"params": 0}, split_rngs={"params": True}, length=2,
                            metadata_params={nn.PARTITION_NAME: "layers"})
            return layer(BlockSparseDense(2 * BS, block_size=BS, density=0.5), x, None)[0]

    x = _random((3, 2 * BS))
    params = nn.meta.unbox(_run(Stack().init, jax.random.key(0), x))
    [blocks] = jax.tree.leaves(params)
    assert blocks.shape == (2, 2, BS, BS)  # [layers, nnz, bs, bs]
    grads = _run(jax.grad(lambda p: Stack().apply(p, x).sum()), params)
    assert all(np.all(np.isfinite(g)) for g in jax.tree.leaves(grads))


@pytest.mark.parametrize("features, in_features", [(40, 32), (32, 40)])
def test_block_sparse_dense_rejects_sizes_not_multiple_of_block(features, in_features):
    with pytest.raises(ValueError, match="multiple of block_size"):
        BlockSparseDense(features, block_size=BS).init(jax.random.key(0),
                                                       jnp.ones((1, in_features)))


def test_interpreting_inside_a_multi_device_shard_map_is_refused():
    mesh = jax.make_mesh((2,), ("data",), axis_types=(jax.sharding.AxisType.Auto,),
                         devices=jax.devices()[:2])
    layout = np.ones((1, 1), bool)
    sparse = lambda x, b: block_sparse_matmul(x, b, layout, BS, interpret=True)
    spec = jax.sharding.PartitionSpec
    with pytest.raises(ValueError, match="inside a shard_map over 2 devices"):
        jax.shard_map(sparse, mesh=mesh, in_specs=(spec("data"), spec()),
                      out_specs=spec("data"))(jnp.ones((4, BS)), jnp.ones((1, BS, BS)))


def test_bad_arguments_raise():
    layout = np.ones((2, 2), bool)
    with pytest.raises(ValueError, match=r"block_size must be one of \(32, 64, 128\), got 16"):
        block_sparse_matmul(jnp.ones((4, 32)), jnp.ones((4, 16, 16)), layout, 16)
    with pytest.raises(ValueError, match=r"block_m must be one of \(64, 128\), got 32"):
        block_sparse_matmul(jnp.ones((4, 2 * BS)), jnp.ones((4, BS, BS)), layout, BS, block_m=32)
    with pytest.raises(ValueError, match="blocks must be"):
        block_sparse_matmul(jnp.ones((4, 2 * BS)), jnp.ones((3, BS, BS)), layout, BS)
    with pytest.raises(ValueError, match="features"):
        block_sparse_matmul(jnp.ones((4, BS)), jnp.ones((4, BS, BS)), layout, BS)
    with pytest.raises(ValueError, match="boolean"):
        block_sparse_matmul(jnp.ones((4, 2 * BS)), jnp.ones((4, BS, BS)), layout.astype(int), BS)


