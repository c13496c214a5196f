"""A traced step's peak per device without compiling: what its program keeps live.

The step's jaxpr (``TrainStep.trace``) already holds the forward pass, the backward pass as
JAX derived it under the model's remat policy, and the update. Walking it in program order
and keeping each value until its last use shows what the backward pass saves (the values
live when the forward pass ends) and the largest temporary the step makes, with no model of
the network and no compile. Sizes are per device: inside ``shard_map`` the jaxpr's shapes are
already one device's; outside it a value's share of its global shape is read from the
shardings the step places (``device_put``, ``sharding_constraint``, ``shard_map``'s specs) and
otherwise follows the operand of the same shape, as XLA's sharding propagation does.

What the walk does not see is XLA's own scheduling, fusion and buffer reuse; docs/memory.md
gives how far the figure lands from the compiled peak.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

import jax
import numpy as np
from jax.extend.core import Literal, jaxprs_in_params

_HOST = "pinned_host"

_ELEMENTWISE = frozenset(
    "abs add add_any and broadcast_in_dim clamp convert_element_type cos div eq exp exp2 "
    "expm1 ge gt integer_pow is_finite le log log1p logistic lt max min mul ne neg not or "
    "pow reduce_precision rem rsqrt select_n sign sin sqrt square sub tan tanh xor".split()
)
"Operations XLA fuses into their consumer: a result only such operations read is never kept."


class Walk(NamedTuple):
    """One jaxpr's walk: ``peak`` bytes it adds to its inputs at its fullest, ``saved`` of
    them already live before the operation at the peak, ``temporary`` the rest (that
    operation's results and its inner working set), and each output's share per device."""

    peak: float
    saved: float
    temporary: float
    out_shares: list[float]
    reused: list
    at: str = ""
    "The operation at the peak (its path through calls and loops)."


def aval_bytes(aval) -> int:
    """Whole bytes of a value of abstract type ``aval`` (0 for tokens and the like)."""
    shape, dtype = getattr(aval, "shape", None), getattr(aval, "dtype", None)
    if shape is None or dtype is None:
        return 0
    if jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
        return math.prod(shape) * 8  # a threefry key's two uint32 words
    return math.prod(shape) * np.dtype(dtype).itemsize


def sharding_share(sharding, shape: Sequence[int]) -> float:
    """The fraction of a ``shape``d value one device holds under ``sharding`` (0 for host
    memory, 1 where the sharding is not a concrete one)."""
    if getattr(sharding, "memory_kind", None) == _HOST:
        return 0.0
    try:
        local = sharding.shard_shape(tuple(shape))
    except (AttributeError, TypeError, ValueError):
        return 1.0
    whole = math.prod(shape)
    return math.prod(local) / whole if whole else 1.0


def _spec_share(spec, mesh) -> float:
    """One device's share of a ``shard_map`` output laid out by ``spec`` over ``mesh``."""
    sizes = dict(zip(mesh.axis_names, mesh.axis_sizes))
    parts = 1
    for entry in tuple(spec or ()):
        for axis in entry if isinstance(entry, tuple) else (entry,):
            parts *= sizes.get(axis, 1) if axis is not None else 1
    return 1.0 / parts


def _follow(eqn, shares: dict) -> list[float]:
    """Shares of ``eqn``'s outputs where it places nothing itself: that of an operand of the
    same shape (else the same size, else any operand's smallest), as sharding propagation
    keeps an elementwise result, a reshape or a slice where its operand is."""
    ins = [(v.aval, _share(v, shares)) for v in eqn.invars if hasattr(v, "aval")]
    out = []
    for var in eqn.outvars:
        shape = getattr(var.aval, "shape", ())
        same = [s for a, s in ins if getattr(a, "shape", None) == shape]
        size = [s for a, s in ins if math.prod(getattr(a, "shape", ())) == math.prod(shape)]
        small = [s for a, s in ins if math.prod(getattr(a, "shape", ())) > math.prod(shape)]
        pick = same or size or small
        out.append(min(pick) if pick else 1.0)
    return out


def _share(var, shares: dict) -> float:
    return 1.0 if isinstance(var, Literal) else shares.get(var, 1.0)


def _placed(eqn, shares: dict) -> list[float] | None:
    """Output shares of an operation that places its results, or None."""
    name, params = eqn.primitive.name, eqn.params
    if name == "device_put":
        out = []
        for var, dest in zip(eqn.invars, params.get("devices") or ()):
            has = hasattr(dest, "shard_shape") or hasattr(dest, "memory_kind")
            kept = _share(var, shares)
            out.append(sharding_share(dest, var.aval.shape) if has else kept)
        return out if len(out) == len(eqn.outvars) else None
    if name == "sharding_constraint":
        return [sharding_share(params["sharding"], eqn.outvars[0].aval.shape)]
    if name == "shard_map":
        return [_spec_share(spec, params["mesh"]) for spec in params["out_specs"]]
    return None


_CALLS = frozenset(
    "jit pjit closed_call core_call remat2 checkpoint custom_jvp_call custom_vjp_call "
    "custom_vjp_call_jaxpr cond".split()
)
"Operations whose inner jaxprs take their operands (after a branch index) and give their results."
_IN_PLACE = _ELEMENTWISE | frozenset(
    "device_put sharding_constraint copy copy_p reshape transpose dynamic_update_slice scatter "
    "scatter-add".split()
)
"Operations whose result XLA may write into an operand's buffer where that operand dies."


def _inner_walks(eqn, shares: dict, local: bool, reusable: set) -> list[Walk]:
    """Walks of the jaxprs inside ``eqn`` (a call, a loop's body, a branch, ``shard_map``),
    their inputs' shares taken from the operands they line up with from the end; an operand
    in ``reusable`` (it dies here) may give its buffer to a result of a call's jaxpr."""
    walks = []
    call = eqn.primitive.name in _CALLS
    for inner in jaxprs_in_params(eqn.params):
        outer = list(eqn.invars)[-len(inner.invars) :] if inner.invars else []
        pad = len(inner.invars) - len(outer)
        if eqn.primitive.name == "shard_map" or local:
            in_shares = [1.0] * len(inner.invars)
        else:
            in_shares = [1.0] * pad + [_share(v, shares) for v in outer]
        donors = {
            pad + k
            for k, v in enumerate(outer)
            if call and not isinstance(v, Literal) and v in reusable
        }
        inside = local or eqn.primitive.name == "shard_map"
        walks.append(walk(inner, in_shares, local=inside, reusable=donors))
    return walks


class _Buffer(NamedTuple):
    counted: float
    "Bytes it adds to the walk (0 for a caller's buffer)."
    size: float
    "Bytes it holds (what a result written into it may need)."
    origin: int | None
    "The position of the caller's input it is, if it is one."


def walk(jaxpr, in_shares: Sequence[float], *, local: bool = False, reusable=()) -> Walk:
    """Walk ``jaxpr`` (open) in program order, each value kept from the operation that makes
    it to its last use (an output to the end). Inputs and constants are the caller's and are
    not counted. ``local``: shapes are already one device's (inside ``shard_map``).
    ``reusable``: positions of inputs whose buffers a result may take over at their last use
    (donated, or dying at the call); such a result costs nothing, and ``Walk.reused`` says
    which input each output took over. A fused result (``_fused``) holds no buffer of its own
    but keeps its operands' until its consumer runs, which may write into one of them."""
    shares: dict = dict(zip(jaxpr.invars, in_shares))
    last_use = _last_uses(jaxpr)
    fused = _fused(jaxpr)
    size = lambda v: aval_bytes(v.aval) * _share(v, shares)  # noqa: E731
    live: dict = {
        v: [_Buffer(0.0, size(v), k)] for k, v in enumerate(jaxpr.invars) if k in set(reusable)
    }
    best = Walk(0.0, 0.0, 0.0, [], [])
    for i, eqn in enumerate(jaxpr.eqns):
        dying = [v for v in _vars(eqn.invars) if last_use.get(v) == i]
        donors = {v for v in dying if any(b.size for b in live.get(v, ()))}
        inner = _inner_walks(eqn, shares, local, donors)
        _set_shares(eqn, shares, inner, local)
        pool = {v: live.pop(v) for v in dying if v in live}
        before = sum(b.counted for bufs in [*live.values(), *pool.values()] for b in bufs)
        made = _results(eqn, inner, pool, fused, size)
        # Buffers taken over from dying operands are already in ``before``.
        reused = {id(b) for bufs in pool.values() for b in bufs}
        new = sum(
            b.counted
            for v, bufs in made.items()
            if v in last_use
            for b in bufs
            if id(b) not in reused
        )
        working = max((w.peak for w in inner), default=0.0)
        # An inner jaxpr's peak counts the results it has made by then: they are the eqn's.
        if before + max(new, working) > best.peak:
            deepest = max(inner, key=lambda w: w.peak).at if working > new else ""
            at = eqn.primitive.name + (f"/{deepest}" if deepest else "")
            best = Walk(before + max(new, working), before, max(new, working), [], [], at)
        live.update((v, bufs) for v, bufs in made.items() if v in last_use)
    outs = [_share(v, shares) for v in jaxpr.outvars]
    taken_over = [
        next((b.origin for b in live.get(v, ()) if b.origin is not None), None)
        if not isinstance(v, Literal)
        else None
        for v in jaxpr.outvars
    ]
    return best._replace(out_shares=outs, reused=taken_over)


def _vars(values) -> list:
    return [v for v in values if not isinstance(v, Literal)]


def _results(eqn, inner: list[Walk], pool: dict, fused: set, size) -> dict:
    """``{result: its buffers}``: a fused result carries its dying operands' buffers, a result
    written in place takes a dying operand's buffer of its size, any other is new."""
    outs = list(eqn.outvars)
    if len(outs) == 1 and outs[0] in fused:
        return {outs[0]: [b for bufs in pool.values() for b in bufs]}
    spare = [b for bufs in pool.values() for b in bufs]
    made = {}
    if eqn.primitive.name in _CALLS and inner:
        agreed = [ks[0] if len(set(ks)) == 1 else None for ks in zip(*(w.reused for w in inner))]
        operands = list(eqn.invars)[-len(next(iter(jaxprs_in_params(eqn.params))).invars) :]
        for out, k in zip(outs, agreed):
            donor = operands[k] if k is not None else None
            match = [b for b in pool.get(donor, ()) if b in spare and b.size == size(out)][:1]
            if not isinstance(donor, Literal) and match:
                spare.remove(match[0])
                made[out] = match
    elif eqn.primitive.name in _IN_PLACE:
        for out in outs:
            match = [b for b in spare if b.size == size(out) and b.size > 0][:1]
            if match:
                spare.remove(match[0])
                made[out] = match
    for out in outs:
        made.setdefault(out, [_Buffer(size(out), size(out), None)])
    return made


def _last_uses(jaxpr) -> dict:
    """Each value's last reader's position (the jaxpr's outputs: one past the end)."""
    last_use: dict = {}
    for i, eqn in enumerate(jaxpr.eqns):
        for v in eqn.invars:
            if not isinstance(v, Literal):
                last_use[v] = i
    for v in jaxpr.outvars:
        if not isinstance(v, Literal):
            last_use[v] = len(jaxpr.eqns)
    return last_use


def _set_shares(eqn, shares: dict, inner: list[Walk], local: bool) -> None:
    """Record the per-device shares of ``eqn``'s results."""
    placed: list[float] | None
    if local:
        placed = [1.0] * len(eqn.outvars)
    else:
        placed = _placed(eqn, shares)
        if placed is None and inner and eqn.primitive.name != "shard_map":
            placed = _inner_outputs(eqn, inner[0])
        placed = placed or _follow(eqn, shares)
    for var, share in zip(eqn.outvars, placed or []):
        shares[var] = share


def _inner_outputs(eqn, inner: Walk) -> list[float] | None:
    """Output shares of a call-like ``eqn`` from its inner jaxpr's (a loop's stacked outputs
    keep their per-step share), where the counts line up."""
    shares = inner.out_shares
    if len(shares) == len(eqn.outvars):
        return list(shares)
    if len(shares) < len(eqn.outvars):  # e.g. a scan's carries + stacked outputs
        return [1.0] * (len(eqn.outvars) - len(shares)) + list(shares)
    return list(shares[-len(eqn.outvars) :])


def _fused(jaxpr) -> set:
    """Results XLA never writes out (not outputs): an elementwise operation's read only by
    elementwise ones (computed inside their fused loop), a transpose's read only by matmuls
    or elementwise operations (their operand's layout)."""
    readers: dict = {}
    for eqn in jaxpr.eqns:
        for v in eqn.invars:
            if not isinstance(v, Literal):
                readers.setdefault(v, []).append(eqn.primitive.name)
    outputs = {v for v in jaxpr.outvars if not isinstance(v, Literal)}
    fused: set = set()
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        # A transpose read by matmuls becomes their operand layout (no copy); an elementwise
        # result is computed inside its elementwise readers' loop.
        into = _ELEMENTWISE | {"dot_general"} if name == "transpose" else _ELEMENTWISE
        if name in _ELEMENTWISE or name == "transpose":
            fused.update(
                v
                for v in eqn.outvars
                if v not in outputs and readers.get(v) and all(r in into for r in readers[v])
            )
    return fused
