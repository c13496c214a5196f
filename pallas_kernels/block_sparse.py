"""Block-sparse matmul `x @ W` on Pallas' Mosaic GPU backend, where W exists only as its
nonzero blocks.

W `[K, N]` is described by a static boolean `layout [K // bs, N // bs]` and `blocks
[nnz, bs, bs]`, the present blocks in row-major order of `layout`'s True entries. W is never
formed: index tables built with numpy from the layout tell each program which blocks to visit.

* forward `y = x @ W`: one program per (row tile, output block column j); it pipelines the
  blocks of column j (x's tile at the block's row, the block itself) through shared memory
  into one fp32 accumulator.
* `dx = dy @ W^T`: the same kernel over the transposed layout, with each block transposed.
* `dblocks[t] = x[:, i_t]^T @ dy[:, j_t]`: one program per block (per pair of vertically
  adjacent blocks when bs = 32, since a warpgroup multiplies 64 rows at a time), pipelining
  the row tiles of x^T and dy.

A column's programs run as many pipeline steps as the fullest column has blocks (a pipeline's
length is static); the steps past a column's own blocks load a block and skip its multiply.
On a CPU the kernels run in jax's GPU interpreter; on a GPU they compile for sm_90 (Hopper).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels import _backend, _mgpu, _mosaic
from pallas_kernels._mgpu import lazy_plgpu as plgpu

BLOCK_SIZES = (32, 64, 128)
"Block sizes the kernels take: wgmma tiles whose shared-memory rows are 64-256 bytes."

ROW_TILES = (64, 128)
"Rows per program (`block_m`): multiples of a warpgroup's 64 rows."


@dataclasses.dataclass(frozen=True)
class _Gather:
    """For each output block column c: its `count[c]` blocks, as (block row `src[c, t]`, block
    id `block[c, t]`) for t < count[c], padded to the longest column with its last entry."""

    count: tuple[int, ...]
    src: tuple[tuple[int, ...], ...]
    block: tuple[tuple[int, ...], ...]

    @property
    def steps(self) -> int:
        return len(self.src[0])


@dataclasses.dataclass(frozen=True)
class _Plan:
    """Hashable index tables of one layout (a static argument of the custom_vjp)."""

    k_blocks: int
    n_blocks: int
    block_size: int
    block_row: tuple[int, ...]  # [nnz] layout row of each block (row-major order)
    block_col: tuple[int, ...]  # [nnz] layout column of each block
    by_col: _Gather  # the forward's tables: blocks of each layout column
    by_row: _Gather  # dx's tables: blocks of each layout row
    group_row: tuple[int, ...]  # dblocks: row group (`rows_per_group` block rows) of each program
    group_col: tuple[int, ...]  # dblocks: layout column of each program
    block_group: tuple[int, ...]  # [nnz] the dblocks program of each block

    @property
    def nnz(self) -> int:
        return len(self.block_row)

    @property
    def rows_per_group(self) -> int:
        """Block rows one dblocks program covers, so that its accumulator has >= 64 rows."""
        return max(1, _mosaic.WGMMA_ROWS // self.block_size)


def _gather(lines: np.ndarray, others: np.ndarray, ids: np.ndarray, count: int) -> _Gather:
    """Tables for blocks `ids` grouped by `lines` (the output block index), `others` the block
    index each one reads from the input."""
    counts = np.bincount(lines, minlength=count)
    steps = max(1, int(counts.max(initial=0)))
    src = np.zeros((count, steps), np.int64)
    block = np.zeros((count, steps), np.int64)
    order = np.lexsort((others, lines))
    start = 0
    for line, n in enumerate(counts):
        chosen = order[start : start + n]
        start += n
        if n:  # pad with the last entry: a valid block whose multiply is skipped
            chosen = np.concatenate([chosen, np.repeat(chosen[-1:], steps - n)])
            src[line], block[line] = others[chosen], ids[chosen]
    return _Gather(_ints(counts), tuple(map(_ints, src)), tuple(map(_ints, block)))


def _ints(values) -> tuple[int, ...]:
    return tuple(int(v) for v in np.ravel(values))


@functools.lru_cache(maxsize=256)
def _plan_cached(shape: tuple[int, int], packed: bytes, block_size: int) -> _Plan:
    layout = np.frombuffer(packed, dtype=bool).reshape(shape)
    rows, cols = np.nonzero(layout)  # row-major, the order of `blocks`
    ids = np.arange(len(rows))
    per_group = max(1, _mosaic.WGMMA_ROWS // block_size)
    groups, block_group = np.unique(
        np.stack([rows // per_group, cols], 1), axis=0, return_inverse=True
    )
    return _Plan(
        k_blocks=shape[0],
        n_blocks=shape[1],
        block_size=block_size,
        block_row=_ints(rows),
        block_col=_ints(cols),
        by_col=_gather(cols, rows, ids, shape[1]),
        by_row=_gather(rows, cols, ids, shape[0]),
        group_row=_ints(groups[:, 0]) if len(rows) else (),
        group_col=_ints(groups[:, 1]) if len(rows) else (),
        block_group=_ints(block_group),
    )


def make_plan(layout, block_size: int) -> _Plan:
    """The kernels' tables of `layout` with blocks of `block_size` (one of BLOCK_SIZES)."""
    if block_size not in BLOCK_SIZES or isinstance(block_size, bool):
        raise ValueError(f"block_size must be one of {BLOCK_SIZES}, got {block_size!r}")
    return _layout_plan(layout, block_size)


def _layout_plan(layout, block_size: int) -> _Plan:
    """The tables of `layout`, for any positive block size (`to_dense`/`from_dense` take any)."""
    layout = np.asarray(layout)
    if layout.ndim != 2 or layout.dtype != np.bool_:
        raise ValueError(
            f"layout must be a 2-D boolean numpy array, got {layout.dtype} {layout.shape}"
        )
    if not isinstance(block_size, int) or isinstance(block_size, bool) or block_size < 1:
        raise ValueError(f"block_size must be a positive integer, got {block_size!r}")
    return _plan_cached(layout.shape, np.ascontiguousarray(layout).tobytes(), block_size)


def _table(values) -> jax.Array:
    return jnp.asarray(np.asarray(values, dtype=np.int32))


# --------------------------------------------------------------------------- kernels


def _kernel(body, out_shape, grid: tuple[int, int], interpret: bool):
    return plgpu.kernel(
        body,
        out_type=out_shape,
        grid=grid,
        grid_names=("m", "c"),
        interpret=_mosaic.interpret_params() if interpret else None,
    )


def _store_tile(acc, out_gmem, rows, cols) -> None:
    """Write an fp32 accumulator to `out_gmem[rows, cols]` through shared memory."""

    def through(tile_smem):
        tile_smem[...] = acc.astype(tile_smem.dtype)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(tile_smem, out_gmem.at[rows, cols])
        plgpu.wait_smem_to_gmem(0)

    transforms = _mosaic.smem_transforms(out_gmem.dtype, acc.shape[1])
    pl.run_scoped(through, plgpu.SMEM(acc.shape, out_gmem.dtype, transforms=transforms))


def _gather_matmul(a, w2d, tables: _Gather, out_cols: int, cfg: _Config, name: str):
    """out[m tile, block column c] = sum over t < count[c] of a[m tile, block src[c, t]] @
    w2d[block block[c, t]] (each block of w2d transposed if cfg.right_transposed): the forward
    (column tables) and dx (row tables, blocks transposed)."""
    rows, bs, bm, steps = a.shape[0], w2d.shape[1], cfg.block_m, tables.steps
    a_tiles = _mosaic.smem_transforms(a.dtype, bs)

    def body(count_ref, src_ref, block_ref, a_gmem, w_gmem, out_gmem):
        m, c = lax.axis_index("m"), lax.axis_index("c")
        count = count_ref[c]

        def accumulate(acc_ref):
            def multiply(step, a_smem, w_smem):
                @pl.when(step[0] < count)
                def _():
                    plgpu.wgmma(acc_ref, a_smem, _right(w_smem, cfg))

            plgpu.emit_pipeline(
                multiply,
                grid=(steps,),
                max_concurrent_steps=2,
                in_specs=[  # delay_release: wgmma reads its operands asynchronously
                    plgpu.BlockSpec(
                        (bm, bs), lambda t: (m, src_ref[c, t]), transforms=a_tiles, delay_release=1
                    ),
                    plgpu.BlockSpec(
                        (bs, bs),
                        lambda t: (block_ref[c, t], 0),
                        transforms=a_tiles,
                        delay_release=1,
                    ),
                ],
            )(a_gmem, w_gmem)
            return acc_ref[...]

        acc = pl.run_scoped(accumulate, plgpu.ACC((bm, bs), jnp.float32))
        _store_tile(acc, out_gmem, pl.ds(m * bm, bm), pl.ds(c * bs, bs))

    body.__name__ = name
    out = _backend.out_struct((rows, out_cols), a.dtype, a, w2d)
    out = _kernel(body, out, (rows // bm, out_cols // bs), cfg.interpret)(
        _table(tables.count), _table(tables.src), _table(tables.block), a, w2d
    )
    return _mosaic.vary_like(out, a, w2d)


def _block_grads(x_t, dy, plan: _Plan, cfg: _Config, dtype):
    """[groups, rows_per_group * bs, bs]: program p's x^T rows of row group group_row[p] times
    dy's columns of block column group_col[p] (dy transposed if cfg.right_transposed), summed
    over every row tile."""
    bs, bm = plan.block_size, cfg.block_m
    tall = plan.rows_per_group * bs
    groups = len(plan.group_row)
    # wgmma wants both operands swizzled alike: the swizzle the narrower tile row allows.
    tiles = _mosaic.smem_transforms(dy.dtype, min(bm, bs))
    dy_block = (bs, bm) if cfg.right_transposed else (bm, bs)

    def dy_index(r, col):
        return (col, r) if cfg.right_transposed else (r, col)

    def block_sparse_dblocks(row_ref, col_ref, x_gmem, dy_gmem, out_gmem):
        p = lax.axis_index("m")
        row, col = row_ref[p], col_ref[p]

        def accumulate(acc_ref):
            def multiply(_, x_smem, dy_smem):
                plgpu.wgmma(acc_ref, x_smem, _right(dy_smem, cfg))

            plgpu.emit_pipeline(
                multiply,
                grid=(x_gmem.shape[1] // bm,),
                max_concurrent_steps=2,
                in_specs=[
                    plgpu.BlockSpec(
                        (tall, bm), lambda r: (row, r), transforms=tiles, delay_release=1
                    ),
                    plgpu.BlockSpec(
                        dy_block, lambda r: dy_index(r, col), transforms=tiles, delay_release=1
                    ),
                ],
            )(x_gmem, dy_gmem)
            return acc_ref[...]

        acc = pl.run_scoped(accumulate, plgpu.ACC((tall, bs), jnp.float32))
        _store_tile(acc, out_gmem, pl.ds(p * tall, tall), pl.ds(0, bs))

    out = _backend.out_struct((groups * tall, bs), dtype, x_t, dy)
    grads = _kernel(block_sparse_dblocks, out, (groups, 1), cfg.interpret)(
        _table(plan.group_row), _table(plan.group_col), x_t, dy
    )
    return _mosaic.vary_like(grads, x_t, dy).reshape(groups, plan.rows_per_group, bs, bs)


# --------------------------------------------------------------------------- wrappers


@dataclasses.dataclass(frozen=True)
class _Config:
    block_m: int
    interpret: bool
    # wgmma reads a right operand whose minor axis is N (as stored) only for 16-bit dtypes; fp32
    # (TF32) needs it stored [N, K] and read transposed. jax 0.10's GPU interpreter does not
    # read transposed operands, so only compiled fp32 kernels store it so.
    right_transposed: bool = False


def _right_operand(blocks, cfg: _Config):
    """Blocks `[nnz, K, N]` in the layout the right operand is stored in (see _Config)."""
    return blocks.transpose(0, 2, 1) if cfg.right_transposed else blocks


def _right(ref, cfg: _Config):
    """The right operand's shared-memory tile as wgmma reads it, `[K, N]`. (The ref's own
    transpose: what ``plgpu.transpose_ref`` does on jax 0.10-0.12, deprecated from 0.12.)"""
    return ref.transpose((1, 0)) if cfg.right_transposed else ref


def _forward(x, blocks, plan: _Plan, cfg: _Config):
    w2d = _right_operand(blocks, cfg).reshape(plan.nnz * plan.block_size, plan.block_size)
    return _gather_matmul(
        x, w2d, plan.by_col, plan.n_blocks * plan.block_size, cfg, "block_sparse_matmul"
    )


def _backward(plan: _Plan, cfg: _Config, residuals, dy):
    x, blocks = residuals
    dy = dy.astype(x.dtype)
    bs = plan.block_size
    w_t = _right_operand(blocks.transpose(0, 2, 1), cfg).reshape(plan.nnz * bs, bs)
    dx = _gather_matmul(dy, w_t, plan.by_row, plan.k_blocks * bs, cfg, "block_sparse_dx")
    # x^T in XLA (a pass over x, not a matmul): wgmma's left operand has its contraction axis
    # minor (fp32 takes no other form).
    tall_rows = _backend.round_up(x.shape[1], plan.rows_per_group * bs)
    x_t = jnp.pad(x, ((0, 0), (0, tall_rows - x.shape[1]))).T
    grads = _block_grads(x_t, dy.T if cfg.right_transposed else dy, plan, cfg, blocks.dtype)
    within = np.asarray(plan.block_row) % plan.rows_per_group
    dblocks = grads[np.asarray(plan.block_group), within]
    return _backend.match_varying(dx, x), _backend.match_varying(dblocks, blocks)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _block_sparse_matmul(x, blocks, plan: _Plan, cfg: _Config):
    return _forward(x, blocks, plan, cfg)


def _block_sparse_matmul_fwd(x, blocks, plan: _Plan, cfg: _Config):
    return _forward(x, blocks, plan, cfg), (x, blocks)


_block_sparse_matmul.defvjp(_block_sparse_matmul_fwd, _backward)


def block_sparse_matmul(
    x, blocks, layout, block_size: int, *, block_m: int = 64, interpret: bool | None = None
):
    """`x @ W` for the block-sparse W given by (`blocks`, `layout`, `block_size`).

    Args:
      x: `[..., K]`; leading dims are flattened into rows (padded to a multiple of block_m).
      blocks: `[nnz, bs, bs]`, the present blocks in row-major order of `layout`.
      layout: static boolean numpy array `[K // bs, N // bs]`.
      block_size: bs, one of `BLOCK_SIZES` (32, 64, 128).
      block_m: rows per program, one of `ROW_TILES` (64, 128).
      interpret: None: the Mosaic GPU kernels on a GPU, XLA's dense product elsewhere. True:
        the kernels in jax's GPU interpreter on the CPU (for tests; not inside a multi-device
        shard_map, nor, from jax 0.11, inside flax's nn.scan). False: compiled.

    Returns:
      `[..., N]` in the promoted dtype of x and blocks, accumulated in fp32 (fp32 inputs
      multiply as TF32 on a GPU).
    """
    plan = make_plan(layout, block_size)
    k, n = plan.k_blocks * block_size, plan.n_blocks * block_size
    if x.shape[-1] != k:
        raise ValueError(
            f"x has {x.shape[-1]} features; layout {np.shape(layout)} x block "
            f"{block_size} needs {k}"
        )
    if tuple(blocks.shape) != (plan.nnz, block_size, block_size):
        raise ValueError(
            f"blocks must be {(plan.nnz, block_size, block_size)} for this layout, "
            f"got {tuple(blocks.shape)}"
        )
    if block_m not in ROW_TILES or isinstance(block_m, bool):
        raise ValueError(f"block_m must be one of {ROW_TILES}, got {block_m!r}")

    dtype = jnp.result_type(x, blocks)
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k).astype(dtype)
    if plan.nnz == 0:
        return jnp.zeros((*lead, n), dtype)
    if interpret is None and _backend.target_platform() != "gpu":
        # Not on a GPU: XLA's product with the dense matrix (jax's GPU interpreter is for tests:
        # it is slow, its ordered callbacks break flax's nn.scan from jax 0.11, and see below).
        y = jnp.matmul(
            x2,
            to_dense(blocks.astype(dtype), layout, block_size),
            preferred_element_type=jnp.float32,
        )
        return y.astype(dtype).reshape(*lead, n)
    if interpret and _manual_devices() > 1:
        raise ValueError(
            f"block_sparse_matmul(interpret=True) cannot run inside a shard_map over "
            f"{_manual_devices()} devices (jax's GPU interpreter makes their kernels "
            "wait for each other); use interpret=None"
        )
    if not interpret:
        _mgpu.require_compilable()
    rows = x2.shape[0]
    padded = _backend.round_up(max(rows, 1), block_m)
    if padded != rows:
        x2 = jnp.pad(x2, ((0, padded - rows), (0, 0)))
    cfg = _Config(
        block_m=block_m,
        interpret=bool(interpret),
        right_transposed=not interpret and jnp.dtype(dtype).itemsize == 4,
    )
    y = _block_sparse_matmul(x2, blocks.astype(dtype), plan, cfg)
    return y[:rows].reshape(*lead, n)


def _manual_devices() -> int:
    """How many devices the `shard_map` being traced runs on (1 outside one).

    Interpreted, the kernel of every device meets the others' at one process-wide barrier
    (jax's GPU interpreter simulates the devices of one program together); XLA:CPU may run the
    devices' kernels one after the other, the first waiting forever (seen on 2 cores).
    """
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return 1
    return math.prod(mesh.shape[axis] for axis in mesh.manual_axes)


def to_dense(blocks, layout, block_size: int):
    """The dense `[K, N]` matrix with `blocks` at `layout`'s True entries, zeros elsewhere."""
    plan = _layout_plan(layout, block_size)
    grid = jnp.zeros((plan.k_blocks, plan.n_blocks, block_size, block_size), blocks.dtype)
    grid = grid.at[np.asarray(plan.block_row, int), np.asarray(plan.block_col, int)].set(blocks)
    return grid.transpose(0, 2, 1, 3).reshape(
        plan.k_blocks * block_size, plan.n_blocks * block_size
    )


def from_dense(w, layout, block_size: int):
    """The `[nnz, bs, bs]` blocks of `w` at `layout`'s True entries (inverse of `to_dense`)."""
    plan = _layout_plan(layout, block_size)
    grid = w.reshape(plan.k_blocks, block_size, plan.n_blocks, block_size).transpose(0, 2, 1, 3)
    return grid[np.asarray(plan.block_row, int), np.asarray(plan.block_col, int)]


def reference_block_sparse_matmul(x, blocks, layout, block_size: int):
    """`x @ to_dense(...)` in fp32 with precision="highest"."""
    w = to_dense(blocks.astype(jnp.float32), layout, block_size)
    return jnp.matmul(x.astype(jnp.float32), w, precision="highest")
