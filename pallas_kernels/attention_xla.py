"""Attention in plain jnp with the semantics of the Pallas kernels (the band, segment ids):
the reference the tests compare against, computed in fp32 with precision="highest"."""

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
