"""Block-sparse matmul `x @ W` in Pallas, where W exists only as its nonzero blocks.

W `[K, N]` is described by a static boolean `layout [K // bs, N // bs]` and `blocks
[nnz, bs, bs]`, the present blocks in row-major order of `layout`'s True entries. W is never
formed: index tables built with numpy from the layout tell each program which blocks to visit.

* forward  `y = x @ W`: one program per (row tile, output block column j); it loops over the
  blocks of column j only (CSC tables).
* `dx = dy @ W^T`: the same kernel over the transposed layout (CSR tables; because `blocks`
  is row-major, the blocks of row i are the contiguous range row_start[i]:row_start[i+1]).
* `dblocks[t] = x[:, i_t]^T @ dy[:, j_t]`: one program per present block, looping over rows.

The tables are passed as ordinary int32 inputs (the Triton backend has no scalar prefetch).
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels import _backend


@dataclasses.dataclass(frozen=True)
class _Plan:
    """Hashable index tables of one layout (a static argument of the custom_vjp)."""

    k_blocks: int
    n_blocks: int
    block_size: int
    block_row: tuple[int, ...]  # [nnz] layout row of each block (row-major order)
    block_col: tuple[int, ...]  # [nnz] layout column of each block
    row_start: tuple[int, ...]  # [k_blocks + 1] CSR offsets: blocks of row i
    col_start: tuple[int, ...]  # [n_blocks + 1] CSC offsets into col_order
    col_order: tuple[int, ...]  # [nnz] block ids sorted by (column, row)

    @property
    def nnz(self) -> int:
        return len(self.block_row)


@functools.lru_cache(maxsize=256)
def _plan_cached(shape: tuple[int, int], packed: bytes, block_size: int) -> _Plan:
    layout = np.frombuffer(packed, dtype=bool).reshape(shape)
    rows, cols = np.nonzero(layout)  # row-major, the order of `blocks`
    col_order = np.lexsort((rows, cols))
    offsets = lambda counts: tuple(int(c) for c in np.concatenate([[0], np.cumsum(counts)]))
    return _Plan(
        k_blocks=shape[0], n_blocks=shape[1], block_size=block_size,
        block_row=tuple(int(r) for r in rows), block_col=tuple(int(c) for c in cols),
        row_start=offsets(layout.sum(axis=1)), col_start=offsets(layout.sum(axis=0)),
        col_order=tuple(int(t) for t in col_order),
    )


def make_plan(layout, block_size: int) -> _Plan:
    layout = np.asarray(layout)
    if layout.ndim != 2 or layout.dtype != np.bool_:
        raise ValueError(f"layout must be a 2-D boolean numpy array, got {layout.dtype} "
                         f"{layout.shape}")
    if not _backend.is_power_of_two(block_size):
        raise ValueError(f"block_size must be a positive power of two, got {block_size!r}")
    return _plan_cached(layout.shape, np.ascontiguousarray(layout).tobytes(), block_size)


def _table(values) -> jax.Array:
    return jnp.asarray(np.asarray(values, dtype=np.int32))


# --------------------------------------------------------------------------- kernels


def _gather_matmul_kernel(start_ref, src_ref, block_id_ref, a_ref, w_ref, out_ref, *,
                          block_size, transpose_w):
    """out[:, c] = sum_t a[:, src[t]] @ w[block_id[t]] (or its transpose) for t in c's range."""
    c = pl.program_id(1)

    def visit_block(t, acc):
        col = pl.multiple_of(src_ref[t] * block_size, block_size)
        a = a_ref[:, pl.ds(col, block_size)]
        w = w_ref[block_id_ref[t]]
        dims = (((1,), (1 if transpose_w else 0,)), ((), ()))
        return acc + lax.dot_general(a, w, dims, preferred_element_type=jnp.float32)

    acc = jnp.zeros(out_ref.shape, jnp.float32)
    acc = lax.fori_loop(start_ref[c], start_ref[c + 1], visit_block, acc)
    out_ref[...] = acc.astype(out_ref.dtype)


def _block_grad_kernel(row_ref, col_ref, x_ref, dy_ref, dblock_ref, *, block_size, block_m):
    """dblock[t] = x[:, row t]^T @ dy[:, col t], accumulated over row tiles."""
    t = pl.program_id(0)
    x_col = pl.multiple_of(row_ref[t] * block_size, block_size)
    dy_col = pl.multiple_of(col_ref[t] * block_size, block_size)

    def visit_rows(m, acc):
        rows = pl.ds(pl.multiple_of(m * block_m, block_m), block_m)
        x = x_ref[rows, pl.ds(x_col, block_size)]
        dy = dy_ref[rows, pl.ds(dy_col, block_size)]
        dims = (((0,), (0,)), ((), ()))
        return acc + lax.dot_general(x, dy, dims, preferred_element_type=jnp.float32)

    acc = jnp.zeros((block_size, block_size), jnp.float32)
    acc = lax.fori_loop(*_backend.traced_bounds(0, x_ref.shape[0] // block_m), visit_rows, acc)
    dblock_ref[...] = acc.astype(dblock_ref.dtype)


# --------------------------------------------------------------------------- wrappers


@dataclasses.dataclass(frozen=True)
class _Config:
    block_m: int
    interpret: bool
    num_warps: int = 4
    num_stages: int = 2


def _options(cfg: _Config):
    return _backend.pallas_call_options(cfg.interpret, num_warps=cfg.num_warps,
                                        num_stages=cfg.num_stages)


def _gather_matmul(a, blocks, start, src, block_id, out_cols: int, cfg: _Config, *,
                   transpose_w: bool):
    """Shared by the forward (CSC tables) and dx (CSR tables, transposed blocks)."""
    rows, bs, bm = a.shape[0], blocks.shape[1], cfg.block_m
    whole = lambda x: pl.BlockSpec(x.shape, lambda m, c: (0,) * x.ndim)
    return pl.pallas_call(
        functools.partial(_gather_matmul_kernel, block_size=bs, transpose_w=transpose_w),
        grid=(rows // bm, out_cols // bs),
        in_specs=[whole(start), whole(src), whole(block_id),
                  pl.BlockSpec((bm, a.shape[1]), lambda m, c: (m, 0)), whole(blocks)],
        out_specs=pl.BlockSpec((bm, bs), lambda m, c: (m, c)),
        out_shape=_backend.out_struct((rows, out_cols), a.dtype, a, blocks),
        name="block_sparse_dx" if transpose_w else "block_sparse_matmul",
        **_options(cfg),
    )(start, src, block_id, a, blocks)


def _forward(x, blocks, plan: _Plan, cfg: _Config):
    col_rows = np.asarray(plan.block_row)[list(plan.col_order)]
    return _gather_matmul(x, blocks, _table(plan.col_start), _table(col_rows),
                          _table(plan.col_order), plan.n_blocks * plan.block_size, cfg,
                          transpose_w=False)


def _backward(plan: _Plan, cfg: _Config, residuals, dy):
    x, blocks = residuals
    dy = dy.astype(x.dtype)
    dx = _gather_matmul(dy, blocks, _table(plan.row_start), _table(plan.block_col),
                        _table(np.arange(plan.nnz)), plan.k_blocks * plan.block_size, cfg,
                        transpose_w=True)
    bs = plan.block_size
    rows, cols = _table(plan.block_row), _table(plan.block_col)
    whole = lambda a: pl.BlockSpec(a.shape, lambda t: (0,) * a.ndim)
    dblocks = pl.pallas_call(
        functools.partial(_block_grad_kernel, block_size=bs, block_m=cfg.block_m),
        grid=(plan.nnz,),
        in_specs=[whole(rows), whole(cols), whole(x), whole(dy)],
        out_specs=pl.BlockSpec((None, bs, bs), lambda t: (t, 0, 0)),
        out_shape=_backend.out_struct(blocks.shape, blocks.dtype, x, dy, blocks),
        name="block_sparse_dblocks",
        **_options(cfg),
    )(rows, cols, x, dy)
    return _backend.match_varying(dx, x), _backend.match_varying(dblocks, blocks)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _block_sparse_matmul(x, blocks, plan: _Plan, cfg: _Config):
    return _forward(x, blocks, plan, cfg)


def _block_sparse_matmul_fwd(x, blocks, plan: _Plan, cfg: _Config):
    return _forward(x, blocks, plan, cfg), (x, blocks)


_block_sparse_matmul.defvjp(_block_sparse_matmul_fwd, _backward)


def block_sparse_matmul(x, blocks, layout, block_size: int, *, block_m: int = 64,
                        interpret: bool | None = None):
    """`x @ W` for the block-sparse W given by (`blocks`, `layout`, `block_size`).

    Args:
      x: `[..., K]`; leading dims are flattened into rows.
      blocks: `[nnz, bs, bs]`, the present blocks in row-major order of `layout`.
      layout: static boolean numpy array `[K // bs, N // bs]`.
      block_size: bs, a power of two (>= 16 for the compiled Triton path).
      block_m: rows per program (power of two; shrunk for small inputs).
      interpret: None runs compiled on GPU and in the Pallas interpreter elsewhere.

    Returns:
      `[..., N]` in the promoted dtype of x and blocks, accumulated in fp32.
    """
    plan = make_plan(layout, block_size)
    k, n = plan.k_blocks * block_size, plan.n_blocks * block_size
    if x.shape[-1] != k:
        raise ValueError(f"x has {x.shape[-1]} features; layout {np.shape(layout)} x block "
                         f"{block_size} needs {k}")
    if tuple(blocks.shape) != (plan.nnz, block_size, block_size):
        raise ValueError(f"blocks must be {(plan.nnz, block_size, block_size)} for this layout, "
                         f"got {tuple(blocks.shape)}")
    if not _backend.is_power_of_two(block_m):
        raise ValueError(f"block_m must be a positive power of two, got {block_m!r}")
    interpret = _backend.resolve_interpret(interpret)
    if not interpret and block_size < _backend.MIN_TRITON_DOT_DIM:
        raise ValueError(f"the Triton backend needs block_size >= 16, got {block_size}")

    dtype = jnp.result_type(x, blocks)
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k).astype(dtype)
    if plan.nnz == 0:
        return jnp.zeros((*lead, n), dtype)
    rows = x2.shape[0]
    bm = _backend.fit_block(block_m, rows)
    padded = _backend.round_up(rows, bm)
    if padded != rows:
        x2 = jnp.pad(x2, ((0, padded - rows), (0, 0)))
    cfg = _Config(block_m=bm, interpret=interpret)
    y = _block_sparse_matmul(x2, blocks.astype(dtype), plan, cfg)
    return y[:rows].reshape(*lead, n)


def to_dense(blocks, layout, block_size: int):
    """The dense `[K, N]` matrix with `blocks` at `layout`'s True entries, zeros elsewhere."""
    plan = make_plan(layout, block_size)
    grid = jnp.zeros((plan.k_blocks, plan.n_blocks, block_size, block_size), blocks.dtype)
    grid = grid.at[np.asarray(plan.block_row, int), np.asarray(plan.block_col, int)].set(blocks)
    return grid.transpose(0, 2, 1, 3).reshape(plan.k_blocks * block_size,
                                              plan.n_blocks * block_size)


def from_dense(w, layout, block_size: int):
    """The `[nnz, bs, bs]` blocks of `w` at `layout`'s True entries (inverse of `to_dense`)."""
    plan = make_plan(layout, block_size)
    grid = w.reshape(plan.k_blocks, block_size, plan.n_blocks, block_size).transpose(0, 2, 1, 3)
    return grid[np.asarray(plan.block_row, int), np.asarray(plan.block_col, int)]


def reference_block_sparse_matmul(x, blocks, layout, block_size: int):
    """`x @ to_dense(...)` in fp32 with precision="highest"."""
    w = to_dense(blocks.astype(jnp.float32), layout, block_size)
    return jnp.matmul(x.astype(jnp.float32), w, precision="highest")
