"""Flash attention on Pallas's Mosaic GPU backend (sm_90: H100, H200).

Layout is that of `jax.nn.dot_product_attention`: q `[batch, q_len, heads, head_dim]`,
k and v `[batch, kv_len, kv_heads, head_dim]` with `heads % kv_heads == 0` (MHA, GQA, MQA).

One warpgroup (128 threads) per CTA owns 64 query rows (a wgmma's M) of one head. Tiles move
from global to shared memory by TMA, two kv blocks in flight: the copy of block j + 1 is
issued before block j is computed. Every matmul is a wgmma with its B operand in shared
memory in [K, N] order. Where the algorithm needs a transposed operand (K^T for the scores,
Q^T, dO^T and V^T in the backward pass) the wrapper hands the kernel a transposed copy made
by XLA (O(seq) bytes, against the kernel's O(seq^2) work), so the kernels never transpose a
shared-memory tile; jax's transposed-ref API differs between versions and its GPU
interpreter cannot run it on jax 0.10.2.

Forward: online softmax over the visible kv blocks; saves the output and the log-sum-exp.
Backward: `delta = rowsum(dO * O)` in XLA, then one kernel per q block for dQ and one per
kv block for dK/dV (walking the q heads that share the kv head), both recomputing the
probabilities from the saved log-sum-exp.

Causal and sliding-window attention shrink the loop bounds, so blocks outside the band are
never loaded; segment ids (packed rows) and the padded tail are masked inside the visited
blocks. A row that sees no key gets output 0 and lse +inf (-inf from
`flash_attention_forward`), and its probabilities are exactly 0 in the backward pass.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels import _backend, _mgpu
from pallas_kernels.attention_xla import (
    Band,
    segment_pair,
)

# Finite, so that a block whose scores are all masked never produces inf - inf.
_MASK_VALUE = -0.7 * float(np.finfo(np.float32).max)
# One warpgroup computes 64 rows per wgmma: the q tile of every kernel here.
_ROWS = 64
# Shared-memory tiles are (8, 128 bytes) with the 128-byte swizzle, what wgmma reads fastest.
_SWIZZLE = 128
# Head dims up to 128 (padded inside to 64 or 128): the dK/dV kernel keeps two fp32 [64, D]
# accumulators in one warpgroup's registers and four [64, D] tiles per q step in shared memory.
MAX_HEAD_DIM = 128
DTYPES = (jnp.bfloat16, jnp.float16)


@dataclasses.dataclass(frozen=True)
class TuningConfig:
    """Tiles of the Mosaic GPU kernels: kv rows per step of the forward loop (``block_k``) and
    of the dQ loop (``block_k_dq``), 64 or 128 (ValueError otherwise). Every kernel's q tile
    is 64 rows (one warpgroup's wgmma), and a dK/dV program owns 64 kv rows. Unmeasured
    starting points: a GPU run decides."""

    block_k: int = 128
    block_k_dq: int = 64

    def __post_init__(self):
        for name in ("block_k", "block_k_dq"):
            value = getattr(self, name)
            if value not in (64, 128) or isinstance(value, bool):
                raise ValueError(f"TuningConfig.{name} must be 64 or 128; got {value!r}")


@dataclasses.dataclass(frozen=True)
class _Geometry:
    """Static shapes after padding the sequences to whole tiles and head_dim to 64."""

    batch: int
    heads: int
    kv_heads: int
    q_len: int
    kv_len: int
    head_dim: int
    q_pad: int
    kv_pad: int
    dim_pad: int
    block_k: int
    block_k_dq: int

    @classmethod
    def of(cls, q, k, tuning: TuningConfig) -> _Geometry:
        batch, q_len, heads, head_dim = q.shape
        kv_len, kv_heads = k.shape[1], k.shape[2]
        block_k = min(tuning.block_k, _backend.round_up(kv_len, 64))
        block_k_dq = min(tuning.block_k_dq, _backend.round_up(kv_len, 64))
        return cls(
            batch,
            heads,
            kv_heads,
            q_len,
            kv_len,
            head_dim,
            q_pad=_backend.round_up(q_len, _ROWS),
            kv_pad=_backend.round_up(kv_len, max(block_k, block_k_dq)),
            dim_pad=_backend.round_up(head_dim, 64),
            block_k=block_k,
            block_k_dq=block_k_dq,
        )

    @property
    def group(self) -> int:
        return self.heads // self.kv_heads

    def needs_mask(self, band: Band, block_k: int, segmented: bool) -> bool:
        return segmented or band.bounded or self.kv_len % block_k != 0

    def pad(self, x, seq_pad: int):
        extra = ((0, 0), (0, seq_pad - x.shape[1]), (0, 0), (0, self.dim_pad - x.shape[3]))
        return jnp.pad(x, extra) if any(hi for _, hi in extra) else x

    @staticmethod
    def pad_ids(ids, seq_pad: int):
        return (
            jnp.pad(ids, ((0, 0), (0, seq_pad - ids.shape[1]))) if seq_pad > ids.shape[1] else ids
        )


@dataclasses.dataclass(frozen=True)
class _Config:
    band: Band
    sm_scale: float
    tuning: TuningConfig
    interpret: bool


# --------------------------------------------------------------------------- kernel helpers


def _smem(shape, dtype):
    """A shared-memory tile in wgmma's preferred layout ((8, 128-byte) tiles, swizzled)."""
    plgpu = _mgpu.plgpu()
    minor = _SWIZZLE // jnp.dtype(dtype).itemsize
    transforms = (plgpu.TilingTransform((8, minor)), plgpu.SwizzleTransform(_SWIZZLE))
    return plgpu.SMEM(shape, dtype, transforms=transforms)


def _matmul(a, b_smem, shape):
    """fp32 ``a @ b`` by wgmma: ``a`` a shared-memory tile or registers, ``b`` in shared memory
    in [K, N] order; waits for the result."""
    plgpu = _mgpu.plgpu()

    def run(acc):
        plgpu.wgmma(acc, a, b_smem)
        plgpu.wgmma_wait(0)
        return acc[...]

    return pl.run_scoped(run, plgpu.ACC(shape, jnp.float32))


def _rows(vector, shape):
    return lax.broadcast_in_dim(vector, shape, [0])


class _Layouts:
    """Register layouts of wgmma results. The GPU interpreter runs plain jnp arrays and has no
    rule for layout casts, so with ``interpret`` they are left out."""

    def __init__(self, interpret: bool):
        self.interpret = interpret
        self.plgpu = _mgpu.plgpu()

    def _layout(self, reduced: int | None):
        layout = self.plgpu.Layout.WGMMA
        return None if self.interpret else (layout if reduced is None else layout.reduce(reduced))

    def cast(self, x, reduced: int | None = None):
        layout = self._layout(reduced)
        return x if layout is None else self.plgpu.layout_cast(x, layout)

    def _load_whole(self, ref, layout):
        """The whole of ``ref`` in ``layout``: jax 0.10-0.11 take the index ``()`` for it, 0.12
        dropped the index argument."""
        if "idx" in inspect.signature(self.plgpu.load).parameters:
            return self.plgpu.load(ref, (), layout=layout)
        return self.plgpu.load(ref, layout=layout)

    def rows_of(self, ref):
        """A [rows] shared-memory vector in the layout of a wgmma result's rows."""
        return ref[...] if self.interpret else self._load_whole(ref, self._layout(1))

    def columns_of(self, ref):
        """A [cols] shared-memory vector in the layout of a wgmma result's columns."""
        return ref[...] if self.interpret else self._load_whole(ref, self._layout(0))

    def operand(self, x, smem):
        """``x`` (registers) as a wgmma A operand. The GPU interpreter's wgmma reads A only from
        shared memory, so there ``x`` goes through the ``smem`` tile; compiled, it stays in
        registers (the wgmma is the same product)."""
        if not self.interpret:
            return x
        smem[...] = x
        return smem

    def iota(self, shape, dim):
        return self.plgpu.broadcasted_iota(jnp.int32, shape, dim, layout=self._layout(None))

    def visible(self, q_start, k_start, shape, band: Band, kv_len: int, keys_on_rows=False):
        """Boolean [rows, cols] (queries by keys, or keys by queries): the band and the padded
        kv tail."""
        rows = q_start + self.iota(shape, 1 if keys_on_rows else 0)
        cols = k_start + self.iota(shape, 0 if keys_on_rows else 1)
        keep = cols < kv_len
        if band.left is not None:
            keep = keep & (cols >= rows - band.left)
        if band.right is not None:
            keep = keep & (cols <= rows + band.right)
        return keep


def _block_range(start, block: int, other_block: int, num_other: int, behind, ahead):
    """[lo, hi) of the other axis's blocks that ``block`` rows from ``start`` can see, when row
    r sees columns r - behind .. r + ahead (None: no limit)."""
    lo = jnp.int32(0) if behind is None else lax.div(jnp.maximum(start - behind, 0), other_block)
    hi = jnp.int32(num_other)
    if ahead is not None:
        hi = jnp.minimum(lax.div(start + block - 1 + ahead, other_block) + 1, num_other)
    return lo, jnp.maximum(hi, lo)


class _Pipeline:
    """Two-slot TMA pipeline over blocks ``lo <= j < hi``: ``start`` fetches ``lo``, ``step(j)``
    fetches ``j + 1`` into the other slot (whose last reader has finished) and waits for ``j``.
    ``copies(j)`` lists (global ref view, shared slots, barriers) of block j."""

    def __init__(self, copies, lo, hi):
        self.copies, self.lo, self.hi = copies, lo, hi

    def slot(self, j):
        return lax.rem(j - self.lo, 2)

    def _fetch(self, j, slot):
        plgpu = _mgpu.plgpu()
        for src, dst, barrier in self.copies(j):
            plgpu.copy_gmem_to_smem(src, dst.at[slot], barrier.at[slot])

    def start(self):
        pl.when(self.lo < self.hi)(lambda: self._fetch(self.lo, 0))

    def step(self, j):
        slot = self.slot(j)
        # Every warp's reads of the other slot (block j - 1) are done before TMA overwrites it:
        # commit_smem is a fence and a warpgroup barrier.
        _mgpu.plgpu().commit_smem()
        pl.when(j + 1 < self.hi)(lambda: self._fetch(j + 1, 1 - slot))
        return slot

    @staticmethod
    def wait(barrier, slot):
        _mgpu.plgpu().barrier_wait(barrier.at[slot])


# --------------------------------------------------------------------------- forward


def _fwd_kernel(q_ref, kt_ref, v_ref, *refs, g: _Geometry, cfg: _Config, segmented: bool):
    plgpu, lay = _mgpu.plgpu(), _Layouts(cfg.interpret)
    if segmented:
        qseg_ref, kseg_ref, o_ref, lse_ref, *scratch = refs
    else:
        (o_ref, lse_ref, *scratch), qseg_ref, kseg_ref = refs, None, None
    q_smem, k_smem, v_smem, p_smem, lse_smem, qs_smem, ks_smem, q_bar, k_bar, v_bar, s_bar = scratch
    i, h, b = lax.axis_index("q"), lax.axis_index("heads"), lax.axis_index("batch")
    hk = lax.div(h, g.group)
    bk, band = g.block_k, cfg.band
    q_start = i * _ROWS
    rows = pl.ds(q_start, _ROWS)
    plgpu.copy_gmem_to_smem(q_ref.at[b, rows, h], q_smem, q_bar.at[0])
    if segmented:
        plgpu.copy_gmem_to_smem(qseg_ref.at[b, rows], qs_smem, q_bar.at[1])

    def copies(j):
        cols = pl.ds(j * bk, bk)
        out = [(kt_ref.at[b, hk, :, cols], k_smem, k_bar), (v_ref.at[b, cols, hk], v_smem, v_bar)]
        return out + ([(kseg_ref.at[b, cols], ks_smem, s_bar)] if segmented else [])

    lo, hi = _block_range(q_start, _ROWS, bk, g.kv_pad // bk, band.left, band.right)
    pipe = _Pipeline(copies, lo, hi)
    pipe.start()
    plgpu.barrier_wait(q_bar.at[0])
    q_seg = None
    if segmented:
        plgpu.barrier_wait(q_bar.at[1])
        q_seg = _rows(lay.rows_of(qs_smem), (_ROWS, bk))
    needs_mask = g.needs_mask(band, bk, segmented)
    shape = (_ROWS, bk)

    def visit(j, carry):
        acc, m_prev, l_prev = carry
        slot = pipe.step(j)
        pipe.wait(k_bar, slot)
        s = _matmul(q_smem, k_smem.at[slot], shape) * cfg.sm_scale
        if needs_mask:
            keep = lay.visible(q_start, j * bk, shape, band, g.kv_len)
            if segmented:
                pipe.wait(s_bar, slot)
                k_seg = lax.broadcast_in_dim(lay.columns_of(ks_smem.at[slot]), shape, [1])
                keep = keep & (q_seg == k_seg)
            s = jnp.where(keep, s, _MASK_VALUE)
        m_next = jnp.maximum(m_prev, jnp.max(s, axis=1))
        rescale = jnp.exp(m_prev - m_next)
        p = jnp.exp(s - _rows(m_next, shape))
        l_next = rescale * l_prev + jnp.sum(p, axis=1)
        pipe.wait(v_bar, slot)
        pv = _matmul(lay.operand(p.astype(v_ref.dtype), p_smem), v_smem.at[slot], acc.shape)
        acc = acc * _rows(rescale, acc.shape) + pv
        return acc, m_next, l_next

    init = (
        lay.cast(jnp.zeros((_ROWS, g.dim_pad), jnp.float32)),
        lay.cast(jnp.full((_ROWS,), _MASK_VALUE, jnp.float32), 1),
        lay.cast(jnp.zeros((_ROWS,), jnp.float32), 1),
    )
    acc, m, total = lax.fori_loop(lo, hi, visit, init)
    # A row that saw no visible key gets output 0 and lse +inf (probabilities 0 in backward).
    empty = m <= 0.5 * _MASK_VALUE
    l_safe = jnp.where(empty, 1.0, total)
    out = acc / _rows(l_safe, acc.shape)
    q_smem[...] = jnp.where(_rows(empty, acc.shape), 0.0, out).astype(q_smem.dtype)
    lse_smem[...] = jnp.where(empty, jnp.inf, m + jnp.log(l_safe))
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(q_smem, o_ref.at[b, rows, h])
    plgpu.copy_smem_to_gmem(lse_smem, lse_ref.at[b, h, rows])
    plgpu.wait_smem_to_gmem(0)


def _kernel_options(cfg: _Config, grid, grid_names) -> dict:
    plgpu = _mgpu.plgpu()
    options = dict(
        grid=grid, grid_names=grid_names, compiler_params=plgpu.CompilerParams(approx_math=False)
    )
    if cfg.interpret:
        options["interpret"] = _mgpu.interpret_params()
    return options


def _call(body, out_type, scratch, options):
    """``plgpu.kernel`` with the keywords every supported jax takes (``out_type``,
    ``scratch_types``: jax 0.11 dropped the older ``out_shape``/``scratch_shapes``).
    Interpreted, the kernel runs on the host (``_mgpu.on_host``)."""
    kernel = _mgpu.plgpu().kernel(body, out_type=out_type, scratch_types=scratch, **options)
    return _mgpu.on_host(kernel, out_type) if "interpret" in options else kernel


def _forward(q, k, v, segments, cfg: _Config):
    """(out [B, Sq, H, D], lse [B, H, q_pad] fp32, +inf where a row sees no key)."""
    plgpu = _mgpu.plgpu()
    g = _Geometry.of(q, k, cfg.tuning)
    bk, d, dtype = g.block_k, g.dim_pad, q.dtype
    segmented = segments is not None
    qp, vp = g.pad(q, g.q_pad), g.pad(v, g.kv_pad)
    kt = jnp.transpose(g.pad(k, g.kv_pad), (0, 2, 3, 1))  # [B, Hkv, D, Skv]
    seg_arrays = (
        [] if not segmented else [g.pad_ids(segments[0], g.q_pad), g.pad_ids(segments[1], g.kv_pad)]
    )
    scratch = [
        _smem((_ROWS, d), dtype),
        _smem((2, d, bk), dtype),
        _smem((2, bk, d), dtype),
        _smem((_ROWS, bk), dtype) if cfg.interpret else None,
        plgpu.SMEM((_ROWS,), jnp.float32),
        plgpu.SMEM((_ROWS,), jnp.int32),
        plgpu.SMEM((2, bk), jnp.int32),
        plgpu.Barrier(num_barriers=2),
        plgpu.Barrier(num_barriers=2),
        plgpu.Barrier(num_barriers=2),
        plgpu.Barrier(num_barriers=2),
    ]
    out_shape = [
        _backend.out_struct((g.batch, g.q_pad, g.heads, d), dtype, q, k, v),
        _backend.out_struct((g.batch, g.heads, g.q_pad), jnp.float32, q, k, v),
    ]
    body = functools.partial(_fwd_kernel, g=g, cfg=cfg, segmented=segmented)
    options = _kernel_options(cfg, (g.q_pad // _ROWS, g.heads, g.batch), ("q", "heads", "batch"))
    out, lse = _call(body, out_shape, scratch, options)(qp, kt, vp, *seg_arrays)
    out, lse = _mgpu.varying_like((out, lse), q, k, v)
    return out[:, : g.q_len, :, : g.head_dim], lse


# --------------------------------------------------------------------------- backward


def _dq_kernel(
    q_ref,
    do_ref,
    lse_ref,
    delta_ref,
    kt_ref,
    vt_ref,
    k_ref,
    *refs,
    g: _Geometry,
    cfg: _Config,
    segmented: bool,
):
    plgpu, lay = _mgpu.plgpu(), _Layouts(cfg.interpret)
    if segmented:
        qseg_ref, kseg_ref, dq_ref, *scratch = refs
    else:
        (dq_ref, *scratch), qseg_ref, kseg_ref = refs, None, None
    (
        q_smem,
        do_smem,
        lse_smem,
        delta_smem,
        qs_smem,
        kt_smem,
        vt_smem,
        k_smem,
        ks_smem,
        ds_smem,
        q_bar,
        kt_bar,
        vt_bar,
        k_bar,
        s_bar,
    ) = scratch
    i, h, b = lax.axis_index("q"), lax.axis_index("heads"), lax.axis_index("batch")
    hk = lax.div(h, g.group)
    bk, band, dtype = g.block_k_dq, cfg.band, q_ref.dtype
    q_start = i * _ROWS
    rows = pl.ds(q_start, _ROWS)
    fetch_q = [
        (q_ref.at[b, rows, h], q_smem),
        (do_ref.at[b, rows, h], do_smem),
        (lse_ref.at[b, h, rows], lse_smem),
        (delta_ref.at[b, h, rows], delta_smem),
    ]
    fetch_q += [(qseg_ref.at[b, rows], qs_smem)] if segmented else []
    for n, (src, dst) in enumerate(fetch_q):
        plgpu.copy_gmem_to_smem(src, dst, q_bar.at[n])

    def copies(j):
        cols = pl.ds(j * bk, bk)
        out = [
            (kt_ref.at[b, hk, :, cols], kt_smem, kt_bar),
            (vt_ref.at[b, hk, :, cols], vt_smem, vt_bar),
            (k_ref.at[b, cols, hk], k_smem, k_bar),
        ]
        return out + ([(kseg_ref.at[b, cols], ks_smem, s_bar)] if segmented else [])

    lo, hi = _block_range(q_start, _ROWS, bk, g.kv_pad // bk, band.left, band.right)
    pipe = _Pipeline(copies, lo, hi)
    pipe.start()
    for n in range(len(fetch_q)):
        plgpu.barrier_wait(q_bar.at[n])
    shape = (_ROWS, bk)
    lse, delta = _rows(lay.rows_of(lse_smem), shape), _rows(lay.rows_of(delta_smem), shape)
    q_seg = _rows(lay.rows_of(qs_smem), shape) if segmented else None
    needs_mask = g.needs_mask(band, bk, segmented)

    def visit(j, dq):
        slot = pipe.step(j)
        pipe.wait(kt_bar, slot)
        p = jnp.exp(_matmul(q_smem, kt_smem.at[slot], shape) * cfg.sm_scale - lse)
        if needs_mask:
            keep = lay.visible(q_start, j * bk, shape, band, g.kv_len)
            if segmented:
                pipe.wait(s_bar, slot)
                keep = keep & (
                    q_seg == lax.broadcast_in_dim(lay.columns_of(ks_smem.at[slot]), shape, [1])
                )
            p = jnp.where(keep, p, 0.0)
        pipe.wait(vt_bar, slot)
        ds = p * (_matmul(do_smem, vt_smem.at[slot], shape) - delta)
        pipe.wait(k_bar, slot)
        return dq + _matmul(lay.operand(ds.astype(dtype), ds_smem), k_smem.at[slot], dq.shape)

    dq = lax.fori_loop(lo, hi, visit, lay.cast(jnp.zeros((_ROWS, g.dim_pad), jnp.float32)))
    q_smem[...] = (dq * cfg.sm_scale).astype(dtype)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(q_smem, dq_ref.at[b, rows, h])
    plgpu.wait_smem_to_gmem(0)


def _dkv_kernel(
    k_ref,
    v_ref,
    qt_ref,
    q_ref,
    dot_ref,
    do_ref,
    lse_ref,
    delta_ref,
    *refs,
    g: _Geometry,
    cfg: _Config,
    segmented: bool,
):
    # One program per (64 kv rows, kv head, batch): it walks the q blocks that see its keys,
    # for each q head of its group in turn, as one pipelined loop.
    plgpu, lay = _mgpu.plgpu(), _Layouts(cfg.interpret)
    if segmented:
        qseg_ref, kseg_ref, dk_ref, dv_ref, *scratch = refs
    else:
        (dk_ref, dv_ref, *scratch), qseg_ref, kseg_ref = refs, None, None
    (
        k_smem,
        v_smem,
        ks_smem,
        qt_smem,
        q_smem,
        dot_smem,
        do_smem,
        lse_smem,
        delta_smem,
        qs_smem,
        p_smem,
        kv_bar,
        q_bars,
    ) = scratch
    j, hk, b = lax.axis_index("kv"), lax.axis_index("heads"), lax.axis_index("batch")
    band, dtype = cfg.band, k_ref.dtype
    k_start = j * _ROWS
    keys = pl.ds(k_start, _ROWS)
    fetch_kv = [(k_ref.at[b, keys, hk], k_smem), (v_ref.at[b, keys, hk], v_smem)]
    fetch_kv += [(kseg_ref.at[b, keys], ks_smem)] if segmented else []
    for n, (src, dst) in enumerate(fetch_kv):
        plgpu.copy_gmem_to_smem(src, dst, kv_bar.at[n])

    lo, hi = _block_range(k_start, _ROWS, _ROWS, g.q_pad // _ROWS, band.right, band.left)
    steps = hi - lo  # q blocks per head

    def at(t):
        """(q head, q rows) of pipeline step t."""
        return hk * g.group + lax.div(t, steps), pl.ds((lo + lax.rem(t, steps)) * _ROWS, _ROWS)

    def copies(t):
        h, rows = at(t)
        out = [
            (qt_ref.at[b, h, :, rows], qt_smem),
            (q_ref.at[b, rows, h], q_smem),
            (dot_ref.at[b, h, :, rows], dot_smem),
            (do_ref.at[b, rows, h], do_smem),
            (lse_ref.at[b, h, rows], lse_smem),
            (delta_ref.at[b, h, rows], delta_smem),
        ]
        out += [(qseg_ref.at[b, rows], qs_smem)] if segmented else []
        return [(src, dst, q_bars[n]) for n, (src, dst) in enumerate(out)]

    pipe = _Pipeline(copies, jnp.int32(0), steps * g.group)
    pipe.start()
    for n in range(len(fetch_kv)):
        plgpu.barrier_wait(kv_bar.at[n])
    shape = (_ROWS, _ROWS)  # keys by queries
    k_seg = _rows(lay.rows_of(ks_smem), shape) if segmented else None
    needs_mask = g.needs_mask(band, _ROWS, segmented)

    def columns(ref):
        return lax.broadcast_in_dim(lay.columns_of(ref), shape, [1])

    def visit(t, carry):
        dk, dv = carry
        slot = pipe.step(t)
        wait = lambda n: pipe.wait(q_bars[n], slot)  # noqa: E731
        wait(0), wait(4)
        q_start = (lo + lax.rem(t, steps)) * _ROWS
        p = jnp.exp(
            _matmul(k_smem, qt_smem.at[slot], shape) * cfg.sm_scale - columns(lse_smem.at[slot])
        )
        if needs_mask:
            keep = lay.visible(q_start, k_start, shape, band, g.kv_len, keys_on_rows=True)
            if segmented:
                wait(6)
                keep = keep & (k_seg == columns(qs_smem.at[slot]))
            p = jnp.where(keep, p, 0.0)
        wait(3)
        dv = dv + _matmul(lay.operand(p.astype(dtype), p_smem), do_smem.at[slot], dv.shape)
        wait(2), wait(5)
        ds = p * (_matmul(v_smem, dot_smem.at[slot], shape) - columns(delta_smem.at[slot]))
        wait(1)
        dk = dk + _matmul(lay.operand(ds.astype(dtype), p_smem), q_smem.at[slot], dk.shape)
        return dk, dv

    zeros = lay.cast(jnp.zeros((_ROWS, g.dim_pad), jnp.float32))
    dk, dv = lax.fori_loop(jnp.int32(0), steps * g.group, visit, (zeros, zeros))
    k_smem[...] = (dk * cfg.sm_scale).astype(dtype)
    v_smem[...] = dv.astype(dtype)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(k_smem, dk_ref.at[b, keys, hk])
    plgpu.copy_smem_to_gmem(v_smem, dv_ref.at[b, keys, hk])
    plgpu.wait_smem_to_gmem(0)


def _transposed(x):
    """[B, S, H, D] -> [B, H, D, S]: a wgmma B operand for products with x^T."""
    return jnp.transpose(x, (0, 2, 3, 1))


def _backward_kernels(q, k, v, segments, out, lse, d_out, cfg: _Config):
    """(dq, dk, dv) padded, given the (padded) lse ``[B, H, q_pad]`` (+inf: row sees nothing)."""
    plgpu = _mgpu.plgpu()
    g = _Geometry.of(q, k, cfg.tuning)
    d, dtype, segmented = g.dim_pad, q.dtype, segments is not None
    delta = jnp.einsum("bshd,bshd->bhs", out.astype(jnp.float32), d_out.astype(jnp.float32))
    delta = jnp.pad(delta, ((0, 0), (0, 0), (0, g.q_pad - g.q_len)))
    qp, dop = g.pad(q, g.q_pad), g.pad(d_out.astype(dtype), g.q_pad)
    kp, vp = g.pad(k, g.kv_pad), g.pad(v, g.kv_pad)
    seg_arrays = (
        [] if not segmented else [g.pad_ids(segments[0], g.q_pad), g.pad_ids(segments[1], g.kv_pad)]
    )
    inputs = (q, k, v, d_out)
    bar = lambda n: plgpu.Barrier(num_barriers=n)  # noqa: E731
    vec = lambda *shape: plgpu.SMEM(shape, jnp.float32)  # noqa: E731
    ids = lambda *shape: plgpu.SMEM(shape, jnp.int32)  # noqa: E731

    bk = g.block_k_dq
    scratch = [
        _smem((_ROWS, d), dtype),
        _smem((_ROWS, d), dtype),
        vec(_ROWS),
        vec(_ROWS),
        ids(_ROWS),
        _smem((2, d, bk), dtype),
        _smem((2, d, bk), dtype),
        _smem((2, bk, d), dtype),
        ids(2, bk),
        _smem((_ROWS, bk), dtype) if cfg.interpret else None,
        bar(5),
        bar(2),
        bar(2),
        bar(2),
        bar(2),
    ]
    dq = _call(
        functools.partial(_dq_kernel, g=g, cfg=cfg, segmented=segmented),
        _backend.out_struct(qp.shape, dtype, *inputs),
        scratch,
        _kernel_options(cfg, (g.q_pad // _ROWS, g.heads, g.batch), ("q", "heads", "batch")),
    )(qp, dop, lse, delta, _transposed(kp), _transposed(vp), kp, *seg_arrays)

    scratch = [
        _smem((_ROWS, d), dtype),
        _smem((_ROWS, d), dtype),
        ids(_ROWS),
        _smem((2, d, _ROWS), dtype),
        _smem((2, _ROWS, d), dtype),
        _smem((2, d, _ROWS), dtype),
        _smem((2, _ROWS, d), dtype),
        vec(2, _ROWS),
        vec(2, _ROWS),
        ids(2, _ROWS),
        _smem((_ROWS, _ROWS), dtype) if cfg.interpret else None,
        bar(3),
        tuple(bar(2) for _ in range(7)),
    ]
    dk, dv = _call(
        functools.partial(_dkv_kernel, g=g, cfg=cfg, segmented=segmented),
        [
            _backend.out_struct(kp.shape, k.dtype, *inputs),
            _backend.out_struct(vp.shape, v.dtype, *inputs),
        ],
        scratch,
        _kernel_options(cfg, (g.kv_pad // _ROWS, g.kv_heads, g.batch), ("kv", "heads", "batch")),
    )(kp, vp, _transposed(qp), qp, _transposed(dop), dop, lse, delta, *seg_arrays)
    return _mgpu.varying_like((dq, dk, dv), *inputs)


def _unpad(grad, length, head_dim, primal):
    return _backend.match_varying(grad[:, :length, :, :head_dim], primal)


def _no_grads(segments):
    """Segment ids are integers: their cotangent is float0 zeros."""
    if segments is None:
        return None
    return tuple(np.zeros(ids.shape, jax.dtypes.float0) for ids in segments)


# --------------------------------------------------------------------------- public API


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _attention(q, k, v, segments, cfg: _Config):
    return _forward(q, k, v, segments, cfg)[0]


def _attention_fwd(q, k, v, segments, cfg: _Config):
    out, lse = _forward(q, k, v, segments, cfg)
    return out, (q, k, v, segments, out, lse)


def _attention_bwd(cfg: _Config, residuals, d_out):
    q, k, v, segments, out, lse = residuals
    dq, dk, dv = _backward_kernels(q, k, v, segments, out, lse, d_out, cfg)
    d = q.shape[3]
    return (
        _unpad(dq, q.shape[1], d, q),
        _unpad(dk, k.shape[1], d, k),
        _unpad(dv, v.shape[1], d, v),
        _no_grads(segments),
    )


_attention.defvjp(_attention_fwd, _attention_bwd)


def unsupported_reason(q, k, v, interpret: bool = False) -> str | None:
    """Why these inputs cannot use the Mosaic GPU kernels (one line), else None. fp32 runs in
    the interpreter only: compiled, wgmma takes fp32 (TF32) operands only in [N, K] order."""
    if q.ndim != 4 or k.ndim != 4 or v.shape != k.shape:
        return (
            f"flash attention expects q [B,S,H,D] and k == v [B,S,Hkv,D]; got {q.shape}, "
            f"{k.shape}, {v.shape}"
        )
    if q.shape[0] != k.shape[0] or q.shape[3] != k.shape[3]:
        return f"q and k must share batch and head_dim; got {q.shape} and {k.shape}"
    if 0 in q.shape[:3] or 0 in k.shape[:3]:
        return f"flash attention needs non-empty q and k, v; got {q.shape} and {k.shape}"
    if q.shape[2] % k.shape[2]:
        return f"q heads ({q.shape[2]}) must be a multiple of kv heads ({k.shape[2]})"
    if not 0 < q.shape[3] <= MAX_HEAD_DIM:
        return (
            f"flash attention (Mosaic GPU) supports head_dim 1..{MAX_HEAD_DIM} (padded to "
            f"64 or 128); got {q.shape[3]}"
        )
    dtypes = DTYPES + ((jnp.float32,) if interpret else ())
    if not (q.dtype == k.dtype == v.dtype and any(q.dtype == t for t in dtypes)):
        accepted = "bf16, fp16 or (interpreted) fp32" if interpret else "bf16 or fp16"
        return (
            f"flash attention (Mosaic GPU) takes {accepted} q, k and v of one dtype; "
            f"got {q.dtype}, {k.dtype}, {v.dtype}"
        )
    return None


def _checked_config(q, k, v, causal, sm_scale, tuning, interpret, window) -> _Config:
    interpret = _backend.resolve_interpret(interpret)
    reason = unsupported_reason(q, k, v, interpret)
    if reason is not None:
        raise ValueError(reason)
    if not interpret:
        _mgpu.require_compilable()
    tuning = TuningConfig() if tuning is None else tuning
    if tuning.block_k_dq > 64 and q.shape[3] > 64:
        # q, dO, and two slots of K^T, V^T and K: 233,576 bytes > an H100's 232,448.
        raise ValueError(
            f"TuningConfig.block_k_dq={tuning.block_k_dq} needs head_dim <= 64 "
            f"(shared memory); got head_dim {q.shape[3]}: use block_k_dq=64"
        )
    return _Config(
        band=Band.make(causal, window),
        sm_scale=float(1.0 / math.sqrt(q.shape[-1]) if sm_scale is None else sm_scale),
        tuning=tuning,
        interpret=interpret,
    )


def flash_attention(
    q,
    k,
    v,
    *,
    causal: bool = False,
    sm_scale: float | None = None,
    tuning: TuningConfig | None = None,
    interpret: bool | None = None,
    window: int | tuple[int, int] | None = None,
    segment_ids=None,
):
    """Memory-efficient attention on Mosaic GPU, `[batch, seq, heads, head_dim]` in and out.

    Args:
      q: `[B, Sq, H, D]`; k, v: `[B, Skv, Hkv, D]` with `H % Hkv == 0` (GQA/MQA); bf16 or
        fp16; `D <= 128`.
      causal: query i sees keys j <= i (top-left aligned, as `jax.nn.dot_product_attention`).
      sm_scale: multiplier of q.k; default `1 / sqrt(D)`.
      tuning: tiles; default `TuningConfig()`.
      interpret: None compiles on a GPU and runs the Mosaic GPU interpreter elsewhere.
      window: sliding window `(left, right)` or a symmetric int: query i sees keys
        `i - left <= j <= i + right` (right is 0 when causal). kv blocks outside are skipped.
      segment_ids: int `[B, S]` (self-attention) or a pair `([B, Sq], [B, Skv])`: query i
        sees key j only when their ids are equal (packed examples). None: one segment.

    Returns:
      `[B, Sq, H, D]` in q's dtype; softmax statistics are kept in fp32.
    """
    cfg = _checked_config(q, k, v, causal, sm_scale, tuning, interpret, window)
    return _attention(q, k, v, segment_pair(segment_ids, q, k), cfg)


def flash_attention_forward(
    q,
    k,
    v,
    *,
    causal: bool = False,
    sm_scale: float | None = None,
    tuning: TuningConfig | None = None,
    interpret: bool | None = None,
    window: int | tuple[int, int] | None = None,
    segment_ids=None,
):
    """The forward pass alone, not differentiable: `(out, lse)` with `lse` `[B, H, Sq]` fp32,
    each row's log-sum-exp of its scaled scores (-inf where a row sees no key). Blockwise
    attention (a ring of key/value blocks) merges such partial results and differentiates them
    with `flash_attention_backward`."""
    cfg = _checked_config(q, k, v, causal, sm_scale, tuning, interpret, window)
    out, lse = _forward(q, k, v, segment_pair(segment_ids, q, k), cfg)
    lse = lse[:, :, : q.shape[1]]
    return out, jnp.where(lse == jnp.inf, -jnp.inf, lse)


def flash_attention_backward(
    q,
    k,
    v,
    out,
    lse,
    d_out,
    *,
    causal: bool = False,
    sm_scale: float | None = None,
    tuning: TuningConfig | None = None,
    interpret: bool | None = None,
    window: int | tuple[int, int] | None = None,
    segment_ids=None,
):
    """`(dq, dk, dv)` of attention over this block of keys and values, given the whole
    attention's `out` `[B, Sq, H, D]` and `lse` `[B, H, Sq]` (over every block the queries
    saw) and the cotangent `d_out`: each block's share of the gradient, so that summing the
    blocks' `dq` (and each block's own `dk`, `dv`) gives the gradient of the whole."""
    cfg = _checked_config(q, k, v, causal, sm_scale, tuning, interpret, window)
    reason = _backward_shapes_problem(q, out, lse, d_out)
    if reason is not None:
        raise ValueError(reason)
    g = _Geometry.of(q, k, cfg.tuning)
    # +inf: a row that sees nothing gets probabilities exp(-inf) = 0, as the forward marks it.
    lse = jnp.where(lse == -jnp.inf, jnp.inf, lse.astype(jnp.float32))
    lse = jnp.pad(lse, ((0, 0), (0, 0), (0, g.q_pad - q.shape[1])), constant_values=jnp.inf)
    segments = segment_pair(segment_ids, q, k)
    dq, dk, dv = _backward_kernels(q, k, v, segments, out.astype(q.dtype), lse, d_out, cfg)
    d = q.shape[3]
    return (
        _unpad(dq, q.shape[1], d, q),
        _unpad(dk, k.shape[1], d, k),
        _unpad(dv, v.shape[1], d, v),
    )


def _backward_shapes_problem(q, out, lse, d_out) -> str | None:
    """One line if the forward's results handed to the backward pass do not fit q."""
    if tuple(out.shape) != q.shape or tuple(d_out.shape) != q.shape:
        return (
            f"flash_attention_backward: out and d_out must have q's shape {q.shape} "
            f"[B,Sq,H,D]; got {tuple(out.shape)} and {tuple(d_out.shape)}"
        )
    rows = (q.shape[0], q.shape[2], q.shape[1])
    if tuple(lse.shape) != rows:
        return (
            f"flash_attention_backward: lse must be [B,H,Sq] {rows} "
            f"(flash_attention_forward's); got {tuple(lse.shape)}"
        )
    return None


def mosaic_gpu_problem(device_kind: str | None = None) -> str | None:
    """One line if this jax has no Pallas Mosaic GPU backend, or if ``device_kind`` (a GPU's
    ``device_kind``; None: not asked) is not sm_90, else None."""
    return _mgpu.problem(device_kind)
