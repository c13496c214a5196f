"""Weights fetched on use: every weight is materialised (all-gathered, at ZeRO-3) just before
the operation that uses it and again for that operation's backward pass, so the whole weights
alive at any moment are those of about one operation (the FSDP schedule), for any model.

How: the loss is traced to a jaxpr with whole-weight placeholders and replayed by a small
interpreter (STYLE item 13). Operations that read weights only (casts, reshapes, transposes,
broadcasts) are deferred. The first operation that combines weights with data becomes one
*unit*: a ``custom_vjp`` that fetches the weights it needs, applies the operation and lets the
fetched copies die; its backward fetches them again, takes the operation's vjp and hands each
weight's gradient to its ``Source`` (a reduce-scatter at stages 2 and 3). The unit's residuals
are shards and data, never a fetched weight, which is what otherwise keeps every gathered
weight alive from the forward pass to the backward pass.

Order: nothing in the data flow stops XLA from issuing every all-gather at the start of the
step (XLA:CPU does exactly that), and ``lax.optimization_barrier`` does not stop it either on
XLA:CPU, which expands barriers away before it schedules. So a unit makes its sources depend
on its data inputs (forward) or its output cotangent (backward) through ``after``
(``zeroflow.engine.ordering``): a fetch cannot start before the values it will meet exist.

``jit`` calls that touch weights are inlined so that their operations become units one by one.
A ``scan`` over stacked weights (a layer stack written with ``lax.scan``, no hints) is replayed
with its body interpreted per iteration: each iteration's units fetch that iteration's slice,
forward and backward. Any other higher-order operation (``remat``, ``cond``, custom
derivatives) that reads weights is one unit, its weights fetched for its whole duration.
"""
from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
from jax.extend.core import Literal

from zeroflow.util.compat import REMAT_PRIMITIVES, scan_split
from zeroflow.engine.grads import row_lookup, split_columns
from zeroflow.engine.grads.collectives import save_all_but_fetched, varying
from zeroflow.engine.grads.sources import Frozen, Sharded, Source, Whole  # noqa: F401  (gather_on_use.Sharded ...)
from zeroflow.util.jaxprs import bind, call_body, open_jaxpr
from zeroflow.engine.mesh import DATA
from zeroflow.engine.ordering import after, live


@dataclasses.dataclass(frozen=True)
class _Lazy:
    """A value computed from weights (and constants) alone, not materialised: ``build(full,
    side)`` computes it from the fetched weights ``full[i]`` of ``sources`` and the constant
    arrays ``side`` (keyed by id) it also reads."""
    sources: frozenset
    side: dict
    build: Callable
    direct: int | None = None
    "The index of the weight when the value is that weight itself, as stored."
    cast_of: int | None = None
    "The index of the weight when the value is that weight or a dtype cast of it."


_side_ids = itertools.count()


def call(fn: Callable, stored: Sequence, sources: Sequence[Source | None], *args,
         order: bool = True, prefetch: int = 0):
    """``fn(weights, *args)``, where each entry of ``stored`` with a ``Source`` is fetched on
    use (forward and backward) and the others are used as they are.

    ``order``: each fetch waits for values of the program around it (``after``), so that the
    compiler cannot issue every fetch at the start. ``prefetch``: how many units ahead a fetch
    may start; 0 waits for the unit's own inputs (least memory, no overlap: XLA:CPU runs
    collectives synchronously anyway), 1 lets unit ``i+1``'s fetch run while unit ``i``
    computes, forward and backward (FSDP's prefetch), holding two units' weights at a time."""
    stored = list(stored)
    avals = [jax.make_jaxpr(src.fetch)(x).out_avals[0] if src is not None else x
             for x, src in zip(stored, sources)]
    closed, out_shape = jax.make_jaxpr(fn, return_shape=True)(avals, *args)
    # The jaxpr's inputs are the flattened entries: a fetched weight is one input, any other
    # entry (possibly a small pytree itself) as many as it has arrays; the data is dynamic.
    inputs, dynamic = [], []
    for i, (x, src) in enumerate(zip(stored, sources)):
        parts = ([_direct(i)] if src is not None else jax.tree.leaves(x))
        inputs += parts
        dynamic += [src is None] * len(parts)
    flat_args = jax.tree.leaves(args)
    inputs += flat_args
    dynamic += [True] * len(flat_args)
    replay = _Replay(stored, sources, order, prefetch)
    outs = [replay.materialise(x) for x, _ in replay.run(closed.jaxpr, closed.consts, inputs, dynamic)]
    return jax.tree.unflatten(jax.tree.structure(out_shape), outs)


def _direct(i: int) -> _Lazy:
    return _Lazy(frozenset([i]), {}, lambda full, side, i=i: full[i], direct=i, cast_of=i)


class _Replay:
    """The interpreter: one pass over a jaxpr, deferring weight-only values and turning each
    operation that meets data into a unit."""

    def __init__(self, stored, sources, order: bool = True, prefetch: int = 0,
                 rematerialised: bool = False):
        self.stored, self.sources, self.order = stored, sources, order
        self.prefetch = prefetch if order else 0
        self.rematerialised = rematerialised  # see _rematerialised
        self.tokens: list = []  # one per unit so far, in program order (see _unit_fn)
        self.grad_token = None  # the last unit's, for the next one (see _unit_fn)

    def run(self, jaxpr, consts, inputs, dynamic):
        """Values of ``jaxpr``'s outputs as ``(value_or_lazy, is_dynamic)`` pairs. A value is
        dynamic when it depends on the function's inputs (data), static when it comes from
        constants alone; weight-only values stay ``_Lazy``."""
        env = {}
        for var, value in zip(jaxpr.constvars, consts):
            env[var] = (value, False)
        for var, value, dyn in zip(jaxpr.invars, inputs, dynamic):
            env[var] = (value, dyn)

        def read(atom):
            return (atom.val, False) if isinstance(atom, Literal) else env[atom]

        for eqn in jaxpr.eqns:
            ins = [read(v) for v in eqn.invars]
            values = [v for v, _ in ins]
            any_dynamic = any(d for _, d in ins)
            if not any(isinstance(v, _Lazy) for v in values):
                outs = [(o, any_dynamic) for o in bind(eqn, values)]
            elif call_body(eqn) is not None:  # replayed equation by equation
                outs = self.run(*open_jaxpr(call_body(eqn)), values, [d for _, d in ins])
            elif not any_dynamic:
                outs = [(x, False) for x in self._defer(eqn, values)]
            elif eqn.primitive.name == "scan" and self._scannable(eqn, values):
                outs = [(o, True) for o in self._scan(eqn, ins)]
            elif self.rematerialised:
                outs = [(o, True) for o in self._rematerialised(eqn, ins)]
            else:
                outs = [(o, True) for o in self._unit(eqn, ins)]
            for var, out in zip(eqn.outvars, outs):
                env[var] = out
        return [read(v) for v in jaxpr.outvars]

    def _sliceable(self, value) -> bool:
        """A stored weight itself (not a value computed from it) that a scan can take one
        leading-axis slice of per iteration, each still split over devices."""
        return (isinstance(value, _Lazy) and value.direct is not None
                and self.sources[value.direct].layer() is not None)

    def _scannable(self, eqn, values) -> bool:
        """A scan over a stack of weights (one slice per iteration): each iteration then
        fetches its own slice instead of the whole stack being fetched for the scan."""
        split = sum(scan_split(eqn.params))
        return any(self._sliceable(v) for v in values[split:])

    def _scan(self, eqn, ins):
        """The scan replayed with its body interpreted per iteration: the stored weights (shards,
        stand-ins) are scanned over, and each iteration's units fetch that iteration's slice,
        forward and (through the scan's own transpose) backward. Weights it reads otherwise
        (whole in every iteration, or stacks split along the stacked axis, such as a stack of
        biases) are fetched whole for the scan."""
        params = eqn.params
        n_consts, n_carry = scan_split(params)
        split = n_consts + n_carry
        values = [self.materialise(v) if isinstance(v, _Lazy) and not (
            k >= split and self._sliceable(v)) else v for k, (v, _) in enumerate(ins)]
        dynamic = [d for _, d in ins]
        consts, carry = values[:n_consts], values[n_consts:split]
        xs = values[split:]
        weights = sorted({v.direct for v in xs if isinstance(v, _Lazy)})
        position = {i: k for k, i in enumerate(weights)}
        layer_sources = [self.sources[i].layer() for i in weights]
        data_xs = [x for x in xs if not isinstance(x, _Lazy)]
        body = params["jaxpr"]

        def step(carry, sliced):
            stored_t, data_t = sliced
            # Unordered: the loop already bounds a slice's fetch to its iteration, and a fetch
            # tied to the carry cannot be moved into the previous iteration by XLA:GPU's
            # collective pipeliner (see backend.compiler_options), which is what overlaps it.
            inner = _Replay(stored_t, layer_sources, order=False, rematerialised=True)
            data_iter = iter(data_t)
            inputs = list(consts) + list(carry) + [
                _direct(position[x.direct]) if isinstance(x, _Lazy) else next(data_iter)
                for x in xs]
            outs = inner.run(body.jaxpr, body.consts, inputs,
                             dynamic[:split] + [True] * len(xs))
            outs = [inner.materialise(v) for v, _ in outs]
            return outs[:n_carry], outs[n_carry:]

        if self.prefetch:  # the next unit's fetch may start as the scan starts
            self.tokens.append(_token([v for v, d in zip(values, dynamic)
                                      if d and not isinstance(v, _Lazy)]))
        carry, ys = jax.lax.scan(step, list(carry), ([self.stored[i] for i in weights], data_xs),
                                 length=params["length"], reverse=params["reverse"],
                                 unroll=params["unroll"])
        return list(carry) + list(ys)

    def _defer(self, eqn, values):
        """Outputs of a weight-only operation, each a ``_Lazy`` that recomputes it."""
        sources, side, builders = frozenset(), {}, []
        for atom, value in zip(eqn.invars, values):
            if isinstance(value, _Lazy):
                sources |= value.sources
                side.update(value.side)
                builders.append(value.build)
            elif isinstance(atom, Literal):
                builders.append(lambda full, side, v=value: v)
            else:  # a constant array: carried as an explicit input of the unit that uses it
                key = next(_side_ids)
                side[key] = value
                builders.append(lambda full, side, key=key: side[key])

        def build(full, side, k):
            return bind(eqn, [b(full, side) for b in builders])[k]
        cast_of = (values[0].cast_of if eqn.primitive.name == "convert_element_type"
                   and isinstance(values[0], _Lazy) else None)
        return [_Lazy(sources, side, lambda full, s, k=k: build(full, s, k), cast_of=cast_of)
                for k in range(len(eqn.outvars))]

    def materialise(self, value):
        """A lazy value made concrete, with the gradient going back to its sources (it is an
        output of the function: there is no later use to bound)."""
        if not isinstance(value, _Lazy):
            return value
        order = sorted(value.sources)
        return _unit_fn(lambda full, side, data: [value.build(dict(zip(order, full)),
                                                              dict(zip(list(value.side), side)))],
                        [self.sources[i] for i in order], [],
                        [self.stored[i] for i in order], list(value.side.values()), [],
                        self.order)[0]

    def _rematerialised(self, eqn, ins):
        """In a scan body: the operation as a ``jax.checkpoint`` that fetches its weights
        itself, under the policy of the loss's own ``jax.checkpoint`` when the operation is one
        (its body replayed inline), else saving nothing. Fetched weights and their layout
        changes are never saved (``save_all_but_fetched``): the backward pass fetches them
        again, from the slice of shards the scan hands both passes. What the loss's policy
        saves (a dots policy's matmul outputs) is saved, so the backward pass does not redo
        it, which a unit (``_unit``: residuals are shards and data only) always does."""
        values = [v for v, _ in ins]
        ops = _Operands(eqn, values)
        remat = eqn.primitive.name in REMAT_PRIMITIVES

        def run(stored, side_list, data):
            full = {i: self.sources[i].fetch_for_grad(x) for i, x in zip(ops.order, stored)}
            vals = ops.values_with(full, side_list, data)
            if not remat:
                return bind(eqn, vals)
            body = _Replay([], [], order=False)
            return [v for v, _ in body.run(*open_jaxpr(eqn.params["jaxpr"]), vals,
                                           [True] * len(vals))]

        policy = _but_fetched(eqn.params.get("policy") if remat else None)
        return jax.checkpoint(run, policy=policy, prevent_cse=False)(
            [self.stored[i] for i in ops.order], ops.side_values, ops.data)

    def _lookup(self, eqn, values):
        """A row lookup in a table split by rows (``row_lookup``), or None when ``eqn`` is not
        one: the table itself (or a dtype cast of it), indexed by data."""
        table, index = values if len(values) == 2 else (None, None)
        if not (isinstance(table, _Lazy) and table.cast_of is not None
                and not isinstance(index, _Lazy) and row_lookup.is_row_lookup(eqn)):
            return None
        src = self.sources[table.cast_of]
        if type(src) not in (Sharded, Frozen) or src.dim != 0 or getattr(src, "sliced", False):
            return None
        if getattr(src, "groups", None) is not None or getattr(src, "grad_hosts", None):
            return None
        stored = self.stored[table.cast_of]
        dtype = eqn.invars[0].aval.dtype
        if isinstance(src, Frozen):
            out = row_lookup.lookup(stored, None, index, dtype)
        else:
            out = row_lookup.lookup(stored[0], stored[1], index, dtype)
        if self.prefetch:  # the next unit's fetch may start once the rows are there
            self.tokens.append(_token([out]))
        return [out]

    def _plain_source(self, value, dim: int):
        """The source behind ``value`` when it is a stage-3 weight itself (or a dtype cast of
        it), split along ``dim``, gathered over every device, whole precision: what the row
        lookup and the column-split matmul read their shard from; else None."""
        if not isinstance(value, _Lazy) or value.cast_of is None:
            return None
        src = self.sources[value.cast_of]
        if type(src) not in (Sharded, Frozen) or src.dim != dim or getattr(src, "sliced", False):
            return None
        if getattr(src, "groups", None) is not None or getattr(src, "grad_hosts", None):
            return None
        return src

    def _split_columns(self, eqn, values):
        """``data @ weight`` computed where the weight's columns are (``split_columns``), when
        that moves fewer bytes than gathering the weight; else None."""
        if len(values) != 2 or isinstance(values[0], _Lazy):
            return None
        src = self._plain_source(values[1], 1)
        data_aval, weight_aval = (v.aval for v in eqn.invars)
        if src is None or not split_columns.applies(eqn, data_aval, weight_aval, src.dim,
                                                    jax.lax.axis_size(DATA)):
            return None
        stored = self.stored[values[1].cast_of]
        shard, stand_in = (stored, None) if isinstance(src, Frozen) else stored
        out = split_columns.matmul(values[0], shard, stand_in, weight_aval.dtype,
                                   eqn.outvars[0].aval.dtype, weight_aval.shape[1])
        if self.prefetch:  # the next unit's fetch may start once the product is there
            self.tokens.append(_token([out]))
        return [out]

    def _unit(self, eqn, ins):
        values = [v for v, _ in ins]
        special = self._lookup(eqn, values)
        if special is None:
            special = self._split_columns(eqn, values)
        if special is not None:
            return special
        ops = _Operands(eqn, values)
        anchors = [j for j, k in enumerate(ops.data_pos) if ins[k][1]]

        def compute(full_list, side_list, data):
            return bind(eqn, ops.values_with(dict(zip(ops.order, full_list)), side_list, data))

        args = (compute, [self.sources[i] for i in ops.order], anchors,
                [self.stored[i] for i in ops.order], ops.side_values, ops.data, self.order)
        if not self.prefetch:
            return _unit_fn(*args)
        ahead = self.tokens[-self.prefetch] if len(self.tokens) >= self.prefetch else None
        outs, (token, self.grad_token) = _unit_fn(*args, token=(ahead, self.grad_token))
        self.tokens.append(token)
        return outs


class _Operands:
    """An equation's operands split for a unit: the weight-only ones (``_Lazy``, built from the
    fetched weights ``order`` and the constant arrays ``side``) and the data ones."""

    def __init__(self, eqn, values):
        self.values = values
        self.lazies = {k: v for k, v in enumerate(values) if isinstance(v, _Lazy)}
        self.order = sorted(frozenset().union(*(v.sources for v in self.lazies.values())))
        side = {}
        for v in self.lazies.values():
            side.update(v.side)
        self.side_keys, self.side_values = list(side), list(side.values())
        self.data_pos = [k for k, atom in enumerate(eqn.invars)
                         if k not in self.lazies and not isinstance(atom, Literal)]
        self.data = [values[k] for k in self.data_pos]

    def values_with(self, full: dict, side_list, data) -> list:
        """The operands, the weight-only ones built from ``full`` (fetched weights by index)
        and ``side_list``, the data ones from ``data``."""
        side_by_key = dict(zip(self.side_keys, side_list))
        vals = list(self.values)
        for k, lazy_value in self.lazies.items():
            vals[k] = lazy_value.build(full, side_by_key)
        for k, d in zip(self.data_pos, data):
            vals[k] = d
        return vals


def _but_fetched(policy):
    """``policy`` (a ``jax.checkpoint`` policy; None saves nothing) that never saves a fetched
    weight or a layout change of one."""
    if policy is None:
        return None
    return lambda prim, *args, **params: (save_all_but_fetched(prim, *args, **params)
                                          and policy(prim, *args, **params))


_NO_TOKEN = object()


def _unit_fn(compute, sources, anchors, stored, side, data, order: bool = True, *,
             token=_NO_TOKEN):
    """``compute(fetched weights, side, data)`` with the fetches made after ``data[anchors]``
    exist (forward) and redone after the cotangent exists (backward); ``order=False``: the
    compiler places the fetches.

    With ``token`` (prefetching), a pair ``(fetch, grads)`` of tokens from earlier units (None
    for the first units), returns ``(outputs, (fetch, grads))`` instead, this unit's tokens
    for later units. The forward fetch waits for the fetch token, which an earlier unit made
    from its own inputs as it started, so this unit's gather overlaps that unit's compute.

    In the backward pass the roles turn round through the tokens' cotangents, and the
    reductions join the order. Unit ``i`` widens its weight gradient to fp32 and reduce-
    scatters it only once the reduction of unit ``i+1`` (the one differentiated just before)
    is done, so one whole fp32 gradient is alive at a time; the token of that finished
    reduction, together with unit ``i``'s output cotangent, is also what lets the next fetch
    (unit ``i-1``'s weights) start. Each unit's backward then runs with one collective at a
    time beside it, the previous reduction first and then the next gather, which is all
    XLA:GPU's scheduler keeps in flight by default (a 16-layer model: every other reduce-
    scatter had nothing to overlap when the gather could start first). The unit whose fetch
    token nothing uses (the last) fetches again as soon as its forward output exists, so that
    gather overlaps the loss instead of stalling the turn from forward to backward.
    """
    prefetching = token is not _NO_TOKEN

    def fetched(stored, tie):
        return [src.fetch(after(x, tie) if order and getattr(src, "ordered", True) else x)
                for src, x in zip(sources, stored)]

    def forward(stored, side, data, token):
        own = [data[j] for j in anchors]
        ahead = None if token is None else token[0]
        out = compute(fetched(stored, own if ahead is None else [ahead]), side, data)
        started = _token(own)  # both tokens: only their cotangents differ
        return out, (started, started)

    @jax.custom_vjp
    def unit(stored, side, data, token):
        return forward(stored, side, data, token)

    def unit_fwd(*primals):
        # symbolic_zeros: the primals come wrapped, and an unused output's cotangent comes as
        # a SymbolicZero (the last unit's token), which must not stand in for a dependency.
        stored, side, data, token = jax.tree.map(lambda p: p.value, primals, is_leaf=_is_primal)
        out, next_tokens = forward(stored, side, data, token)
        done = _token(out) if token is not None else None  # the forward output exists
        return (out, next_tokens), (stored, side, data, token, done)

    trains = [not getattr(src, "frozen", False) for src in sources]

    def unit_bwd(residuals, cotangents):
        stored, side, data, token, done = residuals
        cotangent, (d_fetch, d_grads) = cotangents
        cotangent = jax.tree.map(_instantiate, cotangent, is_leaf=_is_zero)
        if not _is_zero(d_fetch):
            tie = [d_fetch]
        else:
            tie = cotangent if done is None else [done]
        full = fetched(stored, tie)

        def of_trained(trained, side, data):  # frozen weights enter as constants
            given = iter(trained)
            return compute([next(given) if t else x for t, x in zip(trains, full)], side, data)

        _, vjp = jax.vjp(of_trained, [x for t, x in zip(trains, full) if t], side, data)
        d_trained, d_side, d_data = vjp(cotangent)
        if not _is_zero(d_grads):
            d_trained = after(d_trained, [d_grads])
        d_trained = iter(d_trained)
        # None: a zero cotangent for a frozen weight, which nothing differentiates anyway.
        given = [src.give_back(x, next(d_trained)) if t else None
                 for src, x, t in zip(sources, stored, trains)]
        if token is None:
            return given, d_side, d_data, None
        ahead, previous = token
        finished = None if _is_zero(d_grads) else [d_grads]  # the later unit's reduction
        # this unit's reductions (of a (weight, stand_in) pair: the stand-in's), or, for a
        # unit of frozen weights, the later one's handed on
        reduced = [jax.tree.leaves(g)[-1] for g in given if g is not None] or finished
        return given, d_side, d_data, (
            None if ahead is None else _token(cotangent) * (_token(finished) if finished else 1.0),
            None if previous is None or not reduced else _token(reduced))

    unit.defvjp(unit_fwd, unit_bwd, symbolic_zeros=True)
    out, next_tokens = unit(stored, side, data, None if not prefetching else token)
    return (out, next_tokens) if prefetching else out


def _token(anchors):
    """An fp32 scalar (1.0) computed from one element of ``anchors``: whatever waits for it
    waits for them. Not a constant the compiler could fold (a select between equal branches
    would be). Always typed as varying over ``data``: the token's cotangent is made from a
    unit's output cotangent, which varies, and a custom_vjp's cotangent must have its input's
    type (anchors that are the same on every device, such as LoRA's replicated adapters,
    would otherwise give an invariant token)."""
    readable = [a for a in jax.tree.leaves(anchors) if getattr(a, "size", 0)]
    if not readable:
        return varying(jnp.ones((), jnp.float32))
    return varying(live(readable[0]).astype(jnp.float32))


def _is_primal(x) -> bool:
    return isinstance(x, jax.custom_derivatives.CustomVJPPrimal)


def _is_zero(x) -> bool:
    return isinstance(x, jax.custom_derivatives.SymbolicZero)


def _instantiate(x):
    return jnp.zeros(x.aval.shape, x.aval.dtype) if _is_zero(x) else x
