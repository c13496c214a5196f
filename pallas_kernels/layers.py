"""Flax linen layers built on the kernels."""

from __future__ import annotations

import math
from typing import Any, cast

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import layouts
from pallas_kernels.block_sparse import block_sparse_matmul


class BlockSparseDense(nn.Module):
    """`y = x @ W (+ b)` with W block-sparse: only `blocks [nnz, bs, bs]` is a parameter.

    The layout is static: a numpy function of (in features, features, block_size, density,
    layout_seed), rebuilt identically at init and apply and never stored in the params.
    """

    features: int  # output width N, a multiple of block_size
    block_size: int = 32  # side of a weight block: 32, 64 or 128 (block_sparse.BLOCK_SIZES)
    density: float = 0.25  # fraction of the [K/bs, N/bs] blocks that exist
    layout_seed: int = 0  # seed of the random layout (different per projection)
    kernel_axes: tuple = ("embed", "mlp")  # logical names of W's (in, out); the bias uses out
    use_bias: bool = False
    dtype: Any = None  # compute dtype; None: the params' dtype (fp32 accumulation regardless)
    param_dtype: Any = jnp.float32
    stddev: float | None = None  # init std of the blocks; None: 1/sqrt(expected fan-in)
    interpret: bool | None = None  # block_sparse_matmul's: None compiles on a GPU

    def layout(self, in_features: int) -> np.ndarray:
        bs = self.block_size
        for name, size in (("input features", in_features), ("features", self.features)):
            if size % bs:
                raise ValueError(
                    f"BlockSparseDense: {name}={size} is not a multiple of block_size={bs}"
                )
        return layouts.random_layout(
            in_features // bs, self.features // bs, self.density, seed=self.layout_seed
        )

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        in_features = x.shape[-1]
        layout = self.layout(in_features)
        bs = self.block_size
        nnz = int(layout.sum())
        fan_in = max(1.0, self.density * in_features)
        std = self.stddev if self.stddev is not None else 1.0 / math.sqrt(fan_in)
        # Module.param unboxes the LogicallyPartitioned its initializer returns (unbox=True),
        # but flax types it as the initializer's return.
        blocks = cast(
            jax.Array,
            self.param(
                "blocks",
                nn.with_logical_partitioning(nn.initializers.normal(std), (None, None, None)),
                (nnz, bs, bs),
                self.param_dtype,
            ),
        )
        dtype = self.dtype or blocks.dtype
        y = block_sparse_matmul(
            x.astype(dtype), blocks.astype(dtype), layout, bs, interpret=self.interpret
        )
        if self.use_bias:
            bias = cast(
                jax.Array,
                self.param(
                    "bias",
                    nn.with_logical_partitioning(nn.initializers.zeros, (self.kernel_axes[1],)),
                    (self.features,),
                    self.param_dtype,
                ),
            )
            y = y + bias.astype(dtype)
        return y
