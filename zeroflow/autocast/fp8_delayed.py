"""Delayed scaling for FP8 matmuls: each matmul site scales with the amax history of past steps.

Current scaling (``fp8.py``) reads the amax of every tensor before casting it: one extra pass
over each operand. Delayed scaling (Transformer Engine's recipe, as Flax's ``fp8_ops``
implements it) takes the scale from the largest amax of the last ``history`` steps instead,
``scale = max(history) / max_finite * 2**margin`` (``x / scale`` is cast), and records the
amax of the tensor it actually casts into the history for the next step. An empty history (all
zeros: the first step) keeps the previous scale, 1 at the start. A tensor larger than the
history predicts saturates at the format's largest finite value.

State: one ``SiteMeta`` per FP8 matmul site, three ``(scale, history)`` pairs (the lhs and rhs
in e4m3, the incoming gradient in e5m2), in a dict keyed by the site's position in the program
(``"12/3"``: equation 3 of the body of equation 12). A site inside a ``scan`` (a layer stack)
has one history per iteration: its arrays carry the scan's length in front.

The state flows the functional way, Flax's "overwrite with gradient": the state is an input of
the differentiated function and its cotangent *is* the updated state (``scaled_dot_delayed``'s
backward rule returns the new histories and scales instead of a derivative), so
``jax.grad`` with respect to the state returns the next step's state, including the gradient's
amax that only the backward pass sees. The scale math is Flax's (``fp8_ops.compute_scale``,
``compute_amax_history``); Flax's own FP8 dot keeps this state in Flax variables of a module
written for it, which an unmodified model has not.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax.linen import fp8_ops

from zeroflow.autocast import fp8
from zeroflow.autocast.fp8 import E4M3, E5M2
from zeroflow.util.settings import FP8_HISTORY

DEFAULT_HISTORY = FP8_HISTORY
"Steps of amax history per tensor: Transformer Engine's and Flax's default."


class ScaleMeta(NamedTuple):
    """One tensor's delayed-scaling state: the scale last used and the recent amaxes."""

    scale: Any  # f32[*loops]
    history: Any  # f32[*loops, history]


class SiteMeta(NamedTuple):
    """An FP8 matmul site's state: its two e4m3 operands and its e5m2 incoming gradient."""

    lhs: ScaleMeta
    rhs: ScaleMeta
    grad: ScaleMeta


def next_scale(meta: ScaleMeta, fmt, margin: int):
    """The scale to cast with this step: from the history's max (past steps only). A scale that
    is not a positive finite number (a site whose state came back as zeros: its output was
    unused, so its cotangent was zero) counts as 1, like an empty history."""
    prev = meta.scale.astype(jnp.float32)
    prev = jnp.where((prev > 0) & jnp.isfinite(prev), prev, jnp.float32(1.0))
    amax = jnp.max(meta.history, axis=-1)
    return fp8_ops.compute_scale(amax, prev, fp8.largest(fmt), margin)


def record(meta: ScaleMeta, x, scale) -> ScaleMeta:
    """The state after casting ``x`` with ``scale``: ``x``'s amax enters the history."""
    return ScaleMeta(scale, fp8_ops.compute_amax_history(x, meta.history))


def _forward(lhs, rhs, meta: SiteMeta, dims, out_dtype, margin):
    s_lhs = next_scale(meta.lhs, E4M3, margin)
    s_rhs = next_scale(meta.rhs, E4M3, margin)
    q_lhs, q_rhs = fp8.quantize(lhs, s_lhs, E4M3), fp8.quantize(rhs, s_rhs, E4M3)
    narrow = jnp.dtype(out_dtype).itemsize == 2
    acc = jax.lax.dot_general(
        q_lhs, q_rhs, dims, preferred_element_type=out_dtype if narrow else jnp.float32
    )
    out = (acc.astype(jnp.float32) * (s_lhs * s_rhs)).astype(out_dtype)
    seen = (record(meta.lhs, lhs, s_lhs), record(meta.rhs, rhs, s_rhs))
    return out, (q_lhs, s_lhs, q_rhs, s_rhs, seen)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def scaled_dot_delayed(lhs, rhs, meta: SiteMeta, dims, out_dtype, margin: int = 0):
    """``dot_general(lhs, rhs, dims)`` in FP8 with delayed per-tensor scales from ``meta``.
    Differentiated, the cotangent of ``meta`` is the site's next ``SiteMeta``."""
    return _forward(lhs, rhs, meta, dims, out_dtype, margin)[0]


def _fwd(lhs, rhs, meta, dims, out_dtype, margin):
    out, (q_lhs, s_lhs, q_rhs, s_rhs, seen) = _forward(lhs, rhs, meta, dims, out_dtype, margin)
    tags = (jnp.zeros((0,), lhs.dtype), jnp.zeros((0,), rhs.dtype))
    res = (fp8._as_bytes(q_lhs), s_lhs, fp8._as_bytes(q_rhs), s_rhs, seen, meta.grad, tags)
    return out, res


def _bwd(dims, out_dtype, margin, res, g):
    b_lhs, s_lhs, b_rhs, s_rhs, (lhs_meta, rhs_meta), grad_meta, (lhs_tag, rhs_tag) = res
    q_lhs, q_rhs = fp8._from_bytes(b_lhs), fp8._from_bytes(b_rhs)
    s_g = next_scale(grad_meta, E5M2, margin)
    q_g = fp8.quantize(g, s_g, E5M2)
    d_lhs = fp8_ops.dot_general_transpose_lhs(
        q_g, q_lhs, q_rhs, **fp8._transpose_args(dims, lhs_tag.dtype)
    )
    d_rhs = fp8_ops.dot_general_transpose_rhs(
        q_g, q_lhs, q_rhs, **fp8._transpose_args(dims, rhs_tag.dtype)
    )
    # overwrite with gradient: the state's "cotangent" is the state for the next step
    new_meta = SiteMeta(lhs_meta, rhs_meta, record(grad_meta, g, s_g))
    return (
        (d_lhs.astype(jnp.float32) * (s_g * s_rhs)).astype(lhs_tag.dtype),
        (d_rhs.astype(jnp.float32) * (s_g * s_lhs)).astype(rhs_tag.dtype),
        new_meta,
    )


scaled_dot_delayed.defvjp(_fwd, _bwd)


def fresh_meta(shape: tuple[int, ...], history: int) -> SiteMeta:
    """The first step's state: scale 1, empty (zero) history; ``shape`` is the loops' lengths.
    NumPy, not jax: made while a loop body is traced, it must not become that trace's value."""

    def one():
        return ScaleMeta(np.ones(shape, np.float32), np.zeros((*shape, history), np.float32))

    return SiteMeta(one(), one(), one())


def materialize(abstract: dict, history: int) -> dict:
    """Fresh state for every site of ``abstract`` (the shapes ``init`` found)."""
    return {key: fresh_meta(tuple(site.lhs.scale.shape), history) for key, site in abstract.items()}


def is_state(tree) -> bool:
    """Whether ``tree`` is a delayed-scaling state: a dict of ``SiteMeta`` by site key."""
    return isinstance(tree, dict) and all(isinstance(v, SiteMeta) for v in tree.values())


# --------------------------------------------------------------------------- sites
@dataclasses.dataclass
class Sites:
    """The delayed-scaling state of one interpretation: ``metas`` by site key. ``init`` mode
    creates fresh state for each site it meets (``history`` steps long); ``path`` is the
    position of the equation being run."""

    metas: dict
    init: bool
    history: int
    margin: int
    path: tuple[int, ...] = ()
    in_while: bool = False

    def take(self) -> SiteMeta:
        key = key_of(self.path)
        if self.in_while:
            raise ValueError(
                "fp8_scaling='delayed' cannot keep an amax history for a matmul inside a "
                "while loop (no gradient flows out of it); use fp8_scaling='tensor'"
            )
        if self.init and key not in self.metas:
            self.metas[key] = fresh_meta((), self.history)
        if key not in self.metas:
            raise ValueError(
                f"fp8 state has no entry for matmul site {key!r}: build it with the autocast "
                "function's .init(...) on arguments of the same structure"
            )
        return self.metas[key]

    def inner(self, prefix: tuple[int, ...]) -> dict:
        """The metas of the sites under equation ``prefix`` (a scan body's)."""
        head = key_of(prefix) + "_"
        return {k: v for k, v in self.metas.items() if k.startswith(head)}


def key_of(path: tuple[int, ...]) -> str:
    """``(12, 3)`` -> ``"dot_12_3"``: a plain name (no ``/`` or ``.``) for checkpoint paths."""
    return "_".join(["dot", *(str(i) for i in path)])


_ACTIVE: list[Sites] = []


def active() -> Sites | None:
    return _ACTIVE[-1] if _ACTIVE else None


@contextlib.contextmanager
def using(sites: Sites):
    _ACTIVE.append(sites)
    try:
        yield sites
    finally:
        _ACTIVE.pop()


@contextlib.contextmanager
def at(index: int):
    """Run an equation: the site key of anything it binds starts with its index."""
    sites = active()
    if sites is None:
        yield
        return
    saved = sites.path
    sites.path = (*saved, index)
    try:
        yield
    finally:
        sites.path = saved


@contextlib.contextmanager
def scan_body(sites: Sites | None, step_metas: dict):
    """Run a scan body with this iteration's state. Yields the dict of state the body makes
    (init mode: returned as the scan's outputs, so stacked over the iterations; else empty)."""
    if sites is None:
        yield {}
        return
    child = dataclasses.replace(sites, metas=dict(step_metas))
    with using(child):
        yield child.metas if sites.init else {}


@contextlib.contextmanager
def in_while():
    """A while loop's body and condition: no per-step state can flow out of them."""
    sites = active()
    if sites is None:
        yield
        return
    saved, sites.in_while = sites.in_while, True
    try:
        yield
    finally:
        sites.in_while = saved
