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


def itemsize(dtype) -> int:
    """Bytes per element, also of a PRNG key array (its key data's)."""
    if jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
        data = jax.eval_shape(jax.random.key_data, jax.ShapeDtypeStruct((), dtype))
        return math.prod(data.shape) * data.dtype.itemsize
    return np.dtype(dtype).itemsize


def aval_bytes(aval) -> int:
    """Whole bytes of a value of abstract type ``aval`` (0 for tokens and the like)."""
    shape, dtype = getattr(aval, "shape", None), getattr(aval, "dtype", None)
    return 0 if shape is None or dtype is None else math.prod(shape) * itemsize(dtype)


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


def _inner_walks(eqn, shares: dict, local: bool, reusable: set, overlap: bool) -> list[Walk]:
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
        sliced = _scanned_slices(eqn, inner)
        walks.append(
            walk(inner, in_shares, local=inside, reusable=donors, sliced=sliced, overlap=overlap)
        )
    return walks


def _scanned_slices(eqn, inner) -> range:
    """Positions of a scan body's inputs that are one step's slice of a stacked operand: the
    trailing ones whose operand has the body input's shape under a leading ``length`` axis
    (read from the shapes: how jax records the split into constants, carries and slices
    differs between its versions)."""
    if eqn.primitive.name != "scan":
        return range(0)
    start = len(inner.invars)
    for outer, body in zip(reversed(eqn.invars), reversed(inner.invars)):
        shape, step = getattr(outer.aval, "shape", ()), getattr(body.aval, "shape", None)
        if not shape or shape[0] != eqn.params["length"] or tuple(shape[1:]) != step:
            break
        start -= 1
    return range(start, len(inner.invars))


class _Buffer(NamedTuple):
    counted: float
    "Bytes it adds to the walk (0 for a caller's buffer)."
    size: float
    "Bytes it holds (what a result written into it may need)."
    origin: int | None
    "The position of the caller's input it is, if it is one."


def walk(
    jaxpr,
    in_shares: Sequence[float],
    *,
    local: bool = False,
    reusable=(),
    sliced=(),
    overlap: bool = False,
) -> Walk:
    """Walk ``jaxpr`` (open) in program order, each value kept from the operation that makes
    it to its last use (an output to the end). Inputs and constants are the caller's and are
    not counted. ``local``: shapes are already one device's (inside ``shard_map``).
    ``reusable``: positions of inputs whose buffers a result may take over at their last use
    (donated, or dying at the call); such a result costs nothing, and ``Walk.reused`` says
    which input each output took over. ``sliced``: positions of inputs that are one step's
    slice of a stacked operand (a scan's), copied out of the stack as the step begins where
    something other than an elementwise operation reads them (``_copied_slices``).
    ``overlap``: collectives overlap the computation before them (XLA:GPU's scheduler,
    ``_started_in_loop``). A fused result (``_fused``) holds no buffer of its own but keeps
    its operands' until its consumer runs, which may write into one of them; a view
    (``_views``) is its operand's buffer. The operations run in ``_scheduled``'s order."""
    shares: dict = dict(zip(jaxpr.invars, in_shares))
    runs = _psum_runs(jaxpr)  # as traced: XLA combines before it schedules
    jaxpr = _scheduled(jaxpr)
    last_use = _last_uses(jaxpr, runs)
    fused = _fused(jaxpr)
    size = lambda v: aval_bytes(v.aval) * _share(v, shares)  # noqa: E731
    live: dict = {
        v: [_Buffer(0.0, size(v), k)] for k, v in enumerate(jaxpr.invars) if k in set(reusable)
    }
    live.update((v, [_Buffer(size(v), size(v), None)]) for v in _copied_slices(jaxpr, sliced))
    best = Walk(0.0, 0.0, 0.0, [], [])
    for i, eqn in enumerate(jaxpr.eqns):
        dying = [v for v in _vars(eqn.invars) if last_use.get(v) == i]
        donors = {v for v in dying if any(b.size for b in live.get(v, ()))}
        inner = _inner_walks(eqn, shares, local, donors, overlap)
        _set_shares(eqn, shares, inner, local)
        pool = {v: live.pop(v) for v in dying if v in live}
        held = {id(b): b for bufs in [*live.values(), *pool.values()] for b in bufs}
        before = sum(b.counted for b in held.values())
        made = _results(eqn, inner, live, pool, fused, size)
        # Buffers taken over from operands (dying, or viewed) are already in ``before``.
        fresh = {id(b): b for v, bufs in made.items() if v in last_use for b in bufs}
        new = sum(b.counted for k, b in fresh.items() if k not in held)
        working = max((w.peak for w in inner), default=0.0)
        working += _started_in_loop(jaxpr, i) if overlap and inner else 0.0
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


class _Program(NamedTuple):
    invars: list
    outvars: list
    eqns: list


def _scheduled(jaxpr) -> _Program:
    """``jaxpr``'s operations in the order a scheduler that keeps memory low runs them, as far
    as the walk can tell: one reading only the jaxpr's inputs (a gather of a layer's weights)
    runs just before its first reader rather than where the trace put it."""
    produced = {v for eqn in jaxpr.eqns for v in eqn.outvars}
    movable = {
        id(e): e for e in jaxpr.eqns if e.outvars and not produced.intersection(_vars(e.invars))
    }
    maker = {v: e for e in movable.values() for v in e.outvars}
    moved, order = set(movable), list[object]()
    for eqn in jaxpr.eqns:
        if id(eqn) not in moved:
            order += [
                movable.pop(id(e))
                for e in map(maker.get, _vars(eqn.invars))
                if e and id(e) in movable
            ]
            order.append(eqn)
    order += movable.values()  # read by nothing but the outputs
    return _Program(list(jaxpr.invars), list(jaxpr.outvars), order)


_COLLECTIVES = frozenset(
    "all_gather psum psum_invariant psum_scatter reduce_scatter all_to_all".split()
)


def _started_in_loop(jaxpr, i: int) -> float:
    """Bytes of the collectives that read a result of the loop at ``i`` directly: XLA:GPU
    peels the loop's last step and starts them inside it, overlapping the step's remaining
    work, so their results are live at the loop's fullest (one device's shapes: inside
    ``shard_map``, where collectives are)."""
    eqn = jaxpr.eqns[i]
    if eqn.primitive.name not in ("scan", "while"):
        return 0.0
    results = set(eqn.outvars)
    return float(
        sum(
            aval_bytes(out.aval)
            for later in jaxpr.eqns[i + 1 :]
            if later.primitive.name in _COLLECTIVES and results.intersection(_vars(later.invars))
            for out in later.outvars
        )
    )


def _vars(values) -> list:
    return [v for v in values if not isinstance(v, Literal)]


def _results(eqn, inner: list[Walk], live: dict, pool: dict, fused: set, size) -> dict:
    """``{result: its buffers}``: a view is its operand's buffers (none for a caller's input), a
    fused result carries its dying operands' buffers, a result written in place takes a dying
    operand's buffer of its size, any other is new."""
    outs = list(eqn.outvars)
    views = _views(eqn, size)
    if views:
        return {out: list(live.get(v) or pool.get(v) or []) for out, v in views.items()}
    if outs and all(out in fused for out in outs):  # each keeps the dying operands' buffers
        return {out: [b for bufs in pool.values() for b in bufs] for out in outs}
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


_VIEWS = frozenset("device_put sharding_constraint reshape squeeze expand_dims".split())
"Operations whose result XLA makes a view of the operand (a bitcast) where its bytes on the "
"device do not change: a placement where the value already is, a reshape."


def _views(eqn, size) -> dict:
    """``{result: the operand it views}`` for a view operation whose result has its operand's
    bytes on the device (else empty: the result is a copy, a gather or a move)."""
    if eqn.primitive.name not in _VIEWS:
        return {}
    pairs = zip(eqn.outvars, eqn.invars if eqn.primitive.name == "device_put" else eqn.invars[:1])
    views = {out: v for out, v in pairs if not isinstance(v, Literal) and size(out) == size(v)}
    return views if len(views) == len(eqn.outvars) else {}


def _copied_slices(jaxpr, sliced) -> set:
    """The ``sliced`` inputs some operation other than an elementwise one reads: XLA copies
    such a step's slice out of its stack (a dynamic slice fused into its elementwise readers
    costs nothing)."""
    inputs = {jaxpr.invars[k] for k in sliced}
    return {
        v
        for eqn in jaxpr.eqns
        if eqn.primitive.name not in _ELEMENTWISE
        for v in _vars(eqn.invars)
        if v in inputs
    }


_PSUMS = frozenset({"psum", "psum_invariant"})
COMBINE_BYTES = 30 * 1024 * 1024
"XLA's all-reduce combiner's default threshold (``xla_gpu_all_reduce_combine_threshold_bytes``)."


def _last_uses(jaxpr, runs=()) -> dict:
    """Each value's last reader's position (the jaxpr's outputs: one past the end). XLA
    combines a run of consecutive independent ``psum``s (``runs``, ``_psum_runs``) into one
    all-reduce, which holds all their operands until it ends."""
    last_use: dict = {}
    for i, eqn in enumerate(jaxpr.eqns):
        for v in eqn.invars:
            if not isinstance(v, Literal):
                last_use[v] = i
    for v in jaxpr.outvars:
        if not isinstance(v, Literal):
            last_use[v] = len(jaxpr.eqns)
    position = {id(eqn): i for i, eqn in enumerate(jaxpr.eqns)}
    for run in runs:
        end = max(position[id(eqn)] for eqn in run)
        for eqn in run:
            for v in _vars(eqn.invars):
                last_use[v] = max(last_use[v], end)
    return last_use


def _psum_runs(jaxpr) -> list[list]:
    """Runs of consecutive ``psum``s over the same axes, none reading another's result, at
    most ``COMBINE_BYTES`` of operands each."""
    runs: list[list[int]] = []
    made: set = set()
    total = 0.0
    for i, eqn in enumerate(jaxpr.eqns):
        bytes_in = sum(aval_bytes(v.aval) for v in _vars(eqn.invars))
        joins = (
            eqn.primitive.name in _PSUMS
            and runs
            and runs[-1][-1] == i - 1
            and jaxpr.eqns[i - 1].params.get("axes") == eqn.params.get("axes")
            and not made.intersection(_vars(eqn.invars))
            and total + bytes_in <= COMBINE_BYTES
        )
        if joins:
            runs[-1].append(i)
            total += bytes_in
        elif eqn.primitive.name in _PSUMS:
            runs.append([i])
            made, total = set(), bytes_in
        made.update(eqn.outvars)
    return [[jaxpr.eqns[i] for i in run] for run in runs if len(run) > 1]


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


def _elementwise_call(eqn) -> bool:
    """A call holding only elementwise operations (jax versions wrap some, optax's bias
    correction among them, in a ``jit``); XLA inlines it and fuses them like any other."""
    if eqn.primitive.name not in ("jit", "pjit", "closed_call"):
        return False
    inner = list(jaxprs_in_params(eqn.params))
    return bool(inner) and all(
        e.primitive.name in _ELEMENTWISE or _elementwise_call(e) for j in inner for e in j.eqns
    )


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
        # result is computed inside its elementwise readers' loop. Of several results (an
        # elementwise call's), XLA fuses each into a consumer only where it has just one.
        into = _ELEMENTWISE | {"dot_general"} if name == "transpose" else _ELEMENTWISE
        several = len(eqn.outvars) > 1
        if name in _ELEMENTWISE or name == "transpose" or (several and _elementwise_call(eqn)):
            fused.update(
                v
                for v in eqn.outvars
                if v not in outputs
                and readers.get(v)
                and all(r in into for r in readers[v])
                and not (several and len(readers[v]) > 1)
            )
    return fused
