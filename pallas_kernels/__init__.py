"""Pallas kernels: fused flash attention and block-sparse layers (importable without zeroflow).

On a GPU flash attention compiles with the Pallas Triton backend and the block-sparse matmul with
the Mosaic GPU backend (Hopper); elsewhere they run in Pallas' interpreters (see
`pallas_kernels._backend`). jax's Triton module is imported only when a Triton kernel is built.
"""

from pallas_kernels.attention import (
    BlockSizes,
    flash_attention,
    flash_attention_backward,
    flash_attention_forward,
    reference_attention,
)
from pallas_kernels.block_sparse import (
    block_sparse_matmul,
    from_dense,
    reference_block_sparse_matmul,
    to_dense,
)
from pallas_kernels.layers import BlockSparseDense
from pallas_kernels.layouts import (
    banded_layout,
    block_diagonal_layout,
    random_layout,
    strided_layout,
)

__all__ = [
    "BlockSizes",
    "BlockSparseDense",
    "banded_layout",
    "block_diagonal_layout",
    "block_sparse_matmul",
    "flash_attention",
    "flash_attention_backward",
    "flash_attention_forward",
    "from_dense",
    "random_layout",
    "reference_attention",
    "reference_block_sparse_matmul",
    "strided_layout",
    "to_dense",
]
