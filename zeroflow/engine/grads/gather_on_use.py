"""Weights fetched on use: every weight is materialised (all-gathered, at ZeRO-3) just before
the operation that uses it and again for that operation's backward pass, so the whole weights
alive at any moment are those of about one operation (the FSDP schedule), for any model.

How: the loss is traced to a jaxpr with whole-weight placeholders and replayed by a small
interpreter, so any JAX function works without changes to its code. Operations that read weights only (casts, reshapes, transposes,
broadcasts) are deferred. The first operation that combines weights with data becomes one
*unit* (``fetch_unit``): a ``custom_vjp`` that fetches the weights it needs, applies the
operation and lets the fetched copies die; its backward fetches them again, takes the
operation's vjp and hands each weight's gradient to its ``Source`` (a reduce-scatter at stages
2 and 3). The unit's residuals are shards and data, never a fetched weight, which is what
otherwise keeps every gathered weight alive from the forward pass to the backward pass.

Order: nothing in the data flow stops XLA from issuing every all-gather at the start of the
step (XLA:CPU does exactly that), and ``lax.optimization_barrier`` does not stop it either on
XLA:CPU, which expands barriers away before it schedules. So a unit makes its sources depend
on its data inputs (forward) or its output cotangent (backward) through ``after``
(``zeroflow.engine.ordering``; the replay hands it to each unit as its ``wait``): a fetch
cannot start before the values it will meet exist.

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
from jax.extend.core import Literal

from zeroflow.backend.mesh import zero_axes
from zeroflow.engine.grads import fp8_fetch, row_lookup, split_columns
from zeroflow.engine.grads.collectives import save_all_but_fetched
from zeroflow.engine.grads.fetch_unit import run_unit, token
from zeroflow.engine.grads.sources import Frozen, Sharded, Source, Whole  # noqa: F401 (re-exported)
from zeroflow.engine.ordering import after
from zeroflow.util.compat import REMAT_PRIMITIVES, scan_split
from zeroflow.util.jaxprs import bind, call_body, open_jaxpr


@dataclasses.dataclass(frozen=True)
class _WeightOnly:
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


def call(
    fn: Callable,
    stored: Sequence,
    sources: Sequence[Source | None],
    *args,
    order: bool = True,
    prefetch: int = 0,
):
    """``fn(weights, *args)``, where each entry of ``stored`` with a ``Source`` is fetched on
    use (forward and backward) and the others are used as they are.

    ``order``: each fetch waits for values of the program around it (``after``), so that the
    compiler cannot issue every fetch at the start. ``prefetch``: how many units ahead a fetch
    may start; 0 waits for the unit's own inputs (least memory, no overlap: XLA:CPU runs
    collectives synchronously anyway), 1 lets unit ``i+1``'s fetch run while unit ``i``
    computes, forward and backward (FSDP's prefetch), holding two units' weights at a time."""
    stored = list(stored)
    avals = [
        jax.make_jaxpr(src.fetch)(x).out_avals[0] if src is not None else x
        for x, src in zip(stored, sources)
    ]
    closed, out_shape = jax.make_jaxpr(fn, return_shape=True)(avals, *args)
    # The jaxpr's inputs are the flattened entries: a fetched weight is one input, any other
    # entry (possibly a small pytree itself) as many as it has arrays; the data is dynamic.
    inputs: list = []
    dynamic: list[bool] = []
    for i, (x, src) in enumerate(zip(stored, sources)):
        parts = [_weight_itself(i)] if src is not None else jax.tree.leaves(x)
        inputs += parts
        dynamic += [src is None] * len(parts)
    flat_args = jax.tree.leaves(args)
    inputs += flat_args
    dynamic += [True] * len(flat_args)
    replay = _Replay(stored, sources, order, prefetch)
    outs = [
        replay.materialise(x) for x, _ in replay.run(closed.jaxpr, closed.consts, inputs, dynamic)
    ]
    return jax.tree.unflatten(jax.tree.structure(out_shape), outs)


def _weight_itself(i: int) -> _WeightOnly:
    return _WeightOnly(frozenset([i]), {}, lambda full, side, i=i: full[i], direct=i, cast_of=i)


class _Replay:
    """The interpreter: one pass over a jaxpr, deferring weight-only values and turning each
    operation that meets data into a unit."""

    def __init__(
        self, stored, sources, order: bool = True, prefetch: int = 0, rematerialised: bool = False
    ):
        self.stored, self.sources = stored, sources
        self.wait = after if order else None  # how a fetch waits (see fetch_unit)
        self.prefetch = prefetch if order else 0
        self.rematerialised = rematerialised  # see _rematerialised
        self.fetch_tokens: list = []  # one per unit so far, in program order (see FetchUnit)
        self.grad_token = None  # the last unit's, for the next one (see FetchUnit)

    def run(self, jaxpr, consts, inputs, dynamic):
        """Values of ``jaxpr``'s outputs as ``(value_or_weight_only, is_dynamic)`` pairs. A value is
        dynamic when it depends on the function's inputs (data), static when it comes from
        constants alone; weight-only values stay ``_WeightOnly``."""
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
            if any(isinstance(v, fp8_fetch.Pending) for v in values):
                outs = [(o, any_dynamic) for o in self._with_pending(eqn, ins)]
            elif not any(isinstance(v, _WeightOnly) for v in values):
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
                outs = [(o, True) for o in self._meets_data(eqn, ins)]
            for var, out in zip(eqn.outvars, outs):
                env[var] = out
        return [read(v) for v in jaxpr.outvars]

    def _sliceable(self, value) -> bool:
        """A stored weight itself (not a value computed from it) that a scan can take one
        leading-axis slice of per iteration, each still split over devices."""
        return (
            isinstance(value, _WeightOnly)
            and value.direct is not None
            and self.sources[value.direct].layer() is not None
        )

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
        values = [
            self.materialise(v)
            if isinstance(v, _WeightOnly) and not (k >= split and self._sliceable(v))
            else v
            for k, (v, _) in enumerate(ins)
        ]
        dynamic = [d for _, d in ins]
        consts, carry = values[:n_consts], values[n_consts:split]
        xs = values[split:]
        weights = sorted({v.direct for v in xs if isinstance(v, _WeightOnly)})
        position = {i: k for k, i in enumerate(weights)}
        layer_sources = [self.sources[i].layer() for i in weights]
        data_xs = [x for x in xs if not isinstance(x, _WeightOnly)]
        body = params["jaxpr"]

        def step(carry, sliced):
            stored_t, data_t = sliced
            # Unordered: the loop already bounds a slice's fetch to its iteration, and a fetch
            # tied to the carry cannot be moved into the previous iteration by XLA:GPU's
            # collective pipeliner (see backend.compiler_options), which is what overlaps it.
            inner = _Replay(stored_t, layer_sources, order=False, rematerialised=True)
            data_iter = iter(data_t)
            inputs = (
                list(consts)
                + list(carry)
                + [
                    _weight_itself(position[x.direct])
                    if isinstance(x, _WeightOnly)
                    else next(data_iter)
                    for x in xs
                ]
            )
            outs = inner.run(body.jaxpr, body.consts, inputs, dynamic[:split] + [True] * len(xs))
            outs = [inner.materialise(v) for v, _ in outs]
            return outs[:n_carry], outs[n_carry:]

        if self.prefetch:  # the next unit's fetch may start as the scan starts
            self.fetch_tokens.append(
                token([v for v, d in zip(values, dynamic) if d and not isinstance(v, _WeightOnly)])
            )
        carry, ys = jax.lax.scan(
            step,
            list(carry),
            ([self.stored[i] for i in weights], data_xs),
            length=params["length"],
            reverse=params["reverse"],
            unroll=params["unroll"],
        )
        return list(carry) + list(ys)

    def _defer(self, eqn, values):
        """Outputs of a weight-only operation, each a ``_WeightOnly`` that recomputes it."""
        sources, side, builders = frozenset(), {}, []
        for atom, value in zip(eqn.invars, values):
            if isinstance(value, _WeightOnly):
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

        cast_of = (
            values[0].cast_of
            if eqn.primitive.name == "convert_element_type" and isinstance(values[0], _WeightOnly)
            else None
        )
        return [
            _WeightOnly(sources, side, lambda full, s, k=k: build(full, s, k), cast_of=cast_of)
            for k in range(len(eqn.outvars))
        ]

    def materialise(self, value):
        """A weight-only value made concrete, with the gradient going back to its sources (it is an
        output of the function: there is no later use to bound)."""
        if not isinstance(value, _WeightOnly):
            return value
        order = sorted(value.sources)
        return run_unit(
            lambda full, side, data: [
                value.build(dict(zip(order, full)), dict(zip(list(value.side), side)))
            ],
            [self.sources[i] for i in order],
            [self.stored[i] for i in order],
            list(value.side.values()),
            [],
            wait=self.wait,
        )[0]

    def _rematerialised(self, eqn, ins):
        """In a scan body: the operation as a ``jax.checkpoint`` that fetches its weights
        itself, under the policy of the loss's own ``jax.checkpoint`` when the operation is one
        (its body replayed inline), else saving nothing. Fetched weights and their layout
        changes are never saved (``save_all_but_fetched``): the backward pass fetches them
        again, from the slice of shards the scan hands both passes. What the loss's policy
        saves (a dots policy's matmul outputs) is saved, so the backward pass does not redo
        it, which a unit (``fetch_unit``: residuals are shards and data only) always does."""
        values = [v for v, _ in ins]
        ops = _Operands(eqn, values)
        remat = eqn.primitive.name in REMAT_PRIMITIVES

        pending = fp8_fetch.pending(ops.weight_only, self.sources)

        def run(stored, side_list, data):
            full = {
                i: fp8_fetch.Pending(x, self.sources[i])
                if i in pending
                else self.sources[i].fetch_for_grad(x)
                for i, x in zip(ops.order, stored)
            }
            vals = ops.values_with(full, side_list, data)
            if not remat and not pending:
                return bind(eqn, vals)
            body = _Replay([], [], order=False)
            if not remat:
                return body._with_pending(eqn, [(v, True) for v in vals])
            outs = body.run(*open_jaxpr(eqn.params["jaxpr"]), vals, [True] * len(vals))
            return [fp8_fetch.fetched(v) for v, _ in outs]

        policy = _but_fetched(eqn.params.get("policy") if remat else None)
        return jax.checkpoint(run, policy=policy, prevent_cse=False)(
            [self.stored[i] for i in ops.order], ops.side_values, ops.data
        )

    def _with_pending(self, eqn, ins):
        """Outputs of ``eqn`` where weights gathered in FP8 are still ``Pending``
        (``fp8_fetch``): a call is replayed inline, an FP8 matmul reading one gathers it
        itself, any other use fetches it."""
        values = [v for v, _ in ins]
        body = call_body(eqn)
        if body is not None:
            outs = self.run(*open_jaxpr(body), values, [d for _, d in ins])
            return [fp8_fetch.fetched(v) for v, _ in outs]
        fused = fp8_fetch.cast(eqn, values) or fp8_fetch.dot(eqn, values)
        return fused if fused is not None else bind(eqn, [fp8_fetch.fetched(v) for v in values])

    def _lookup(self, eqn, values):
        """A row lookup in a table split by rows (``row_lookup``), or None when ``eqn`` is not
        one: the table itself (or a dtype cast of it), indexed by data."""
        table, index = values if len(values) == 2 else (None, None)
        src = self._plain_source(table, 0)
        if src is None or isinstance(index, _WeightOnly) or not row_lookup.is_row_lookup(eqn):
            return None
        stored = self.stored[table.cast_of]
        shard, stand_in = (stored, None) if src.frozen else stored
        out = row_lookup.lookup(shard, stand_in, index, eqn.invars[0].aval.dtype)
        if self.prefetch:  # the next unit's fetch may start once the rows are there
            self.fetch_tokens.append(token([out]))
        return [out]

    def _plain_source(self, value, dim: int):
        """The source behind ``value`` when it is a stage-3 weight itself (or a dtype cast of
        it), split along ``dim``, gathered over every device, whole precision: what the row
        lookup and the column-split matmul read their shard from; else None."""
        if not isinstance(value, _WeightOnly) or value.cast_of is None:
            return None
        src = self.sources[value.cast_of]
        plain = isinstance(src, Frozen) or (isinstance(src, Sharded) and src.collectives.is_plain)
        return src if plain and src.dim == dim and not src.sliced else None

    def _split_columns(self, eqn, values):
        """``data @ weight`` computed where the weight's columns are (``split_columns``), when
        that moves fewer bytes than gathering the weight; else None."""
        if len(values) != 2 or isinstance(values[0], _WeightOnly):
            return None
        src = self._plain_source(values[1], 1)
        data_aval, weight_aval = (v.aval for v in eqn.invars)
        if src is None or not split_columns.applies(
            eqn, data_aval, weight_aval, src.dim, jax.lax.axis_size(zero_axes())
        ):
            return None
        stored = self.stored[values[1].cast_of]
        shard, stand_in = (stored, None) if src.frozen else stored
        out = split_columns.matmul(
            values[0],
            shard,
            stand_in,
            weight_aval.dtype,
            eqn.outvars[0].aval.dtype,
            weight_aval.shape[1],
        )
        if self.prefetch:  # the next unit's fetch may start once the product is there
            self.fetch_tokens.append(token([out]))
        return [out]

    def _meets_data(self, eqn, ins):
        """Outputs of an operation that combines weights with data: a row lookup or a
        column-split matmul where one applies, else a unit (``fetch_unit``) that fetches the
        weights for it."""
        values = [v for v, _ in ins]
        special = self._lookup(eqn, values)
        if special is None:
            special = self._split_columns(eqn, values)
        if special is not None:
            return special
        ops = _Operands(eqn, values)

        def compute(full_list, side_list, data):
            return bind(eqn, ops.values_with(dict(zip(ops.order, full_list)), side_list, data))

        args = (
            compute,
            [self.sources[i] for i in ops.order],
            [self.stored[i] for i in ops.order],
            ops.side_values,
            ops.data,
        )
        anchors = [j for j, k in enumerate(ops.data_pos) if ins[k][1]]
        if not self.prefetch:
            return run_unit(*args, anchors=anchors, wait=self.wait)
        earlier = self.fetch_tokens
        ahead = earlier[-self.prefetch] if len(earlier) >= self.prefetch else None
        outs, (fetch_token, self.grad_token) = run_unit(
            *args, anchors=anchors, wait=self.wait, tokens=(ahead, self.grad_token)
        )
        self.fetch_tokens.append(fetch_token)
        return outs


class _Operands:
    """An equation's operands split for a unit: the weight-only ones (``_WeightOnly``, built from
    the fetched weights ``order`` and the constant arrays ``side``) and the data ones."""

    def __init__(self, eqn, values):
        self.values = values
        self.weight_only = {k: v for k, v in enumerate(values) if isinstance(v, _WeightOnly)}
        self.order = sorted(frozenset().union(*(v.sources for v in self.weight_only.values())))
        side = {}
        for v in self.weight_only.values():
            side.update(v.side)
        self.side_keys, self.side_values = list(side), list(side.values())
        self.data_pos = [
            k
            for k, atom in enumerate(eqn.invars)
            if k not in self.weight_only and not isinstance(atom, Literal)
        ]
        self.data = [values[k] for k in self.data_pos]

    def values_with(self, full: dict, side_list, data) -> list:
        """The operands, the weight-only ones built from ``full`` (fetched weights by index)
        and ``side_list``, the data ones from ``data``."""
        side_by_key = dict(zip(self.side_keys, side_list))
        vals = list(self.values)
        for k, weight_only in self.weight_only.items():
            vals[k] = weight_only.build(full, side_by_key)
        for k, d in zip(self.data_pos, data):
            vals[k] = d
        return vals


def _but_fetched(policy):
    """``policy`` (a ``jax.checkpoint`` policy; None saves nothing) that never saves a fetched
    weight or a layout change of one."""
    if policy is None:
        return None
    return lambda prim, *args, **params: (
        save_all_but_fetched(prim, *args, **params) and policy(prim, *args, **params)
    )
