"""The fp32 partial sums of XLA:GPU's split-K rewrite (``Traits.splits_k``).

XLA:GPU cuts the contraction of a small matmul with a long contracted dimension into ``s``
chunks, computes them as one batched matmul into an ``s x M x N`` fp32 buffer and sums that
buffer: the weight gradient of a small layer (``M x N`` weights, contracted over the step's
tokens) holds ``s`` copies of itself while it is made. ``chunks`` is XLA's ``s`` as fitted to
what XLA:GPU compiles for an H100 (jaxlib 0.10.2 and 0.11.2 choose alike): XLA's published
heuristic (``ChooseSplitK`` in ``splitk_rewriter.cc``) does not reproduce it. On the grid of
``experiments/xla_gpu_split_k.py`` (``M, N`` 16-2048, ``K`` 128-131,072) the fit gives XLA's
``s`` on 144 of the 168 shapes. Most misses are off by a factor of two: at ``K`` = 131,072,
where XLA splits twice as far, and for 16-wide outputs with short contractions, which XLA
does not split. The worst miss is a factor of four (a 16 x 2048 output at ``K`` = 131,072).
``tests/test_estimator_on_xla_gpu.py`` checks the fit against XLA:GPU.
"""

from __future__ import annotations

import math

import numpy as np

H100_CORES = 132


def _pow2_floor(x: float) -> int:
    return 1 << int(math.floor(math.log2(x))) if x >= 1 else 1


def _pow2_ceil(x: float) -> int:
    return 1 << max(0, math.ceil(math.log2(x))) if x >= 1 else 1


def chunks(m: int, n: int, k: int, batch: int = 1, cores: int = H100_CORES) -> int:
    """The chunks XLA:GPU cuts a ``[batch] M x K @ K x N`` matmul's contraction into (1:
    none): the smaller of two bounds. Each chunk contracts at least ``s`` times as many
    elements as the output has 128 x 64 tiles (twice as many for a single tile), and the
    chunks times the output's 64 x 128 tiles stay near one and a half per core. Two or three
    chunks are not worth a split unless the tile bound is two."""
    m, n = min(m, n), max(m, n)
    fine_tiles = batch * math.ceil(m / 128) * math.ceil(n / 64)
    by_contraction = _pow2_floor(math.sqrt(k / max(2, fine_tiles)))
    coarse_tiles = batch * math.ceil(m / 64) * math.ceil(n / 128)
    by_tiles = _pow2_ceil(math.ceil((cores + cores // 2) / coarse_tiles))
    s = min(by_contraction, by_tiles)
    return s if s >= 4 or s == by_tiles == 2 else 1


def partial_sums_bytes(eqn) -> int:
    """The fp32 partial sums a ``dot_general`` equation (``.ins``, ``.params``) writes on
    XLA:GPU; 0 when its matmul is not split or is not a floating-point one."""
    lhs, rhs = eqn.ins[:2]
    if not all(np.issubdtype(np.dtype(v.aval.dtype), np.floating) for v in (lhs, rhs)):
        return 0
    (lhs_contract, _), (lhs_batch, _) = eqn.params["dimension_numbers"]
    k = math.prod(lhs.aval.shape[d] for d in lhs_contract)
    b = math.prod(lhs.aval.shape[d] for d in lhs_batch)
    m = math.prod(lhs.aval.shape) // (k * b)
    n = math.prod(rhs.aval.shape) // (k * b)
    s = chunks(m, n, k, b)
    return 0 if s == 1 else s * b * m * n * 4
