"""Block layouts for block-sparse weights: boolean numpy arrays `[k_blocks, n_blocks]`.

`layout[i, j]` says whether the weight block mapping input block row i to output block column j
exists. Layouts are static (numpy), so the kernels can turn them into index tables at trace time.
"""

from __future__ import annotations

import numpy as np


def _check_grid(k_blocks: int, n_blocks: int) -> None:
    if k_blocks < 1 or n_blocks < 1:
        raise ValueError(f"layout needs k_blocks, n_blocks >= 1; got {k_blocks}, {n_blocks}")


def random_layout(k_blocks: int, n_blocks: int, density: float, seed: int = 0) -> np.ndarray:
    """Exactly `round(density * k_blocks * n_blocks)` blocks (at least one if density > 0),
    placed uniformly at random; deterministic for a given seed."""
    _check_grid(k_blocks, n_blocks)
    if not 0.0 <= density <= 1.0:
        raise ValueError(f"density must be in [0, 1], got {density}")
    total = k_blocks * n_blocks
    nnz = 0 if density == 0 else max(1, int(round(density * total)))
    chosen = np.random.default_rng(seed).choice(total, size=nnz, replace=False)
    layout = np.zeros(total, dtype=bool)
    layout[chosen] = True
    return layout.reshape(k_blocks, n_blocks)


def banded_layout(k_blocks: int, n_blocks: int, bandwidth: int) -> np.ndarray:
    """Blocks within `bandwidth` of the (stretched) diagonal; `|i - j| <= bandwidth` if square."""
    _check_grid(k_blocks, n_blocks)
    if bandwidth < 0:
        raise ValueError(f"bandwidth must be >= 0, got {bandwidth}")
    i = np.arange(k_blocks)[:, None]
    j = np.arange(n_blocks)[None, :]
    return np.abs(i * n_blocks - j * k_blocks) <= bandwidth * max(k_blocks, n_blocks)


def strided_layout(k_blocks: int, n_blocks: int, stride: int) -> np.ndarray:
    """Every `stride`-th diagonal (`(i - j) % stride == 0`): each row and column gets an even
    share of blocks, a fixed pattern in the spirit of the Sparse Transformer's strided heads."""
    _check_grid(k_blocks, n_blocks)
    if stride < 1:
        raise ValueError(f"stride must be >= 1, got {stride}")
    i = np.arange(k_blocks)[:, None]
    j = np.arange(n_blocks)[None, :]
    return (i - j) % stride == 0


def block_diagonal_layout(k_blocks: int, n_blocks: int, groups: int) -> np.ndarray:
    """`groups` dense groups on the diagonal (grouped linear layer); both counts divisible."""
    _check_grid(k_blocks, n_blocks)
    if groups < 1 or k_blocks % groups or n_blocks % groups:
        raise ValueError(f"groups={groups} must divide k_blocks={k_blocks} and n_blocks={n_blocks}")
    i = np.arange(k_blocks)[:, None] // (k_blocks // groups)
    j = np.arange(n_blocks)[None, :] // (n_blocks // groups)
    return i == j


def density(layout: np.ndarray) -> float:
    """Fraction of blocks present."""
    return float(np.mean(layout))
