"""Block-sparse matmul and BlockSparseDense vs dense products, in Pallas interpret mode on CPU."""
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
from pallas_kernels._backend import lower_for_cuda

pytestmark = pytest.mark.fast

# Each interpreted program is compiled once and run once: skip LLVM's optimisation (2-3x faster).
FAST_COMPILE = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}
TOL = 2e-2 if jax.default_backend() == "gpu" else 2e-5  # GPU: TF32 dots for fp32 inputs
BS = 16


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
        y, vjp = jax.vjp(lambda x, b: block_sparse_matmul(x, b, layout, BS, block_m=16), x, blocks)
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


def test_inside_shard_map_with_replicated_blocks():
    """As in zeroflow's train step: jax.shard_map (check_vma=True) over rows with replicated
    weights, whose gradient must come back summed over the devices."""
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
    np.testing.assert_allclose(dx, ref_dx, atol=TOL, rtol=TOL)
    np.testing.assert_allclose(dblocks, from_dense(ref_dw, layout, BS), atol=1e-4, rtol=TOL)


def test_bfloat16_accumulates_in_fp32():
    layout = strided_layout(4, 4, 2)
    x = _random((32, 4 * BS), jnp.bfloat16)
    blocks = _random((int(layout.sum()), BS, BS), jnp.bfloat16, seed=1)
    y = _run(lambda x, b: block_sparse_matmul(x, b, layout, BS), x, blocks)
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
                             use_bias=True)
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


def test_bad_arguments_raise():
    layout = np.ones((2, 2), bool)
    with pytest.raises(ValueError, match="power of two"):
        block_sparse_matmul(jnp.ones((4, 48)), jnp.ones((4, 24, 24)), layout, 24)
    with pytest.raises(ValueError, match="blocks must be"):
        block_sparse_matmul(jnp.ones((4, 32)), jnp.ones((3, BS, BS)), layout, BS)
    with pytest.raises(ValueError, match="features"):
        block_sparse_matmul(jnp.ones((4, 16)), jnp.ones((4, BS, BS)), layout, BS)
    with pytest.raises(ValueError, match="boolean"):
        block_sparse_matmul(jnp.ones((4, 32)), jnp.ones((4, BS, BS)), layout.astype(int), BS)


def test_triton_lowering_for_cuda_fwd_and_bwd():
    layout = _layout_with_holes()
    x = jax.ShapeDtypeStruct((300, layout.shape[0] * 64), jnp.bfloat16)
    blocks = jax.ShapeDtypeStruct((int(layout.sum()), 64, 64), jnp.bfloat16)
    matmul = lambda x, b: block_sparse_matmul(x, b, layout, 64, interpret=False)
    loss = lambda x, b: matmul(x, b).astype(jnp.float32).sum()

    assert lower_for_cuda(matmul, x, blocks) == ["block_sparse_matmul"]
    bwd = lower_for_cuda(jax.grad(loss, argnums=(0, 1)), x, blocks)
    assert sorted(bwd) == ["block_sparse_dblocks", "block_sparse_dx", "block_sparse_matmul"]
