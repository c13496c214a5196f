"""Flash attention in Pallas: online-softmax forward, blockwise-recompute backward.

Layout is that of `jax.nn.dot_product_attention`: q `[batch, q_len, heads, head_dim]`,
k and v `[batch, kv_len, kv_heads, head_dim]` with `heads % kv_heads == 0` (MHA, GQA, MQA).

Forward: each program owns one q block and walks the kv blocks keeping a running row max `m`
and row sum `l`; only the output and the log-sum-exp `m + log(l)` are saved, so memory is
O(seq) rather than O(seq^2). Backward recomputes the probabilities block by block from the
saved log-sum-exp: `delta = rowsum(dO * O)`, then one kernel per kv block for dK/dV (summing
over the q heads that share the kv head) and one kernel per q block for dQ.

Causal and sliding-window attention shrink the loop bounds, so blocks outside the band are
never loaded; masking is only applied inside the blocks that are visited.

Segment ids (packed examples, `[batch, seq]` for q and for kv) add one rule: a query sees
only keys of its own segment. Each program then also reads its rows' ids and masks every
visited block by them; the band's loop bounds are unchanged.
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

from pallas_kernels import _backend

# Finite, so that a block whose scores are all masked never produces inf - inf.
_MASK_VALUE = -0.7 * float(np.finfo(np.float32).max)


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Tile sizes (powers of two). Defaults suit an A100/H100; tests pass small ones.

    Tiles are shrunk automatically for short sequences (never below 16, the Triton dot minimum).
    """

    block_q: int = 128  # q rows per forward program
    block_k: int = 64  # kv rows per step of the forward loop
    block_q_bwd: int | None = None  # q rows per backward step; None: 64
    block_k_bwd: int | None = None  # kv rows per backward step; None: 64
    num_warps: int | None = None  # Triton warps; None: chosen from the tile and head size
    num_stages: int = 2  # Triton software-pipelining stages

    def __post_init__(self):
        for name in ("block_q", "block_k", "block_q_bwd", "block_k_bwd"):
            value = getattr(self, name)
            if value is None and name.endswith("_bwd"):
                continue
            if not _backend.is_power_of_two(value):
                raise ValueError(
                    f"BlockSizes.{name} must be a positive power of two, got {value!r}")
        if self.num_warps is not None and not _backend.is_power_of_two(self.num_warps):
            raise ValueError(f"BlockSizes.num_warps must be a power of two, got {self.num_warps!r}")
        if not (isinstance(self.num_stages, int) and self.num_stages >= 1):
            raise ValueError(f"BlockSizes.num_stages must be an int >= 1, got {self.num_stages!r}")

    @property
    def backward(self) -> tuple[int, int]:
        return (self.block_q_bwd or 64, self.block_k_bwd or 64)


@dataclasses.dataclass(frozen=True)
class _Band:
    """Key j is visible from query i iff i - left <= j <= i + right (None: unbounded)."""

    left: int | None
    right: int | None

    @classmethod
    def make(cls, causal: bool, window) -> "_Band":
        left = right = None
        if window is not None:
            left, right = (window, window) if isinstance(window, int) else tuple(window)
            for side in (left, right):
                if not isinstance(side, int) or side < 0:
                    raise ValueError(f"window must be an int >= 0 or (left, right); got {window!r}")
        if causal:
            right = 0
        return cls(left, right)


@dataclasses.dataclass(frozen=True)
class _Config:
    band: _Band
    sm_scale: float
    blocks: BlockSizes
    interpret: bool


# --------------------------------------------------------------------------- kernel helpers


def _dot(a, b, contract_a: int, contract_b: int):
    """2-D matmul with fp32 accumulation (TF32 on GPU when the inputs are fp32)."""
    dims = (((contract_a,), (contract_b,)), ((), ()))
    return lax.dot_general(a, b, dims, preferred_element_type=jnp.float32)


def _visible(q_start, k_start, shape, band: _Band, kv_len: int | None):
    """Boolean [block_q, block_k]: which scores survive the band and the padded kv tail."""
    rows = q_start + jnp.arange(shape[0], dtype=jnp.int32)[:, None]
    cols = k_start + jnp.arange(shape[1], dtype=jnp.int32)[None, :]
    keep = jnp.full(shape, True)
    if kv_len is not None:
        keep = keep & (cols < kv_len)
    if band.left is not None:
        keep = keep & (cols >= rows - band.left)
    if band.right is not None:
        keep = keep & (cols <= rows + band.right)
    return keep


def _visible_blocks(start, block: int, other_block: int, num_other: int, behind, ahead):
    """[lo, hi) of the other axis's blocks that a block of ``block`` rows beginning at row
    ``start`` can see, when row r sees columns r - behind .. r + ahead (None: no limit). The
    rest is skipped, not masked."""
    lo: int | jax.Array = 0
    hi: int | jax.Array = num_other
    if behind is not None:
        lo = lax.div(jnp.maximum(start - behind, 0), other_block)
    if ahead is not None:
        hi = jnp.minimum(lax.div(start + block - 1 + ahead, other_block) + 1, num_other)
    return _backend.traced_bounds(lo, hi)


def _kv_block_range(q_start, block_q: int, block_k: int, num_kv_blocks: int, band: _Band):
    """[lo, hi) of the kv blocks that a q block can see."""
    return _visible_blocks(q_start, block_q, block_k, num_kv_blocks, band.left, band.right)


def _q_block_range(k_start, block_q: int, block_k: int, num_q_blocks: int, band: _Band):
    """[lo, hi) of the q blocks that can see a kv block: the same band seen from the keys."""
    return _visible_blocks(k_start, block_k, block_q, num_q_blocks, band.right, band.left)


# --------------------------------------------------------------------------- kernels


def _same_segment(q_seg, k_seg):
    """Boolean [block_q, block_k] from the rows' and columns' segment ids."""
    return q_seg[:, None] == k_seg[None, :]


def _fwd_kernel(q_ref, k_ref, v_ref, *refs, sm_scale, band, kv_len, needs_mask, block_q,
                block_k, segmented):
    # refs: (q_seg, kv_seg,) o, lse; q_seg holds this block's rows, kv_seg every key's.
    q_seg_ref, kv_seg_ref, o_ref, lse_ref = refs if segmented else (None, None, *refs)
    q_start = pl.program_id(0) * block_q
    q = q_ref[...]
    q_seg = q_seg_ref[...] if segmented else None
    num_kv_blocks = pl.cdiv(kv_len, block_k)
    lo, hi = _kv_block_range(q_start, block_q, block_k, num_kv_blocks, band)

    def visit_kv_block(j, carry):
        acc, m_prev, l_prev = carry
        k_start = j * block_k
        k = k_ref[pl.ds(k_start, block_k), :]
        v = v_ref[pl.ds(k_start, block_k), :]
        s = _dot(q, k, 1, 1) * sm_scale
        if needs_mask:
            keep = _visible(q_start, k_start, s.shape, band, kv_len)
            if segmented:
                keep = keep & _same_segment(q_seg, kv_seg_ref[pl.ds(k_start, block_k)])
            s = jnp.where(keep, s, _MASK_VALUE)
        m_next = jnp.maximum(m_prev, jnp.max(s, axis=1))
        rescale = jnp.exp(m_prev - m_next)
        p = jnp.exp(s - m_next[:, None])
        l_next = rescale * l_prev + jnp.sum(p, axis=1)
        acc = rescale[:, None] * acc + _dot(p.astype(v.dtype), v, 1, 0)
        return acc, m_next, l_next

    init = (
        jnp.zeros((block_q, q.shape[-1]), jnp.float32),
        jnp.full((block_q,), -jnp.inf, jnp.float32),
        jnp.zeros((block_q,), jnp.float32),
    )
    acc, m, l = lax.fori_loop(lo, hi, visit_kv_block, init)
    # A row that saw no visible key (possible only in padding or with a window) gets output 0
    # and lse = +inf, which makes its recomputed probabilities exactly 0 in the backward pass.
    empty = m <= 0.5 * _MASK_VALUE
    l_safe = jnp.where(empty, 1.0, l)
    o_ref[...] = jnp.where(empty[:, None], 0.0, acc / l_safe[:, None]).astype(o_ref.dtype)
    lse_ref[...] = jnp.where(empty, jnp.inf, m + jnp.log(l_safe))


def _dq_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, *refs, sm_scale, band, kv_len,
               needs_mask, block_q, block_k, segmented):
    q_seg_ref, kv_seg_ref, dq_ref = refs if segmented else (None, None, *refs)
    q_start = pl.program_id(0) * block_q
    q, do = q_ref[...], do_ref[...]
    q_seg = q_seg_ref[...] if segmented else None
    lse, delta = lse_ref[...], delta_ref[...]
    num_kv_blocks = pl.cdiv(kv_len, block_k)
    lo, hi = _kv_block_range(q_start, block_q, block_k, num_kv_blocks, band)

    def visit_kv_block(j, dq):
        k_start = j * block_k
        k = k_ref[pl.ds(k_start, block_k), :]
        v = v_ref[pl.ds(k_start, block_k), :]
        p = jnp.exp(_dot(q, k, 1, 1) * sm_scale - lse[:, None])
        if needs_mask:
            keep = _visible(q_start, k_start, p.shape, band, kv_len)
            if segmented:
                keep = keep & _same_segment(q_seg, kv_seg_ref[pl.ds(k_start, block_k)])
            p = jnp.where(keep, p, 0.0)
        ds = p * (_dot(do, v, 1, 1) - delta[:, None])
        return dq + _dot(ds.astype(k.dtype), k, 1, 0)

    dq = lax.fori_loop(lo, hi, visit_kv_block, jnp.zeros(q.shape, jnp.float32))
    dq_ref[...] = (dq * sm_scale).astype(dq_ref.dtype)


def _dkv_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, *refs, sm_scale, band, q_len,
                kv_len, needs_mask, group, block_q, block_k, segmented):
    # q_ref/do_ref hold the `group` q heads that share this kv head: [q_len_padded, group, D].
    # refs: (q_seg, kv_seg,) dk, dv; q_seg holds every query's id, kv_seg this block's keys'.
    q_seg_ref, kv_seg_ref, dk_ref, dv_ref = refs if segmented else (None, None, *refs)
    k_start = pl.program_id(0) * block_k
    k, v = k_ref[...], v_ref[...]
    kv_seg = kv_seg_ref[...] if segmented else None
    num_q_blocks = pl.cdiv(q_len, block_q)
    lo, hi = _q_block_range(k_start, block_q, block_k, num_q_blocks, band)

    def visit_q_block(i, carry, head):
        dk, dv = carry
        q_start = i * block_q
        rows = pl.ds(q_start, block_q)
        q = q_ref[rows, head, :]
        do = do_ref[rows, head, :]
        lse = lse_ref[head, rows]
        delta = delta_ref[head, rows]
        p = jnp.exp(_dot(q, k, 1, 1) * sm_scale - lse[:, None])
        if needs_mask:
            keep = _visible(q_start, k_start, p.shape, band, kv_len)
            if segmented:
                keep = keep & _same_segment(q_seg_ref[rows], kv_seg)
            p = jnp.where(keep, p, 0.0)
        dv = dv + _dot(p.astype(do.dtype), do, 0, 0)
        ds = p * (_dot(do, v, 1, 1) - delta[:, None])
        dk = dk + _dot(ds.astype(q.dtype), q, 0, 0)
        return dk, dv

    def visit_head(head, carry):
        return lax.fori_loop(lo, hi, functools.partial(visit_q_block, head=head), carry)

    zeros = jnp.zeros(k.shape, jnp.float32)
    dk, dv = lax.fori_loop(*_backend.traced_bounds(0, group), visit_head, (zeros, zeros))
    dk_ref[...] = (dk * sm_scale).astype(dk_ref.dtype)
    dv_ref[...] = dv.astype(dv_ref.dtype)


# --------------------------------------------------------------------------- wrappers


@dataclasses.dataclass(frozen=True)
class _Geometry:
    """Static shapes after fitting the tiles and padding sequences and head_dim."""

    batch: int
    heads: int
    kv_heads: int
    q_len: int
    kv_len: int
    head_dim: int
    q_pad: int
    kv_pad: int
    dim_pad: int
    block_q: int
    block_k: int
    block_q_bwd: int
    block_k_bwd: int

    @classmethod
    def of(cls, q, k, blocks: BlockSizes) -> "_Geometry":
        batch, q_len, heads, head_dim = q.shape
        kv_len, kv_heads = k.shape[1], k.shape[2]
        fit = _backend.fit_block
        bq, bk = fit(blocks.block_q, q_len), fit(blocks.block_k, kv_len)
        bq_bwd, bk_bwd = (fit(b, n) for b, n in zip(blocks.backward, (q_len, kv_len)))
        return cls(
            batch, heads, kv_heads, q_len, kv_len, head_dim,
            q_pad=_backend.round_up(q_len, max(bq, bq_bwd)),
            kv_pad=_backend.round_up(kv_len, max(bk, bk_bwd)),
            dim_pad=max(_backend.MIN_TRITON_DOT_DIM, _backend.next_power_of_two(head_dim)),
            block_q=bq, block_k=bk, block_q_bwd=bq_bwd, block_k_bwd=bk_bwd,
        )

    @property
    def group(self) -> int:
        return self.heads // self.kv_heads

    def needs_mask(self, band: _Band, block_k: int, segmented: bool = False) -> bool:
        return (segmented or band.left is not None or band.right is not None
                or self.kv_len % block_k != 0)

    def pad(self, x, seq_pad: int):
        extra = ((0, 0), (0, seq_pad - x.shape[1]), (0, 0), (0, self.dim_pad - x.shape[3]))
        return jnp.pad(x, extra) if any(hi for _, hi in extra) else x

    @staticmethod
    def pad_segments(ids, seq_pad: int):
        """[B, S] ids padded to ``seq_pad``: padded keys are cut by kv_len, padded queries'
        rows are dropped, so the value used does not matter."""
        return jnp.pad(ids, ((0, 0), (0, seq_pad - ids.shape[1]))) if seq_pad > ids.shape[1] else ids


def _num_warps(blocks: BlockSizes, tile_elems: int, dim_pad: int) -> int:
    """Unmeasured starting point: 8 warps for wide heads on big tiles, else 4."""
    if blocks.num_warps is not None:
        return blocks.num_warps
    return 8 if dim_pad >= 128 and tile_elems >= 64 * 64 else 4


def _segment_inputs(segments, g: "_Geometry", block_q: int | None, block_k: int | None):
    """(specs, arrays) for the q and kv segment ids: a block of ``block_q`` rows (or all rows
    when None) indexed by grid axis 0, and likewise for kv."""
    if segments is None:
        return [], []
    q_seg, kv_seg = segments
    q_spec = (pl.BlockSpec((None, block_q), lambda i, b, h: (b, i)) if block_q
              else pl.BlockSpec((None, g.q_pad), lambda i, b, h: (b, 0)))
    kv_spec = (pl.BlockSpec((None, block_k), lambda i, b, h: (b, i)) if block_k
               else pl.BlockSpec((None, g.kv_pad), lambda i, b, h: (b, 0)))
    return [q_spec, kv_spec], [g.pad_segments(q_seg, g.q_pad), g.pad_segments(kv_seg, g.kv_pad)]


def _forward(q, k, v, segments, cfg: _Config):
    g = _Geometry.of(q, k, cfg.blocks)
    bq, bk, d = g.block_q, g.block_k, g.dim_pad
    segmented = segments is not None
    kernel = functools.partial(
        _fwd_kernel, sm_scale=cfg.sm_scale, band=cfg.band, kv_len=g.kv_len,
        needs_mask=g.needs_mask(cfg.band, bk, segmented), block_q=bq, block_k=bk,
        segmented=segmented)
    group = g.group
    q_spec = pl.BlockSpec((None, bq, None, d), lambda i, b, h: (b, i, h, 0))
    kv_spec = pl.BlockSpec((None, g.kv_pad, None, d), lambda i, b, h: (b, 0, lax.div(h, group), 0))
    seg_specs, seg_arrays = _segment_inputs(segments, g, bq, None)
    out, lse = pl.pallas_call(
        kernel,
        grid=(g.q_pad // bq, g.batch, g.heads),
        in_specs=[q_spec, kv_spec, kv_spec, *seg_specs],
        out_specs=[q_spec, pl.BlockSpec((None, None, bq), lambda i, b, h: (b, h, i))],
        out_shape=[
            _backend.out_struct((g.batch, g.q_pad, g.heads, d), q.dtype, q, k, v),
            _backend.out_struct((g.batch, g.heads, g.q_pad), jnp.float32, q, k, v),
        ],
        name="flash_attention_fwd",
        **_backend.pallas_call_options(
            cfg.interpret, num_warps=_num_warps(cfg.blocks, bq * bk, d),
            num_stages=cfg.blocks.num_stages),
    )(g.pad(q, g.q_pad), g.pad(k, g.kv_pad), g.pad(v, g.kv_pad), *seg_arrays)
    return out[:, : g.q_len, :, : g.head_dim], lse


def _backward(cfg: _Config, residuals, d_out):
    q, k, v, segments, out, lse = residuals
    g = _Geometry.of(q, k, cfg.blocks)
    bq, bk, d, group = g.block_q_bwd, g.block_k_bwd, g.dim_pad, g.group
    segmented = segments is not None
    delta = jnp.einsum("bshd,bshd->bhs", out.astype(jnp.float32), d_out.astype(jnp.float32))
    delta = jnp.pad(delta, ((0, 0), (0, 0), (0, g.q_pad - g.q_len)))
    qp, dop = g.pad(q, g.q_pad), g.pad(d_out.astype(q.dtype), g.q_pad)
    kp, vp = g.pad(k, g.kv_pad), g.pad(v, g.kv_pad)
    shared = dict(sm_scale=cfg.sm_scale, band=cfg.band, kv_len=g.kv_len,
                  needs_mask=g.needs_mask(cfg.band, bk, segmented), block_q=bq, block_k=bk,
                  segmented=segmented)
    options = _backend.pallas_call_options(
        cfg.interpret, num_warps=_num_warps(cfg.blocks, bq * bk, d),
        num_stages=cfg.blocks.num_stages)

    inputs = (qp, kp, vp, dop, lse, delta)
    q_block = pl.BlockSpec((None, bq, None, d), lambda i, b, h: (b, i, h, 0))
    kv_whole = pl.BlockSpec((None, g.kv_pad, None, d), lambda i, b, h: (b, 0, lax.div(h, group), 0))
    row_block = pl.BlockSpec((None, None, bq), lambda i, b, h: (b, h, i))
    seg_specs, seg_arrays = _segment_inputs(segments, g, bq, None)
    dq = pl.pallas_call(
        functools.partial(_dq_kernel, **shared),
        grid=(g.q_pad // bq, g.batch, g.heads),
        in_specs=[q_block, kv_whole, kv_whole, q_block, row_block, row_block, *seg_specs],
        out_specs=q_block,
        out_shape=_backend.out_struct(qp.shape, q.dtype, *inputs),
        name="flash_attention_dq",
        **options,
    )(*inputs, *seg_arrays)

    # One program per (kv block, batch, kv head); it loops over the q heads of its group.
    kv_block = pl.BlockSpec((None, bk, None, d), lambda j, b, h: (b, j, h, 0))
    q_group = pl.BlockSpec((None, g.q_pad, group, d), lambda j, b, h: (b, 0, h, 0))
    rows_group = pl.BlockSpec((None, group, g.q_pad), lambda j, b, h: (b, h, 0))
    seg_specs, seg_arrays = _segment_inputs(segments, g, None, bk)
    dk, dv = pl.pallas_call(
        functools.partial(_dkv_kernel, q_len=g.q_len, group=group, **shared),
        grid=(g.kv_pad // bk, g.batch, g.kv_heads),
        in_specs=[q_group, kv_block, kv_block, q_group, rows_group, rows_group, *seg_specs],
        out_specs=[kv_block, kv_block],
        out_shape=[_backend.out_struct(kp.shape, k.dtype, *inputs),
                   _backend.out_struct(vp.shape, v.dtype, *inputs)],
        name="flash_attention_dkv",
        **options,
    )(*inputs, *seg_arrays)

    def unpad(grad, length, primal):
        return _backend.match_varying(grad[:, :length, :, : g.head_dim], primal)

    # Segment ids are integers: their cotangent is float0 zeros.
    no_grads = None if segments is None else tuple(
        np.zeros(ids.shape, jax.dtypes.float0) for ids in segments)
    return unpad(dq, g.q_len, q), unpad(dk, g.kv_len, k), unpad(dv, g.kv_len, v), no_grads


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _flash_attention(q, k, v, segments, cfg: _Config):
    return _forward(q, k, v, segments, cfg)[0]


def _flash_attention_fwd(q, k, v, segments, cfg: _Config):
    out, lse = _forward(q, k, v, segments, cfg)
    return out, (q, k, v, segments, out, lse)


_flash_attention.defvjp(_flash_attention_fwd, _backward)


def _segment_pair(segment_ids, q, k):
    """``segment_ids`` (one [B, S] array for self-attention, or a (q, kv) pair) -> int32 pair."""
    if segment_ids is None:
        return None
    q_seg, kv_seg = (segment_ids if isinstance(segment_ids, (tuple, list))
                     else (segment_ids, segment_ids))
    q_seg, kv_seg = jnp.asarray(q_seg, jnp.int32), jnp.asarray(kv_seg, jnp.int32)
    if q_seg.shape != q.shape[:2] or kv_seg.shape != k.shape[:2]:
        raise ValueError(f"segment ids must be [batch, seq] of q {q.shape[:2]} and of kv "
                         f"{k.shape[:2]}; got {q_seg.shape} and {kv_seg.shape}")
    return q_seg, kv_seg


def flash_attention(q, k, v, *, causal: bool = False, sm_scale: float | None = None,
                    block_sizes: BlockSizes | None = None, interpret: bool | None = None,
                    window: int | tuple[int, int] | None = None, segment_ids=None):
    """Memory-efficient attention, `[batch, seq, heads, head_dim]` in and out.

    Args:
      q: `[B, Sq, H, D]`; k, v: `[B, Skv, Hkv, D]` with `H % Hkv == 0` (GQA/MQA).
      causal: query i sees keys j <= i (top-left aligned, as `jax.nn.dot_product_attention`).
      sm_scale: multiplier of q.k; default `1 / sqrt(D)`.
      block_sizes: tiles; default `BlockSizes()` (tuned for GPU).
      interpret: None runs compiled on GPU and in the Pallas interpreter elsewhere.
      window: sliding window `(left, right)` or a symmetric int: query i sees keys
        `i - left <= j <= i + right` (right is 0 when causal). kv blocks outside are skipped.
      segment_ids: int `[B, S]` (self-attention) or a pair `([B, Sq], [B, Skv])`: query i
        sees key j only when their ids are equal (packed examples). None: one segment.

    Returns:
      `[B, Sq, H, D]` in q's dtype; softmax statistics are kept in fp32.
    """
    cfg = _checked_config(q, k, v, causal, sm_scale, block_sizes, interpret, window)
    return _flash_attention(q, k, v, _segment_pair(segment_ids, q, k), cfg)


def _checked_config(q, k, v, causal, sm_scale, block_sizes, interpret, window) -> _Config:
    if q.ndim != 4 or k.ndim != 4 or v.shape != k.shape:
        raise ValueError(f"expected q [B,S,H,D] and k == v [B,S,Hkv,D]; got {q.shape}, "
                         f"{k.shape}, {v.shape}")
    if q.shape[0] != k.shape[0] or q.shape[3] != k.shape[3]:
        raise ValueError(f"q and k must share batch and head_dim; got {q.shape} and {k.shape}")
    if q.shape[2] % k.shape[2]:
        raise ValueError(f"q heads ({q.shape[2]}) must be a multiple of kv heads ({k.shape[2]})")
    return _Config(
        band=_Band.make(causal, window),
        sm_scale=float(1.0 / math.sqrt(q.shape[-1]) if sm_scale is None else sm_scale),
        blocks=BlockSizes() if block_sizes is None else block_sizes,
        interpret=_backend.resolve_interpret(interpret),
    )


def flash_attention_forward(q, k, v, *, causal: bool = False, sm_scale: float | None = None,
                            block_sizes: BlockSizes | None = None, interpret: bool | None = None,
                            window: int | tuple[int, int] | None = None, segment_ids=None):
    """`flash_attention`'s forward pass alone, not differentiable: `(out, lse)` with `lse`
    `[B, H, Sq]` fp32, each row's log-sum-exp of its scaled scores (-inf where a row sees no
    key). Blockwise attention (a ring of key/value blocks) merges such partial results and
    differentiates them with `flash_attention_backward`."""
    cfg = _checked_config(q, k, v, causal, sm_scale, block_sizes, interpret, window)
    out, lse = _forward(q, k, v, _segment_pair(segment_ids, q, k), cfg)
    lse = lse[:, :, : q.shape[1]]
    return out, jnp.where(lse == jnp.inf, -jnp.inf, lse)


def flash_attention_backward(q, k, v, out, lse, d_out, *, causal: bool = False,
                             sm_scale: float | None = None,
                             block_sizes: BlockSizes | None = None,
                             interpret: bool | None = None,
                             window: int | tuple[int, int] | None = None, segment_ids=None):
    """`(dq, dk, dv)` of attention over this block of keys and values, given the whole
    attention's `out` `[B, Sq, H, D]` and `lse` `[B, H, Sq]` (over every block the queries
    saw) and the cotangent `d_out`: each block's share of the gradient, so that summing the
    blocks' `dq` (and each block's own `dk`, `dv`) gives the gradient of the whole."""
    cfg = _checked_config(q, k, v, causal, sm_scale, block_sizes, interpret, window)
    g = _Geometry.of(q, k, cfg.blocks)
    # +inf: a row that sees nothing gets probabilities exp(-inf) = 0, as the forward pass marks it.
    lse = jnp.where(lse == -jnp.inf, jnp.inf, lse.astype(jnp.float32))
    lse = jnp.pad(lse, ((0, 0), (0, 0), (0, g.q_pad - q.shape[1])), constant_values=jnp.inf)
    segments = _segment_pair(segment_ids, q, k)
    dq, dk, dv, _ = _backward(cfg, (q, k, v, segments, out.astype(q.dtype), lse), d_out)
    return dq, dk, dv


def reference_attention(q, k, v, causal: bool = False, sm_scale: float | None = None,
                        window: int | tuple[int, int] | None = None, segment_ids=None):
    """Plain-jnp attention in fp32 with precision="highest"; same semantics, returns fp32."""
    segments = _segment_pair(segment_ids, q, k)
    band = _Band.make(causal, window)
    q, k, v = (x.astype(jnp.float32) for x in (q, k, v))
    group = q.shape[2] // k.shape[2]
    k, v = jnp.repeat(k, group, axis=2), jnp.repeat(v, group, axis=2)
    scale = 1.0 / math.sqrt(q.shape[-1]) if sm_scale is None else sm_scale
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k, precision="highest") * scale
    keep = _visible(0, 0, scores.shape[-2:], band, kv_len=None)
    if segments is not None:
        keep = keep & (segments[0][:, None, :, None] == segments[1][:, None, None, :])
    scores = jnp.where(keep, scores, -jnp.inf)
    any_visible = jnp.any(keep, axis=-1, keepdims=True)
    probs = jnp.where(any_visible, jax.nn.softmax(jnp.where(any_visible, scores, 0.0)), 0.0)
    return jnp.einsum("bhqk,bkhd->bqhd", probs, v, precision="highest")
