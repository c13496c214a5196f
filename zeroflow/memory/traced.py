"""A traced step's peak per device without compiling: what its program keeps live.

The step's jaxpr (``TrainStep.trace``) already holds the forward pass, the backward pass as
JAX derived it under the model's remat policy, and the update. Walking it in program order and
keeping each value until its last use shows what the backward pass saves and the largest
temporary the step makes, with no model of the network and no compile. Sizes are per device:
inside ``shard_map`` the jaxpr's shapes are already one device's; outside it a value's share is
read from the shardings the step places (``device_put``, ``sharding_constraint``,
``shard_map``'s specs), else it follows its operands as XLA's sharding propagation does. The
rules that stand for XLA's fusion, buffer reuse and schedule, and how far the figure lands from
the compiled peak, are in docs/memory.md ("The instant estimate").
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

import jax
import numpy as np
from jax.extend.core import Literal, jaxprs_in_params

_ELEMENTWISE = frozenset(
    "abs add add_any and broadcast_in_dim clamp convert_element_type cos div eq exp exp2 "
    "expm1 ge gt integer_pow is_finite le log log1p logistic lt max min mul ne neg not "
    "one_minus_square or "
    "pow reduce_precision rem rsqrt select_n sign sin sqrt square sub tan tanh xor".split()
)
"Operations XLA fuses into their consumer: a result only such operations read is never kept."
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
_VIEWS = frozenset("device_put sharding_constraint reshape squeeze expand_dims".split())
"Operations whose result is a view of the operand (a bitcast) where its bytes do not change."
_COLLECTIVES = frozenset(
    "all_gather psum psum_invariant psum_scatter reduce_scatter all_to_all".split()
)
_PSUMS = frozenset({"psum", "psum_invariant"})
_SCATTERS = frozenset({"psum_scatter", "reduce_scatter"})
_REDUCTIONS = frozenset("reduce_sum reduce_max reduce_min reduce_prod argmax argmin".split())
COMBINE_BYTES = 30 * 1024 * 1024
"XLA's all-reduce combiner's default threshold (``xla_gpu_all_reduce_combine_threshold_bytes``)."


class Walk(NamedTuple):
    """One jaxpr's walk: ``peak`` bytes it adds to its inputs at its fullest, ``saved`` of
    them already live before the operation at the peak, ``temporary`` the rest (that
    operation's results and its inner working set), each output's share per device, and for
    each output the input position whose buffer it took over (``reused``, or None)."""

    peak: float
    saved: float
    temporary: float
    out_shares: list[float]
    reused: list
    at: str = ""
    "The operation at the peak (its path through calls and loops)."
    out_homes: list[float] = []
    "Each output's share per device were it in device memory (a host-memory one's 0 share"
    " above says nothing of what its copy back to the device takes)."


class _Buffer(NamedTuple):
    counted: float
    "Bytes it adds to the walk (0 for a caller's buffer)."
    size: float
    "Bytes it holds (what a result written into it may need)."
    origin: int | None
    "The position of the caller's input it is, if it is one."


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


def sharding_share(sharding, shape: Sequence[int], *, in_device_memory: bool = False) -> float:
    """The fraction of a ``shape``d value one device holds under ``sharding`` (0 for host
    memory unless ``in_device_memory``, 1 where the sharding is not a concrete one)."""
    if _space(sharding) == "host" and not in_device_memory:
        return 0.0
    try:
        local = sharding.shard_shape(tuple(shape))
    except (AttributeError, TypeError, ValueError):
        return 1.0
    whole = math.prod(shape)
    return math.prod(local) / whole if whole else 1.0


def _space(dest) -> str | None:
    """Which memory a ``device_put`` destination names: 'host', 'device', or None (a
    sharding that leaves the memory as it is): a sharding's memory kind, or ``jax.memory.Space``
    (how the engine streams offloaded state and JAX's remat offloads residuals)."""
    kind = getattr(dest, "memory_kind", None)
    name = kind if isinstance(kind, str) else getattr(dest, "name", None)
    if not isinstance(name, str):
        return None
    name = name.lower()
    return "host" if "host" in name else "device" if name == "device" else None


def _vars(values) -> list:
    return [v for v in values if not isinstance(v, Literal)]


def _share(var, shares: dict) -> float:
    return 1.0 if isinstance(var, Literal) else shares.get(var, 1.0)


def walk(
    jaxpr,
    in_shares: Sequence[float],
    *,
    local: bool = False,
    reusable=(),
    sliced=(),
    overlap: bool = False,
    in_homes: Sequence[float] | None = None,
) -> Walk:
    """Walk ``jaxpr`` (open) in ``_scheduled``'s order, each value kept from the operation that
    makes it to its last use (an output to the end). Inputs and constants are the caller's and
    are not counted. ``local``: shapes are already one device's (inside ``shard_map``).
    ``reusable``: positions of inputs whose buffers a result may take over at their last use
    (donated, or dying at the call). ``sliced``: positions of inputs that are one step's slice
    of a stacked operand (a scan's; ``_copied_slices``). ``overlap``: collectives overlap the
    computation before them (XLA:GPU's scheduler, ``_started_in_loop``). ``in_homes``: the
    inputs' shares were they in device memory (those in host memory come in at these)."""
    shares: dict = dict(zip(jaxpr.invars, in_shares))
    homes: dict = dict(zip(jaxpr.invars, in_homes or in_shares))
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
        inner = _inner_walks(eqn, shares, homes, local, donors, overlap)
        _set_shares(eqn, shares, homes, inner, local)
        pool = {v: live.pop(v) for v in dying if v in live}
        held = {id(b): b for bufs in [*live.values(), *pool.values()] for b in bufs}
        before = sum(b.counted for b in held.values())
        made = _results(eqn, inner, live, pool, fused, size)
        # Buffers taken over from operands (dying, or viewed) are already in ``before``.
        fresh = {id(b): b for v, bufs in made.items() if v in last_use for b in bufs}
        new = sum(b.counted for k, b in fresh.items() if k not in held)
        # An inner jaxpr's peak counts the results it has made by then: they are the eqn's.
        working = max((w.peak for w in inner), default=0.0)
        working += _stacked_outputs(eqn, size) if inner else 0.0
        working += _started_in_loop(jaxpr, i) if overlap and inner else 0.0
        if before + max(new, working) > best.peak:
            deepest = max(inner, key=lambda w: w.peak).at if working > new else ""
            at = eqn.primitive.name + (f"/{deepest}" if deepest else "")
            best = Walk(before + max(new, working), before, max(new, working), [], [], at)
        live.update((v, bufs) for v, bufs in made.items() if v in last_use)
    taken_over = [
        next((b.origin for b in live.get(v, ()) if b.origin is not None), None)
        if not isinstance(v, Literal)
        else None
        for v in jaxpr.outvars
    ]
    return best._replace(
        out_shares=[_share(v, shares) for v in jaxpr.outvars],
        reused=taken_over,
        out_homes=[_home(v, shares, homes) for v in jaxpr.outvars],
    )


def _home(var, shares: dict, homes: dict) -> float:
    return 1.0 if isinstance(var, Literal) else homes.get(var, _share(var, shares))


def _on_host(eqn) -> bool:
    """Whether ``eqn`` runs on the host's CPU (``compute_on("device_host")``, how the engine
    runs an optimizer update in host memory): its working set is host memory."""
    ctx = getattr(eqn, "ctx", None)
    params = eqn.params
    return "host" in str(getattr(ctx, "compute_type", None) or params.get("compute_type", ""))


def _inner_walks(
    eqn, shares: dict, homes: dict, local: bool, reusable: set, overlap: bool
) -> list[Walk]:
    """Walks of the jaxprs inside ``eqn`` (a call, a loop's body, a branch, ``shard_map``; not
    one run on the host), their inputs' shares taken from the operands they line up with from
    the end; an operand in ``reusable`` (it dies here) may give its buffer to a result of a
    call's jaxpr."""
    walks: list[Walk] = []
    if _on_host(eqn):
        return walks
    inside = local or eqn.primitive.name == "shard_map"
    for inner in jaxprs_in_params(eqn.params):
        outer = list(eqn.invars)[-len(inner.invars) :] if inner.invars else []
        pad = len(inner.invars) - len(outer)
        in_shares = [1.0] * pad + [
            (0.0 if _share(v, shares) == 0 else 1.0) if inside else _share(v, shares) for v in outer
        ]
        in_homes = [1.0] * pad + [1.0 if inside else _home(v, shares, homes) for v in outer]
        donors = {
            pad + k
            for k, v in enumerate(outer)
            if eqn.primitive.name in _CALLS and not isinstance(v, Literal) and v in reusable
        }
        sliced = _scanned_slices(eqn, inner)
        walks.append(
            walk(
                inner,
                in_shares,
                local=inside,
                reusable=donors,
                sliced=sliced,
                overlap=overlap,
                in_homes=in_homes,
            )
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
        if not _stacked(outer, body, eqn.params["length"]):
            break
        start -= 1
    return range(start, len(inner.invars))


def _stacked(whole, step, length: int) -> bool:
    """Whether ``whole`` is ``length`` of the scan body's ``step`` value stacked on a leading
    axis (a carry has the body's shape itself)."""
    shape = tuple(getattr(whole.aval, "shape", ()))
    return shape == (length, *getattr(step.aval, "shape", (None,)))


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


def _set_shares(eqn, shares: dict, homes: dict, inner: list[Walk], local: bool) -> None:
    """Record the per-device shares of ``eqn``'s results: a move to host memory 0, back to
    the device its share there; where the operation places them, that placement (1 inside
    ``shard_map``); a call's or loop's, its inner jaxpr's outputs' (a loop's stacked outputs
    keep their per-step share); else the smallest of its operands' (0: made in host memory). A
    result in host memory keeps its share on the device in ``homes``."""
    n = len(eqn.outvars)
    if _moved(eqn, shares, homes, local):
        return
    placed = None if local else _placed(eqn, shares)
    if placed is None and inner and eqn.primitive.name != "shard_map":
        placed = ([1.0] * n + list(inner[0].out_shares))[-n:] if n else []
        if inner[0].out_homes:
            homes.update(zip(eqn.outvars, ([1.0] * n + list(inner[0].out_homes))[-n:]))
    operands = [v for v in eqn.invars if not isinstance(v, Literal)]
    if not placed:
        placed = [min((_share(v, shares) for v in operands), default=1.0)] * n
        if any(_share(v, shares) == 0 for v in operands):  # made in host memory
            home = min((_home(v, shares, homes) for v in operands), default=1.0)
            homes.update((out, home) for out in eqn.outvars)
    if local:  # one device's shapes: whole, unless in host memory
        placed = [1.0 if share else 0.0 for share in placed]
    shares.update(zip(eqn.outvars, placed))


def _moved(eqn, shares: dict, homes: dict, local: bool) -> bool:
    """Record the shares of a ``device_put`` that moves values between host and device memory
    (False for any other operation)."""
    dests = eqn.params.get("devices") or () if eqn.primitive.name == "device_put" else ()
    spaces = [_space(d) for d in dests]
    if not any(spaces) or len(dests) != len(eqn.outvars):
        return False
    for var, out, dest, space in zip(eqn.invars, eqn.outvars, dests, spaces):
        home = _home(var, shares, homes)
        if hasattr(dest, "shard_shape") and not local:
            home = sharding_share(dest, out.aval.shape, in_device_memory=True)
        homes[out] = 1.0 if local else home
        shares[out] = 0.0 if space == "host" else homes[out] if space else _share(var, shares)
    return True


def _placed(eqn, shares: dict) -> list[float] | None:
    """Output shares of an operation that places its results, or None."""
    name, params = eqn.primitive.name, eqn.params
    if name == "device_put":
        out = [
            sharding_share(dest, var.aval.shape)
            if hasattr(dest, "shard_shape") or hasattr(dest, "memory_kind")
            else _share(var, shares)
            for var, dest in zip(eqn.invars, params.get("devices") or ())
        ]
        return out if len(out) == len(eqn.outvars) else None
    if name == "sharding_constraint":
        return [sharding_share(params["sharding"], eqn.outvars[0].aval.shape)]
    if name == "shard_map":
        sizes = dict(zip(params["mesh"].axis_names, params["mesh"].axis_sizes))
        return [
            1.0 / math.prod(sizes.get(a, 1) for e in tuple(spec or ()) for a in _axes(e))
            for spec in params["out_specs"]
        ]
    return None


def _axes(entry) -> tuple:
    """The mesh axes one dimension of a ``PartitionSpec`` is split over."""
    return tuple(a for a in (entry if isinstance(entry, tuple) else (entry,)) if a is not None)


def _scheduled(jaxpr):
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
    return jaxpr.replace(eqns=_scattered_early(order))


def _scattered_early(eqns: list) -> list:
    """``eqns`` with each reduce-scatter moved up to just after the operation that makes its
    operand: it frees all but one device's share of it, so a scheduler that keeps memory low
    runs it there, not where JAX's transpose emits it (after the rest of the layer's backward
    pass)."""
    out: list = []
    for eqn in eqns:
        operands = _vars(eqn.invars)
        if eqn.primitive.name not in _SCATTERS or len(operands) != 1:
            out.append(eqn)
            continue
        made_at = [k for k, e in enumerate(out) if operands[0] in e.outvars]
        out.insert(made_at[0] + 1 if made_at else len(out), eqn)
    return out


def _stacked_outputs(eqn, size) -> float:
    """Bytes of a scan's stacked outputs: XLA allocates each whole before the loop and copies
    every step's slice into it, so all of it is live beside the body's working set (whose walk
    counts only the slice it makes). Told from the carries by shape, as ``_scanned_slices``
    tells the inputs apart."""
    if eqn.primitive.name != "scan":
        return 0.0
    body = next(iter(jaxprs_in_params(eqn.params)))
    length = eqn.params["length"]
    return sum(
        size(out) for out, step in zip(eqn.outvars, body.outvars) if _stacked(out, step, length)
    )


def _started_in_loop(jaxpr, i: int) -> float:
    """Bytes of the collectives that read a result of the loop at ``i`` directly: XLA:GPU
    peels the loop's last step and starts them inside it, overlapping the step's remaining
    work, so their results are live at the loop's fullest (one device's shapes: inside
    ``shard_map``, where collectives are). Not all-reduces: XLA:GPU does not pipeline them
    (the option is off by default and the engine leaves it so), and starts one after the
    loop ends."""
    eqn = jaxpr.eqns[i]
    if eqn.primitive.name not in ("scan", "while"):
        return 0.0
    results = set(eqn.outvars)
    return float(
        sum(
            aval_bytes(out.aval)
            for later in jaxpr.eqns[i + 1 :]
            if later.primitive.name in _COLLECTIVES - _PSUMS
            and results.intersection(_vars(later.invars))
            for out in later.outvars
        )
    )


def _results(eqn, inner: list[Walk], live: dict, pool: dict, fused: set, size) -> dict:
    """``{result: its buffers}``: a view is its operand's buffers (none for a caller's input), a
    fused result carries its dying operands' buffers, a result written in place takes a dying
    operand's buffer of its size (a call's, the one its inner jaxpr took over), any other is
    new."""
    outs = list(eqn.outvars)
    views = _views(eqn, size)
    if views:
        return {out: list(live.get(v) or pool.get(v) or []) for out, v in views.items()}
    spare = [b for bufs in pool.values() for b in bufs]
    if outs and all(out in fused for out in outs):  # each keeps the dying operands' buffers
        return {out: list(spare) for out in outs}
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


def _views(eqn, size) -> dict:
    """``{result: the operand it views}`` for a view operation whose result has its operand's
    bytes on the device (else empty: the result is a copy, a gather or a move)."""
    if eqn.primitive.name not in _VIEWS and not _moves_unit_axes_only(eqn):
        return {}
    pairs = zip(eqn.outvars, eqn.invars if eqn.primitive.name == "device_put" else eqn.invars[:1])
    views = {out: v for out, v in pairs if not isinstance(v, Literal) and size(out) == size(v)}
    return views if len(views) == len(eqn.outvars) else {}


def _moves_unit_axes_only(eqn) -> bool:
    """A transpose that keeps the order of its operand's axes longer than 1 (a chunked
    sequence's ``[1, chunks, ...]`` turned ``[chunks, 1, ...]``): its bytes are the operand's,
    in the same order, so XLA makes it a bitcast."""
    if eqn.primitive.name != "transpose":
        return False
    shape = eqn.invars[0].aval.shape
    kept = [axis for axis in eqn.params["permutation"] if shape[axis] != 1]
    return kept == sorted(kept)


def _last_uses(jaxpr, runs=()) -> dict:
    """Each value's last reader's position (the jaxpr's outputs: one past the end). XLA
    combines a run of consecutive independent ``psum``s (``runs``, ``_psum_runs``) into one
    all-reduce, which holds all their operands until it ends."""
    last_use: dict = {}
    for i, eqn in enumerate(jaxpr.eqns):
        last_use.update((v, i) for v in _vars(eqn.invars))
    last_use.update((v, len(jaxpr.eqns)) for v in _vars(jaxpr.outvars))
    position = {id(eqn): i for i, eqn in enumerate(jaxpr.eqns)}
    for run in runs:
        end = max(position[id(eqn)] for eqn in run)
        last_use.update((v, max(last_use[v], end)) for eqn in run for v in _vars(eqn.invars))
    return last_use


def _psum_runs(jaxpr) -> list[list]:
    """Runs of consecutive ``psum``s over the same axes, none reading another's result, at
    most ``COMBINE_BYTES`` of operands each."""
    runs: list[list] = []
    made: set = set()
    total = 0.0
    for i, eqn in enumerate(jaxpr.eqns):
        bytes_in = sum(aval_bytes(v.aval) for v in _vars(eqn.invars))
        joins = (
            runs
            and runs[-1][-1] is jaxpr.eqns[i - 1]
            and jaxpr.eqns[i - 1].params.get("axes") == eqn.params.get("axes")
            and not made.intersection(_vars(eqn.invars))
            and total + bytes_in <= COMBINE_BYTES
        )
        if eqn.primitive.name in _PSUMS and joins:
            runs[-1].append(eqn)
            total += bytes_in
        elif eqn.primitive.name in _PSUMS:
            runs.append([eqn])
            made, total = set(), bytes_in
        made.update(eqn.outvars)
    return [run for run in runs if len(run) > 1]


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
    elementwise ones or reductions (computed inside their fused loop: a layer norm's fp32 copy
    of its input), a transpose's read only by matmuls
    or elementwise operations (their operand's layout). Of several results (an elementwise
    call's), XLA fuses each into a consumer only where it has just one."""
    readers: dict = {}
    for eqn in jaxpr.eqns:
        for v in _vars(eqn.invars):
            readers.setdefault(v, []).append(eqn.primitive.name)
    outputs = set(_vars(jaxpr.outvars))
    fused: set = set()
    for eqn in jaxpr.eqns:
        name, several = eqn.primitive.name, len(eqn.outvars) > 1
        into = _ELEMENTWISE | {"dot_general"} if name == "transpose" else _ELEMENTWISE | _REDUCTIONS
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
