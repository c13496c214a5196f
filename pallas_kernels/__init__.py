"""Pallas kernels: fused flash attention and block-sparse layers (importable without zeroflow).

Flash attention and the block-sparse matmul are written for Pallas's Mosaic GPU backend (sm_90:
H100/H200) and run in Pallas's Mosaic GPU interpreter elsewhere (`pallas_kernels.attention_mgpu`,
`pallas_kernels.block_sparse`); jax's Triton module is never imported by them.
"""

from pallas_kernels.attention_mgpu import (
    TuningConfig,
    flash_attention,
    flash_attention_backward,
    flash_attention_forward,
    mosaic_gpu_problem,
)
from pallas_kernels.attention_xla import reference_attention
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
    "BlockSparseDense",
    "TuningConfig",
    "banded_layout",
    "block_diagonal_layout",
    "block_sparse_matmul",
    "flash_attention",
    "flash_attention_backward",
    "flash_attention_forward",
    "from_dense",
    "mosaic_gpu_problem",
    "random_layout",
    "reference_attention",
    "reference_block_sparse_matmul",
    "strided_layout",
    "to_dense",
]
