"""Attention in plain jnp, with the semantics of the Pallas kernels: the reference the tests
compare against, and a dense (O(seq^2) memory) stand-in for the Mosaic GPU interpreter where it
cannot run.

The interpreter simulates every device of the manual mesh axes it is traced under and waits at
the end of a kernel for all of them; XLA:CPU runs the devices of a ``shard_map`` one after
another, so inside ``shard_map`` over more than one CPU device an interpreted kernel would wait
forever. There (and only there: a CPU multi-device step with ``interpret``) the kernels'
forward and backward are computed by :func:`dense_forward` and :func:`dense_backward`, the same
arithmetic in fp32 without tiles. Compiled kernels, and the interpreter anywhere else, are
unaffected.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class Band:
    """Key j is visible from query i iff i - left <= j <= i + right (None: unbounded)."""

    left: int | None
    right: int | None

    @classmethod
    def make(cls, causal: bool, window) -> Band:
        left = right = None
        if window is not None:
            left, right = (window, window) if isinstance(window, int) else tuple(window)
            for side in (left, right):
                if not isinstance(side, int) or side < 0:
                    raise ValueError(f"window must be an int >= 0 or (left, right); got {window!r}")
        if causal:
            right = 0
        return cls(left, right)

    @property
    def bounded(self) -> bool:
        return self.left is not None or self.right is not None


def segment_pair(segment_ids, q, k):
    """``segment_ids`` (one [B, S] array for self-attention, or a (q, kv) pair) -> int32 pair."""
    if segment_ids is None:
        return None
    q_seg, kv_seg = (
        segment_ids if isinstance(segment_ids, (tuple, list)) else (segment_ids, segment_ids)
    )
    q_seg, kv_seg = jnp.asarray(q_seg, jnp.int32), jnp.asarray(kv_seg, jnp.int32)
    if q_seg.shape != q.shape[:2] or kv_seg.shape != k.shape[:2]:
        raise ValueError(
            f"segment ids must be [batch, seq] of q {q.shape[:2]} and of kv "
            f"{k.shape[:2]}; got {q_seg.shape} and {kv_seg.shape}"
        )
    return q_seg, kv_seg


def reference_attention(
    q,
    k,
    v,
    causal: bool = False,
    sm_scale: float | None = None,
    window: int | tuple[int, int] | None = None,
    segment_ids=None,
):
    """Plain-jnp attention in fp32 with precision="highest"; same semantics, returns fp32."""
    segments = segment_pair(segment_ids, q, k)
    keep = _keep(q.shape[1], k.shape[1], Band.make(causal, window), segments)
    scale = 1.0 / math.sqrt(q.shape[-1]) if sm_scale is None else sm_scale
    scores = jnp.where(keep, _grouped_scores(q, k, scale), -jnp.inf)
    any_visible = jnp.any(keep, axis=-1, keepdims=True)
    probs = jnp.where(any_visible, jax.nn.softmax(jnp.where(any_visible, scores, 0.0)), 0.0)
    v32 = jnp.repeat(v.astype(jnp.float32), q.shape[2] // k.shape[2], axis=2)
    return jnp.einsum("bhqk,bkhd->bqhd", probs, v32, precision="highest")


def _keep(q_len: int, kv_len: int, band: Band, segments):
    """Boolean [B or 1, 1, Sq, Skv]: which keys each query sees."""
    rows = jnp.arange(q_len)[:, None]
    cols = jnp.arange(kv_len)[None, :]
    keep = jnp.ones((q_len, kv_len), bool)
    if band.left is not None:
        keep = keep & (cols >= rows - band.left)
    if band.right is not None:
        keep = keep & (cols <= rows + band.right)
    keep = keep[None, None]
    if segments is not None:
        keep = keep & (segments[0][:, None, :, None] == segments[1][:, None, None, :])
    return keep


def _grouped_scores(q, k, sm_scale):
    """fp32 scaled scores [B, H, Sq, Skv] with each q head against its kv head."""
    group = q.shape[2] // k.shape[2]
    k = jnp.repeat(k.astype(jnp.float32), group, axis=2)
    return jnp.einsum("bqhd,bkhd->bhqk", q.astype(jnp.float32), k, precision="highest") * sm_scale


def dense_forward(q, k, v, segments, band: Band, sm_scale: float):
    """(out [B, Sq, H, D] in q's dtype, lse [B, H, Sq] fp32 with +inf where a row sees no key),
    as the forward kernel returns them."""
    keep = _keep(q.shape[1], k.shape[1], band, segments)
    s = jnp.where(keep, _grouped_scores(q, k, sm_scale), -jnp.inf)
    m = jnp.max(s, axis=-1, keepdims=True)
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    p = jnp.exp(s - m)
    total = jnp.sum(p, axis=-1)
    v32 = jnp.repeat(v.astype(jnp.float32), q.shape[2] // k.shape[2], axis=2)
    out = jnp.einsum("bhqk,bkhd->bqhd", p, v32, precision="highest")
    out = out / jnp.maximum(jnp.swapaxes(total, 1, 2), 1e-30)[..., None]
    lse = jnp.where(total > 0, m[..., 0] + jnp.log(jnp.maximum(total, 1e-30)), jnp.inf)
    return out.astype(q.dtype), lse


def dense_backward(q, k, v, segments, out, lse, d_out, band: Band, sm_scale: float):
    """(dq, dk, dv) from the saved ``lse`` [B, H, Sq] (+inf: the row sees nothing), as the
    backward kernels compute them."""
    group = q.shape[2] // k.shape[2]
    keep = _keep(q.shape[1], k.shape[1], band, segments)
    p = jnp.where(keep, jnp.exp(_grouped_scores(q, k, sm_scale) - lse[..., None]), 0.0)
    do = d_out.astype(jnp.float32)
    delta = jnp.einsum("bqhd,bqhd->bhq", out.astype(jnp.float32), do)
    v32 = jnp.repeat(v.astype(jnp.float32), group, axis=2)
    k32 = jnp.repeat(k.astype(jnp.float32), group, axis=2)
    dp = jnp.einsum("bqhd,bkhd->bhqk", do, v32, precision="highest")
    ds = p * (dp - delta[..., None]) * sm_scale
    dq = jnp.einsum("bhqk,bkhd->bqhd", ds, k32, precision="highest")
    per_head = lambda x: x.reshape(*x.shape[:2], k.shape[2], group, x.shape[-1]).sum(3)  # noqa: E731
    dk = per_head(jnp.einsum("bhqk,bqhd->bkhd", ds, q.astype(jnp.float32), precision="highest"))
    dv = per_head(jnp.einsum("bhqk,bqhd->bkhd", p, do, precision="highest"))
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)
