"""Painting: decide, for every equation of a jaxpr, the precision it runs in.

A pure pass over the jaxpr, before anything is bound: it follows the *current* dtype of every
value (what the interpreter will actually hold), and returns one ``EqnPlan`` per equation with
the dtype each input is cast to, the values that come out, and the reason. The interpreter
(``interpret.py``) replays the plans; the report (``report.py``) prints them. Higher-order
primitives (loops, conditionals, remat, calls) are painted by the painters that
``higher_order.py`` registers in ``PAINTERS``; they recurse back into ``paint_jaxpr``.

Casts are tracked by *group*: a value and all its casts form one group, and a dtype that a
group already holds is never cast again. Explicit casts in the program join the group of their
input, so back-to-back opposite casts cancel (the second returns the original).
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
from collections.abc import Callable
from typing import Any

import jax.numpy as jnp
import numpy as np
from jax.extend import core as jcore

from zeroflow.autocast import cost, lists
from zeroflow.autocast.policy import AutocastPolicy, split_scope
from zeroflow.util import jaxprs

F32 = np.dtype(np.float32)

PAINTERS: dict[str, Callable] = {}
"""Primitive name -> ``painter(eqn, ins, ctx) -> EqnPlan`` for higher-order primitives, filled
by ``higher_order.py`` (which builds on this module) when ``zeroflow.autocast`` is imported."""


def norm(dtype):
    """A hashable, comparable dtype: numpy's for array types, jax's own for extended dtypes
    (PRNG keys), which numpy cannot represent."""
    try:
        return np.dtype(dtype)
    except TypeError:
        return dtype


def is_float(dtype) -> bool:
    dtype = norm(dtype)  # jnp.issubdtype: numpy does not count bfloat16 as floating
    return isinstance(dtype, np.dtype) and bool(jnp.issubdtype(dtype, jnp.floating))


def dtype_of(x):
    return norm(x.dtype if hasattr(x, "dtype") else np.asarray(x).dtype)


def widened(dtype) -> np.dtype:
    """``dtype`` at least as wide as fp32 (fp64 stays fp64)."""
    dtype = np.dtype(dtype)
    return F32 if dtype.itemsize < 4 else dtype


@dataclasses.dataclass(frozen=True)
class Value:
    """What painting knows about one value."""

    dtype: Any
    group: int
    "Id of the value's cast group (the value and its casts)."
    sensitive: bool = False
    "Computed in fp32 by an fp32-list op (or from one): mixing it with half values stays fp32."
    pinned: bool = False
    "Computed after gradient unscaling: it and everything derived from it stays fp32."
    literal: bool = False
    cast_share: float = 1.0
    "Fraction of a cast a use pays (1 / trip count for loop-invariant values)."
    at_rest: bool = True
    "Read from memory (input, weight, opaque op's result): casting it is a pass of its own."


class Groups:
    """The dtypes each cast group holds; copied for trial paintings of loop bodies."""

    def __init__(self) -> None:
        self.held: dict[int, set] = {}
        self._ids = itertools.count()

    def new(self, dtype) -> int:
        gid = next(self._ids)
        self.held[gid] = {norm(dtype)}
        return gid

    def has(self, gid: int, dtype) -> bool:
        return norm(dtype) in self.held[gid]

    def add(self, gid: int, dtype) -> None:
        self.held[gid].add(norm(dtype))

    def trial(self) -> Groups:
        twin = copy.copy(self)
        twin.held = {k: set(v) for k, v in self.held.items()}
        return twin

    def adopt(self, other: Groups) -> None:
        self.held, self._ids = other.held, other._ids


@dataclasses.dataclass
class EqnPlan:
    eqn: Any
    decision: str
    "``low``, ``fp32``, ``declared``, ``neutral`` or ``alias``; or a higher-order kind."
    reason: str
    in_dtypes: tuple
    "Dtype each input is cast to before binding (None: as it is)."
    outs: tuple
    "The ``Value`` of each output."
    path: str = ""
    scope: str = ""
    params: dict | None = None
    "Bind params when they differ from the eqn's (a low dot's preferred_element_type)."
    sub: Any = None
    "The plan of a higher-order primitive (``higher_order.py``)."
    in_values: tuple = ()
    "The ``Value`` of each input as painting found it (for the report)."
    fp8: str | None = None
    "A matmul run in FP8 (``fp8.scaled_dot``): its scaling recipe."


@dataclasses.dataclass
class Painting:
    jaxpr: Any
    eqns: list
    outs: list
    "The ``Value`` of each output, after ``out_dtypes`` casts."
    out_dtypes: list
    "Dtype each output is cast to at the end (None: as it is)."


@dataclasses.dataclass
class Ctx:
    low: np.dtype
    policy: AutocastPolicy
    groups: Groups
    path: str = ""
    scope: str = ""
    fp32_outs: frozenset = frozenset()
    "Outputs of the jaxpr being painted whose every use outside ends in an fp32-list op."
    eqn_fp32_outs: frozenset = frozenset()
    "While painting one eqn: the indices of its outputs whose every use ends in fp32 ops."
    fp8: bool = False
    "dtype='fp8': low is bf16, and large weight matmuls run in FP8."

    def inside(self, path: str, scope: str = "") -> Ctx:
        return dataclasses.replace(
            self,
            path=path,
            scope=join_scope(self.scope, scope),
            fp32_outs=frozenset(),
            eqn_fp32_outs=frozenset(),
        )

    def into_call(self, path: str) -> Ctx:
        """The context of an inlined call's body: its outputs' uses are the call's."""
        return dataclasses.replace(self, path=path, fp32_outs=self.eqn_fp32_outs)


def join_scope(outer: str, inner: str) -> str:
    return "/".join(s for s in (outer, inner) if s)


def fresh(value: Value, groups: Groups, **changes) -> Value:
    """The same value held by a new group (a loop carry, a branch operand, a remat input)."""
    dtype = changes.pop("dtype", value.dtype)
    return dataclasses.replace(
        value, dtype=norm(dtype), group=groups.new(dtype), literal=False, cast_share=1.0, **changes
    )


def literal_value(lit, groups: Groups) -> Value:
    dtype = norm(lit.aval.dtype)
    return Value(dtype=dtype, group=groups.new(dtype), literal=True)


# --------------------------------------------------------------------------- the pass
def paint_jaxpr(jaxpr, const_values, in_values, ctx: Ctx, out_targets=None) -> Painting:
    """Paint ``jaxpr`` (a ``Jaxpr``) given the ``Value`` of each constvar and invar.

    ``out_targets``: a dtype (or None) per output that the outputs are cast to (loop carries).
    """
    env: dict = dict(zip(jaxpr.constvars, const_values))
    env.update(zip(jaxpr.invars, in_values))

    def read(atom) -> Value:
        if isinstance(atom, jcore.Literal):
            return literal_value(atom, ctx.groups)
        return env[atom]

    fp32_only = uses_only_fp32(jaxpr, ctx.policy, ctx.fp32_outs)
    allow_uses = count_allow_uses(jaxpr, ctx.policy)
    plans = []
    for i, eqn in enumerate(jaxpr.eqns):
        ins = [
            read(v) if isinstance(v, jcore.Literal) else _share(read(v), allow_uses.get(v, 1))
            for v in eqn.invars
        ]
        sub_ctx = dataclasses.replace(
            ctx.inside(f"{ctx.path}{eqn.primitive.name}#{i}", str(eqn.source_info.name_stack)),
            eqn_fp32_outs=frozenset(k for k, v in enumerate(eqn.outvars) if v in fp32_only),
        )
        painter = PAINTERS.get(eqn.primitive.name)
        if painter is not None:
            plan = painter(eqn, ins, sub_ctx)
        else:
            plan = paint_simple(eqn, ins, sub_ctx, fp32_only)
        plan.path, plan.scope, plan.in_values = sub_ctx.path, sub_ctx.scope, tuple(ins)
        plans.append(plan)
        for var, value in zip(eqn.outvars, plan.outs):
            env[var] = value

    outs = [read(v) for v in jaxpr.outvars]
    targets = list(out_targets) if out_targets is not None else [None] * len(outs)
    for k, (value, target) in enumerate(zip(outs, targets)):
        if target is None or norm(target) == norm(value.dtype):
            targets[k] = None
            continue
        if not value.literal:
            ctx.groups.add(value.group, target)
        outs[k] = dataclasses.replace(value, dtype=norm(target))
    return Painting(jaxpr=jaxpr, eqns=plans, outs=outs, out_dtypes=targets)


def _share(value: Value, uses: int) -> Value:
    return value if uses <= 1 else dataclasses.replace(value, cast_share=value.cast_share / uses)


def count_allow_uses(jaxpr, policy: AutocastPolicy) -> dict:
    """How many allow-list ops read each var: they share the cost of casting it."""
    counts: dict = {}
    for eqn in jaxpr.eqns:
        if policy.category(eqn.primitive.name) == "low":
            for v in set(v for v in eqn.invars if not isinstance(v, jcore.Literal)):
                counts[v] = counts.get(v, 0) + 1
    return counts


def uses_only_fp32(jaxpr, policy: AutocastPolicy, fp32_outs=frozenset()) -> set:
    """Vars whose every use ends in an fp32-list op through follow/neutral ops (and inlined
    calls) only, e.g. the ``x * x`` under a variance or the ``x - max`` under a softmax's
    ``exp``. ``fp32_outs``: indices of outputs that count as such a use (the caller of an
    inlined call says so)."""
    consumers: dict = {}
    for eqn in jaxpr.eqns:
        for k, v in enumerate(eqn.invars):
            if not isinstance(v, jcore.Literal):
                consumers.setdefault(v, []).append((eqn, k))
    outs = [(k, v) for k, v in enumerate(jaxpr.outvars) if not isinstance(v, jcore.Literal)]
    other_outputs = {v for k, v in outs if k not in fp32_outs}
    fp32_outputs = {v for k, v in outs if k in fp32_outs}
    result: set = set()

    def feeds_fp32(eqn, k) -> bool:
        name, body = eqn.primitive.name, jaxprs.call_body(eqn)
        if body is not None:
            inner, _ = jaxprs.open_jaxpr(body)
            inner_outs = frozenset(j for j, v in enumerate(eqn.outvars) if v in result)
            return inner.invars[k] in _uses_only_fp32_cached(inner, policy, inner_outs)
        kind = policy.category(name)
        if kind == "fp32":
            return True
        if kind not in ("follow", "neutral"):
            return False
        return all(
            v in result
            for v in eqn.outvars
            if not isinstance(v, jcore.DropVar) and is_float(v.aval.dtype)
        )

    def decide(v) -> None:
        if isinstance(v, jcore.DropVar) or v in other_outputs or not is_float(v.aval.dtype):
            return
        uses = consumers.get(v, [])
        if (uses or v in fp32_outputs) and all(feeds_fp32(c, k) for c, k in uses):
            result.add(v)

    for eqn in reversed(jaxpr.eqns):
        for v in eqn.outvars:
            decide(v)
    for v in jaxpr.invars:
        decide(v)
    return result


_FP32_CACHE: dict = {}


def _uses_only_fp32_cached(jaxpr, policy, fp32_outs) -> set:
    key = (id(jaxpr), policy, fp32_outs)
    if key not in _FP32_CACHE or _FP32_CACHE[key][0] is not jaxpr:
        if len(_FP32_CACHE) > 4096:
            _FP32_CACHE.clear()
        _FP32_CACHE[key] = (jaxpr, uses_only_fp32(jaxpr, policy, fp32_outs))
    return _FP32_CACHE[key][1]


# --------------------------------------------------------------------------- first-order ops
def paint_simple(eqn, ins, ctx: Ctx, fp32_only: set) -> EqnPlan:
    name = eqn.primitive.name
    if name == "convert_element_type":
        return _paint_convert(eqn, ins, ctx)
    floats = [i for i, v in enumerate(eqn.invars) if is_float(v.aval.dtype)]
    if any(ins[i].pinned for i in floats) or lists.UNSCALE_SCOPE in split_scope(ctx.scope):
        return declared(
            eqn,
            ins,
            ctx,
            "after gradient unscaling: fp32 from here on",
            decision="fp32",
            pinned=True,
        )
    if not floats:
        return declared(eqn, ins, ctx, "no floating-point input", decision="neutral")
    if any(np.dtype(eqn.invars[i].aval.dtype).itemsize > 4 for i in floats):
        return declared(eqn, ins, ctx, "fp64 input: left as declared")
    rule = ctx.policy.scope_rule(ctx.scope)
    if rule == "fp32":
        return declared(eqn, ins, ctx, "policy: fp32 scope", decision="fp32", sensitive=True)
    kind = ctx.policy.category(name)
    if kind == "low":
        return _paint_allow(eqn, ins, ctx, floats, forced=rule == "low")
    if kind == "fp32":
        return run_at(eqn, ins, ctx, floats, F32, "fp32", "fp32 list", sensitive=True)
    if kind == "follow":
        return _paint_follow(eqn, ins, ctx, floats, fp32_only)
    if kind == "neutral":
        return _paint_neutral(eqn, ins, ctx, floats, fp32_only)
    if kind == "operand_led":
        lead = ins[floats[0]]
        return run_at(
            eqn,
            ins,
            ctx,
            floats,
            lead.dtype,
            "neutral",
            "update takes the buffer's dtype",
            sensitive=lead.sensitive,
        )
    if kind == "passthrough":
        return _paint_passthrough(eqn, ins, ctx)
    return declared(eqn, ins, ctx, "not on any list: declared dtypes")


def declared(
    eqn,
    ins,
    ctx: Ctx,
    reason: str,
    *,
    decision: str = "declared",
    pinned: bool = False,
    sensitive="inherit",
) -> EqnPlan:
    """Run ``eqn`` exactly as the program declared it: inputs cast back to their declared
    dtypes. ``sensitive``: True or False for the outputs, or "inherit" from the inputs."""
    in_dtypes = tuple(_cast_to(val, v.aval.dtype, ctx) for v, val in zip(eqn.invars, ins))
    pinned = pinned or any(val.pinned for val in ins)
    sens = any(val.sensitive for val in ins) if sensitive == "inherit" else sensitive
    outs = tuple(
        Value(
            dtype=norm(v.aval.dtype),
            group=ctx.groups.new(v.aval.dtype),
            sensitive=sens,
            pinned=pinned,
        )
        for v in eqn.outvars
    )
    return EqnPlan(eqn, decision, reason, in_dtypes, outs)


def run_at(
    eqn,
    ins,
    ctx: Ctx,
    floats,
    dtype,
    decision: str,
    reason: str,
    *,
    sensitive: bool = False,
    params=None,
) -> EqnPlan:
    """Cast the floating inputs to ``dtype`` (fp32-list ops: widen to at least fp32) and run."""
    in_dtypes = [None] * len(ins)
    for i in floats:
        target = widened(eqn.invars[i].aval.dtype) if decision == "fp32" else np.dtype(dtype)
        in_dtypes[i] = _cast_to(ins[i], target, ctx)
    float_in = {np.dtype(eqn.invars[i].aval.dtype) for i in floats}
    outs = []
    for v in eqn.outvars:
        out_dtype = norm(v.aval.dtype)
        if is_float(out_dtype) and out_dtype in float_in:
            out_dtype = widened(out_dtype) if decision == "fp32" else np.dtype(dtype)
        outs.append(
            Value(
                dtype=out_dtype,
                group=ctx.groups.new(out_dtype),
                sensitive=sensitive and is_float(out_dtype),
                at_rest=False,
            )
        )
    return EqnPlan(eqn, decision, reason, tuple(in_dtypes), tuple(outs), params=params)


def _cast_to(value: Value, dtype, ctx: Ctx):
    """The dtype to cast ``value`` to (None if it already is), registering the cast."""
    dtype = norm(dtype)
    if norm(value.dtype) == dtype:
        return None
    if not value.literal:
        ctx.groups.add(value.group, dtype)
    return dtype


def _paint_convert(eqn, ins, ctx: Ctx) -> EqnPlan:
    (x,), (var,) = ins, eqn.invars
    new = norm(eqn.params["new_dtype"])
    old = norm(var.aval.dtype)
    if not (is_float(old) and is_float(new)) or x.literal:
        return declared(eqn, ins, ctx, "cast to or from a non-float type")
    if old == new:  # a weak-type change: no cast in the original program, none here
        return EqnPlan(eqn, "alias", "no-op cast", (None,), (x,))
    if np.dtype(x.dtype) != new:
        ctx.groups.add(x.group, new)
    out = dataclasses.replace(x, dtype=new, sensitive=x.sensitive and new.itemsize >= 4)
    return EqnPlan(
        eqn, "alias", f"explicit cast to {new.name} (shares the value's casts)", (None,), (out,)
    )


def _paint_allow(eqn, ins, ctx: Ctx, floats, forced: bool) -> EqnPlan:
    low = ctx.low
    if ctx.fp8 and not ctx.policy.fp8_cost_model and eqn.primitive.name == "dot_general":
        forced = True  # every eligible matmul in FP8: the bytes model must not keep it fp32
    if forced or not ctx.policy.cost_model:
        reason = "allow list (policy: low scope)" if forced else "allow list"
    else:
        operands = [
            cost.Operand(
                size=cost.size_of(eqn.invars[i].aval),
                is_low=np.dtype(ins[i].dtype) == low,
                cast_ready=ins[i].literal or ctx.groups.has(ins[i].group, low),
                cast_share=ins[i].cast_share,
                at_rest=ins[i].at_rest,
            )
            for i in floats
        ]
        out_size = sum(cost.size_of(v.aval) for v in eqn.outvars)
        verdict = cost.judge(operands, out_size, train=ctx.policy.train)
        if not verdict.convert:
            return declared(
                eqn, ins, ctx, "allow list, " + verdict.reason(), decision="fp32", sensitive=False
            )
        reason = "allow list, " + verdict.reason()
    params = dict(eqn.params)
    if "preferred_element_type" in params:
        params["preferred_element_type"] = low
    plan = run_at(eqn, ins, ctx, floats, low, "low", reason, params=params)
    if ctx.fp8 and eqn.primitive.name == "dot_general" and len(floats) == 2:
        _choose_fp8(plan, ctx)
    return plan


def _choose_fp8(plan: EqnPlan, ctx: Ctx) -> None:
    """Turn a low ``dot_general`` into an FP8 one where the policy and the roofline agree."""
    eqn = plan.eqn
    (lc, rc), (lb, _) = eqn.params["dimension_numbers"]
    lhs, rhs = (v.aval.shape for v in eqn.invars)
    if lb:
        verdict = cost.Fp8Verdict(False, 0, 0, "batched: attention-like, both operands computed")
    elif ctx.policy.fp8_kept(ctx.scope):
        verdict = cost.Fp8Verdict(False, 0, 0, "policy: fp8_keep_scopes")
    else:
        k = int(np.prod([lhs[d] for d in lc]))
        m = int(np.prod(lhs)) // k
        n = int(np.prod(rhs)) // k
        verdict = cost.judge_fp8(1, m, k, n, train=ctx.policy.train)
        if not ctx.policy.fp8_cost_model and not verdict.why:
            plan.reason += "; fp8 (policy: fp8_cost_model=False)"
            plan.decision, plan.fp8 = "fp8", ctx.policy.fp8_scaling
            return
    plan.reason += "; " + verdict.reason()
    if verdict.convert:
        plan.decision, plan.fp8 = "fp8", ctx.policy.fp8_scaling


def _low_compatible(value: Value, eqn_var, low) -> bool:
    """A literal that the half dtype represents exactly (comparing with it in half is exact)."""
    if not value.literal:
        return np.dtype(value.dtype) == low
    val = np.asarray(eqn_var.val)
    return bool(np.all(val.astype(low).astype(val.dtype) == val))


def _paint_follow(eqn, ins, ctx: Ctx, floats, fp32_only: set) -> EqnPlan:
    low = ctx.low
    outs_fp32 = [
        v for v in eqn.outvars if is_float(v.aval.dtype) and not isinstance(v, jcore.DropVar)
    ]
    if outs_fp32 and all(v in fp32_only for v in outs_fp32):
        return run_at(
            eqn, ins, ctx, floats, F32, "fp32", "every use ends in an fp32-list op", sensitive=True
        )
    half_in = any(np.dtype(ins[i].dtype) == low and not ins[i].literal for i in floats)
    sensitive = any(ins[i].sensitive and np.dtype(ins[i].dtype) != low for i in floats)
    if sensitive:
        return run_at(
            eqn,
            ins,
            ctx,
            floats,
            F32,
            "fp32",
            "an input comes from an fp32-list op",
            sensitive=True,
        )
    if half_in:
        return run_at(eqn, ins, ctx, floats, low, "low", "follows its half input")
    return declared(eqn, ins, ctx, "no half input", decision="neutral")


def _paint_neutral(eqn, ins, ctx: Ctx, floats, fp32_only: set) -> EqnPlan:
    arrays = [i for i in floats if not ins[i].literal]
    if not arrays:
        return declared(eqn, ins, ctx, "literal inputs only", decision="neutral")
    dtypes = {np.dtype(ins[i].dtype) for i in arrays}
    comparison = eqn.primitive.name in lists.COMPARISONS
    if len(dtypes) == 1:
        dtype = dtypes.pop()
        only = ins[arrays[0]]
        if (
            len(arrays) == 1
            and dtype != ctx.low
            and not (only.sensitive or only.pinned)
            and ctx.groups.has(only.group, ctx.low)
        ):
            # e.g. ``w.T`` after ``w`` was cast for another matmul: move the half copy, not
            # the fp32 one, so the weight is not cast a second time.
            return run_at(eqn, ins, ctx, floats, ctx.low, "low", "uses the half copy made earlier")
        if (
            comparison
            and dtype == ctx.low
            and not all(_low_compatible(ins[i], eqn.invars[i], ctx.low) for i in floats)
        ):
            return run_at(eqn, ins, ctx, floats, F32, "fp32", "compares with a constant in fp32")
        plan = run_at(
            eqn,
            ins,
            ctx,
            floats,
            dtype,
            "neutral",
            "takes its input's dtype",
            sensitive=any(ins[i].sensitive for i in arrays),
        )
        if (
            len(arrays) == 1
            and len(plan.outs) == 1
            and only.at_rest
            and (cost.size_of(eqn.outvars[0].aval) == cost.size_of(eqn.invars[arrays[0]].aval))
        ):
            # a transpose / reshape of a weight: casting it reads the whole weight as before
            plan.outs = (dataclasses.replace(plan.outs[0], at_rest=True),)
        return plan
    if comparison:
        return run_at(eqn, ins, ctx, floats, F32, "fp32", "compares mixed dtypes in fp32")
    return _paint_follow(eqn, ins, ctx, floats, fp32_only)


def _paint_passthrough(eqn, ins, ctx: Ctx) -> EqnPlan:
    # Each output is a new array in the interpreter, so it starts a group of its own.
    outs = tuple(
        fresh(ins[i], ctx.groups)
        if i < len(ins) and is_float(v.aval.dtype)
        else Value(dtype=norm(v.aval.dtype), group=ctx.groups.new(v.aval.dtype))
        for i, v in enumerate(eqn.outvars)
    )
    return EqnPlan(
        eqn, "neutral", "each operand passes through in its own dtype", (None,) * len(ins), outs
    )
