"""Higher-order primitives: paint their sub-jaxprs, then rebuild them with jax's public API.

Each primitive has a painter (called by ``paint.paint_jaxpr``) and a runner (called by
``interpret.run_jaxpr``), which this module registers in ``paint.PAINTERS`` and
``interpret.RUNNERS`` when it is imported (``zeroflow.autocast`` imports it): it builds on
those two modules, so they look it up by primitive name rather than import it. Runners
rebuild the primitive from its public counterpart (``lax.scan``, ``lax.while_loop``,
``lax.switch``, ``jax.checkpoint``, ``jax.shard_map``, ``jax.custom_jvp`` /
``jax.custom_vjp``) around a Python body that interprets the painted sub-jaxpr, so jax derives
the new sub-jaxprs, their dtypes and their transposes itself. The only things read from a
primitive are its params; their names are version-dependent, and every such read lives in this
file (a call's body: ``zeroflow.util.jaxprs.call_body``).

- Loops (``scan``, ``while``): a carry enters in its current dtype if the body gives it back
  in that dtype; otherwise it takes the dtype the program declared, and the body casts it back
  at the end of each iteration, so carries are stable. Loop-invariant operands (consts) are
  cast once, outside the loop.
- ``cond``: every branch is painted on the same operands; an output on which branches disagree
  takes its declared dtype.
- ``remat`` (``jax.checkpoint``): casts happen inside, so they are recomputed in the backward
  pass rather than saved.
- ``jit`` / ``closed_call``: inlined.
- ``custom_jvp_call`` / ``custom_vjp_call``: declared dtypes, unless ``policy.custom_calls``
  names the function: then its body runs under autocast and its rule is applied at the
  declared dtypes (the jvp / vjp of the original call, inputs cast back).
- ``shard_map``: its body is painted per shard.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
from jax import lax

from zeroflow.autocast import fp8_delayed, interpret, paint
from zeroflow.autocast.interpret import Copies, Slot, const_slots, run_jaxpr
from zeroflow.autocast.paint import Ctx, EqnPlan, Painting, Value, fresh, norm
from zeroflow.util.compat import scan_split
from zeroflow.util.jaxprs import CALLS, bind, call_body, open_jaxpr


def _const_values(consts, ctx: Ctx) -> list[Value]:
    return [Value(dtype=paint.dtype_of(c), group=ctx.groups.new(paint.dtype_of(c))) for c in consts]


def _retarget(painting: Painting, targets, groups) -> None:
    """Cast a painting's outputs to ``targets`` (None: as they are) after the fact."""
    for k, target in enumerate(targets):
        value = painting.outs[k]
        if target is None or norm(target) == norm(value.dtype):
            continue
        if not value.literal:
            groups.add(value.group, target)
        painting.outs[k] = dataclasses.replace(value, dtype=norm(target))
        painting.out_dtypes[k] = norm(target)


def _values(slots: list[Slot]) -> list:
    return [slot.value for slot in slots]


def _slots(arrays, dtypes) -> list[Slot]:
    return [Slot(Copies(a), norm(d)) for a, d in zip(arrays, dtypes)]


# --------------------------------------------------------------------------- inline calls
@dataclasses.dataclass
class CallPlan:
    body: Painting
    consts: list


def paint_call(eqn, ins, ctx: Ctx) -> EqnPlan:
    jaxpr, consts = open_jaxpr(call_body(eqn))
    body = paint.paint_jaxpr(jaxpr, _const_values(consts, ctx), ins, ctx.into_call(ctx.path + "/"))
    name = eqn.params.get("name", eqn.primitive.name)
    return EqnPlan(
        eqn,
        "call",
        f"inlined {eqn.primitive.name} '{name}'",
        (None,) * len(ins),
        tuple(body.outs),
        sub=CallPlan(body, consts),
    )


def run_call(plan: EqnPlan, slots):
    return run_jaxpr(plan.sub.body, const_slots(plan.sub.consts), slots)


# --------------------------------------------------------------------------- remat
def paint_remat(eqn, ins, ctx: Ctx) -> EqnPlan:
    jaxpr, consts = open_jaxpr(eqn.params["jaxpr"])
    inner = [fresh(v, ctx.groups) for v in ins]  # casts inside are recomputed, not saved
    body = paint.paint_jaxpr(jaxpr, _const_values(consts, ctx), inner, ctx.inside(ctx.path + "/"))
    outs = tuple(fresh(v, ctx.groups) for v in body.outs)
    return EqnPlan(
        eqn,
        "remat",
        "checkpointed body painted inside (casts recomputed in backward)",
        (None,) * len(ins),
        outs,
        sub=CallPlan(body, consts),
    )


def run_remat(plan: EqnPlan, slots):
    body, dtypes = plan.sub, [s.dtype for s in slots]

    def checkpointed(*arrays):
        return _values(run_jaxpr(body.body, const_slots(body.consts), _slots(arrays, dtypes)))

    params = plan.eqn.params
    fn = jax.checkpoint(
        checkpointed, prevent_cse=params.get("prevent_cse", True), policy=params.get("policy")
    )
    return [Slot.of(x) for x in fn(*_values(slots))]


# --------------------------------------------------------------------------- loops
@dataclasses.dataclass
class LoopPlan:
    body: Painting
    body_consts: list
    carry: list
    "The dtype of each carry."
    precast: dict
    "Operand index -> dtypes it is cast to outside the loop (loop-invariant operands)."
    cond: Painting | None = None
    cond_consts: list = dataclasses.field(default_factory=list)


def _paint_loop(
    body_jaxpr,
    body_consts,
    consts,
    init,
    xs,
    ctx: Ctx,
    *,
    trips: int,
    cond_jaxpr=None,
    cond_consts_vals=(),
    cond_consts=(),
):
    """Paint a loop body (and a while loop's cond) until its carries are stable.

    Returns ``(body, cond, carry_dtypes, groups)``; the caller adopts ``groups``.
    """
    n = len(init)
    declared = [norm(v.aval.dtype) for v in body_jaxpr.invars[len(consts) : len(consts) + n]]
    shared = [dataclasses.replace(v, cast_share=v.cast_share / max(trips, 1)) for v in consts]

    def attempt(carry, force):
        groups = ctx.groups.trial()
        c = dataclasses.replace(ctx, groups=groups)
        carry_in = [fresh(v, groups, dtype=d) for v, d in zip(init, carry)]
        x_in = [fresh(v, groups) for v in xs]
        targets = (list(carry) if force else [None] * n) + [None] * (len(body_jaxpr.outvars) - n)
        body = paint.paint_jaxpr(
            body_jaxpr,
            _const_values(body_consts, c),
            shared + carry_in + x_in,
            c.inside(ctx.path + "/body/"),
            out_targets=targets,
        )
        cond = None
        if cond_jaxpr is not None:
            cond_in = [fresh(v, groups, dtype=d) for v, d in zip(init, carry)]
            cond = paint.paint_jaxpr(
                cond_jaxpr,
                _const_values(cond_consts, c),
                list(cond_consts_vals) + cond_in,
                c.inside(ctx.path + "/cond/"),
            )
        return body, cond, groups

    carry = [norm(v.dtype) for v in init]
    body, cond, groups = attempt(carry, force=False)
    if [norm(v.dtype) for v in body.outs[:n]] != carry:
        carry = [c if norm(o.dtype) == c else d for c, o, d in zip(carry, body.outs[:n], declared)]
        body, cond, groups = attempt(carry, force=True)
    return body, cond, carry, groups


def _precast(operands, before: dict, groups) -> dict:
    """Dtypes the loop body asked of each loop-invariant operand that it did not hold before."""
    out = {}
    for k, v in operands:
        if v.literal:
            continue
        new = groups.held[v.group] - before[v.group]
        if new:
            out[k] = new
    return out


def paint_scan(eqn, ins, ctx: Ctx) -> EqnPlan:
    p = eqn.params
    nc, nk = scan_split(p)
    consts, init, xs = ins[:nc], ins[nc : nc + nk], ins[nc + nk :]
    body_jaxpr, body_consts = open_jaxpr(p["jaxpr"])
    before = {v.group: set(ctx.groups.held[v.group]) for v in consts if not v.literal}
    body, _, carry, groups = _paint_loop(
        body_jaxpr, body_consts, consts, init, xs, ctx, trips=p["length"]
    )
    ctx.groups.adopt(groups)
    in_dtypes = (
        [None] * nc + [paint._cast_to(v, d, ctx) for v, d in zip(init, carry)] + [None] * len(xs)
    )
    outs = [fresh(body.outs[k], ctx.groups, dtype=carry[k]) for k in range(nk)]
    outs += [fresh(v, ctx.groups) for v in body.outs[nk:]]
    plan = LoopPlan(
        body=body,
        body_consts=body_consts,
        carry=carry,
        precast=_precast(list(enumerate(consts)), before, ctx.groups),
    )
    return EqnPlan(eqn, "loop", _carry_reason(carry, init), tuple(in_dtypes), tuple(outs), sub=plan)


def _carry_reason(carry, init) -> str:
    kinds = ", ".join(str(norm(d)) for d in carry) or "none"
    return f"carries: {kinds}"


def run_scan(plan: EqnPlan, slots):
    p, loop = plan.eqn.params, plan.sub
    nc, nk = scan_split(p)
    consts, init, xs = slots[:nc], slots[nc : nc + nk], slots[nc + nk :]
    for k, dtypes in loop.precast.items():
        for d in dtypes:
            consts[k].copies.get(d)  # cast once, outside the loop
    x_dtypes = [s.dtype for s in xs]
    sites = fp8_delayed.active()
    # delayed FP8 state of the body's matmuls: one per iteration, scanned over with the xs (as
    # a closed-over constant its cotangent, the next state, would be summed over iterations)
    metas = sites.inner(sites.path) if sites is not None and not sites.init else {}

    def body(carry, x_and_metas):
        x, step_metas = x_and_metas
        inside = [Slot(Copies(parent=s.copies), s.dtype) for s in consts]
        with fp8_delayed.scan_body(sites, step_metas) as made:
            outs = run_jaxpr(
                loop.body,
                const_slots(loop.body_consts),
                inside + _slots(carry, loop.carry) + _slots(x, x_dtypes),
            )
        return _values(outs[:nk]), (_values(outs[nk:]), made)

    carry, (ys, made) = lax.scan(
        body,
        [s.copies.get(d) for s, d in zip(init, loop.carry)],
        (_values(xs), metas),
        length=p["length"],
        reverse=p.get("reverse", False),
        unroll=p.get("unroll", 1),
        _split_transpose=p.get("_split_transpose", False),
    )
    if sites is not None and sites.init:
        sites.metas.update(made)  # fresh state made in the body, stacked over the iterations
    return [Slot.of(x) for x in list(carry) + list(ys)]


def paint_while(eqn, ins, ctx: Ctx) -> EqnPlan:
    p = eqn.params
    cc, bc = p["cond_nconsts"], p["body_nconsts"]
    cconsts, bconsts, init = ins[:cc], ins[cc : cc + bc], ins[cc + bc :]
    body_jaxpr, body_consts = open_jaxpr(p["body_jaxpr"])
    cond_jaxpr, cond_consts = open_jaxpr(p["cond_jaxpr"])
    before = {v.group: set(ctx.groups.held[v.group]) for v in cconsts + bconsts if not v.literal}
    body, cond, carry, groups = _paint_loop(
        body_jaxpr,
        body_consts,
        bconsts,
        init,
        [],
        ctx,
        trips=1,
        cond_jaxpr=cond_jaxpr,
        cond_consts_vals=cconsts,
        cond_consts=cond_consts,
    )
    ctx.groups.adopt(groups)
    in_dtypes = [None] * (cc + bc) + [paint._cast_to(v, d, ctx) for v, d in zip(init, carry)]
    outs = tuple(fresh(body.outs[k], ctx.groups, dtype=carry[k]) for k in range(len(init)))
    plan = LoopPlan(
        body=body,
        body_consts=body_consts,
        carry=carry,
        cond=cond,
        cond_consts=cond_consts,
        precast=_precast(list(enumerate(cconsts + bconsts)), before, ctx.groups),
    )
    return EqnPlan(eqn, "loop", _carry_reason(carry, init), tuple(in_dtypes), outs, sub=plan)


def run_while(plan: EqnPlan, slots):
    p, loop = plan.eqn.params, plan.sub
    cc, bc = p["cond_nconsts"], p["body_nconsts"]
    for k, dtypes in loop.precast.items():
        for d in dtypes:
            slots[k].copies.get(d)
    cconsts, bconsts, init = slots[:cc], slots[cc : cc + bc], slots[cc + bc :]

    def view(consts):
        return [Slot(Copies(parent=s.copies), s.dtype) for s in consts]

    def cond_fn(carry):
        out = run_jaxpr(
            loop.cond, const_slots(loop.cond_consts), view(cconsts) + _slots(carry, loop.carry)
        )
        return out[0].value

    def body_fn(carry):
        out = run_jaxpr(
            loop.body, const_slots(loop.body_consts), view(bconsts) + _slots(carry, loop.carry)
        )
        return _values(out)

    with fp8_delayed.in_while():
        out = lax.while_loop(cond_fn, body_fn, [s.copies.get(d) for s, d in zip(init, loop.carry)])
    return [Slot.of(x) for x in out]


# --------------------------------------------------------------------------- cond
@dataclasses.dataclass
class CondPlan:
    branches: list
    consts: list


def paint_cond(eqn, ins, ctx: Ctx) -> EqnPlan:
    ops = ins[1:]
    branches, consts = [], []
    for k, closed in enumerate(eqn.params["branches"]):
        jaxpr, c = open_jaxpr(closed)
        operands = [fresh(v, ctx.groups) for v in ops]
        branches.append(
            paint.paint_jaxpr(
                jaxpr, _const_values(c, ctx), operands, ctx.inside(f"{ctx.path}/branch{k}/")
            )
        )
        consts.append(c)
    first = branches[0].jaxpr
    targets = []
    for k, var in enumerate(first.outvars):
        dtypes = {norm(b.outs[k].dtype) for b in branches}
        targets.append(None if len(dtypes) == 1 else norm(var.aval.dtype))
    for b in branches:
        _retarget(b, targets, ctx.groups)
    outs = tuple(fresh(v, ctx.groups) for v in branches[0].outs)
    return EqnPlan(
        eqn,
        "cond",
        f"{len(branches)} branches painted on the same operands",
        (None,) * len(ins),
        outs,
        sub=CondPlan(branches, consts),
    )


def run_cond(plan: EqnPlan, slots):
    index, ops = slots[0], slots[1:]
    dtypes = [s.dtype for s in ops]

    def branch(k):
        def fn(*arrays):
            with fp8_delayed.at(k):  # each branch's matmul sites get keys of their own
                outs = run_jaxpr(
                    plan.sub.branches[k], const_slots(plan.sub.consts[k]), _slots(arrays, dtypes)
                )
            return _values(outs)

        return fn

    out = lax.switch(index.value, [branch(k) for k in range(len(plan.sub.branches))], *_values(ops))
    return [Slot.of(x) for x in out]


# --------------------------------------------------------------------------- shard_map
def paint_shard_map(eqn, ins, ctx: Ctx) -> EqnPlan:
    jaxpr, consts = open_jaxpr(eqn.params["jaxpr"])
    inner = [fresh(v, ctx.groups) for v in ins]  # per-shard values
    body = paint.paint_jaxpr(jaxpr, _const_values(consts, ctx), inner, ctx.inside(ctx.path + "/"))
    outs = tuple(fresh(v, ctx.groups) for v in body.outs)
    return EqnPlan(
        eqn,
        "shard_map",
        "body painted per shard",
        (None,) * len(ins),
        outs,
        sub=CallPlan(body, consts),
    )


def shard_map_kwargs(params) -> dict:
    """``jax.shard_map`` keywords from the primitive's params.

    Version-dependent names: jax 0.10 calls the manual axes ``newly_manual_axes``; other
    versions ``manual_axes`` or (older) the complement ``auto``; ``check_rep`` became
    ``check_vma``.
    """
    mesh = params["mesh"]
    if "newly_manual_axes" in params:
        axes = params["newly_manual_axes"]
    elif "manual_axes" in params:
        axes = params["manual_axes"]
    elif "auto" in params:
        axes = frozenset(mesh.axis_names) - frozenset(params["auto"])
    else:
        axes = frozenset(mesh.axis_names)
    return dict(
        mesh=mesh,
        in_specs=tuple(params["in_specs"]),
        out_specs=tuple(params["out_specs"]),
        axis_names=set(axes),
        check_vma=params.get("check_vma", params.get("check_rep", True)),
    )


def run_shard_map(plan: EqnPlan, slots):
    body, dtypes = plan.sub, [s.dtype for s in slots]

    def per_shard(*arrays):
        return tuple(
            _values(run_jaxpr(body.body, const_slots(body.consts), _slots(arrays, dtypes)))
        )

    out = jax.shard_map(per_shard, **shard_map_kwargs(plan.eqn.params))(*_values(slots))
    return [Slot.of(x) for x in out]


# --------------------------------------------------------------------------- custom rules
@dataclasses.dataclass
class CustomPlan:
    body: Painting
    consts: list


def custom_call_name(eqn) -> str:
    name = eqn.params.get("name")
    if name:
        return str(name)
    jaxpr, _ = open_jaxpr(eqn.params["call_jaxpr"])
    return getattr(getattr(jaxpr, "debug_info", None), "func_name", "") or "?"


def paint_custom(eqn, ins, ctx: Ctx) -> EqnPlan:
    name = custom_call_name(eqn)
    if name not in ctx.policy.custom_calls:
        return paint.declared(
            eqn,
            ins,
            ctx,
            f"{eqn.primitive.name} '{name}': declared dtypes, "
            "custom rule kept (opt in with AutocastPolicy.custom_calls)",
        )
    jaxpr, consts = open_jaxpr(eqn.params["call_jaxpr"])
    inner = [fresh(v, ctx.groups) for v in ins]
    body = paint.paint_jaxpr(jaxpr, _const_values(consts, ctx), inner, ctx.inside(ctx.path + "/"))
    outs = tuple(fresh(v, ctx.groups) for v in body.outs)
    return EqnPlan(
        eqn,
        "custom",
        f"'{name}' opted in: body under autocast, rule at declared dtypes",
        (None,) * len(ins),
        outs,
        sub=CustomPlan(body, consts),
    )


def _cast_tree(arrays, dtypes):
    return [
        lax.convert_element_type(a, d) if paint.is_float(d) and paint.dtype_of(a) != norm(d) else a
        for a, d in zip(arrays, dtypes)
    ]


def run_custom(plan: EqnPlan, slots):
    eqn, sub = plan.eqn, plan.sub
    declared_in = [norm(v.aval.dtype) for v in eqn.invars]
    declared_out = [norm(v.aval.dtype) for v in eqn.outvars]
    dtypes = [s.dtype for s in slots]

    def original(*arrays):
        return bind(eqn, arrays)

    def body(*arrays):
        return _values(run_jaxpr(sub.body, const_slots(sub.consts), _slots(arrays, dtypes)))

    fn: Callable[..., Any]
    if eqn.primitive.name == "custom_jvp_call":
        fn = jax.custom_jvp(body)

        def jvp(primals, tangents):
            _, t_out = jax.jvp(
                original, _cast_tree(primals, declared_in), _cast_tree(tangents, declared_in)
            )
            out = fn(*primals)
            return out, _cast_tree(t_out, [paint.dtype_of(o) for o in out])

        fn.defjvp(jvp)
    else:
        vjp_fn = jax.custom_vjp(body)

        def fwd(*arrays):
            return vjp_fn(*arrays), _cast_tree(arrays, declared_in)

        def bwd(residuals, cts):
            _, pullback = jax.vjp(original, *residuals)
            grads = pullback(_cast_tree(list(cts), declared_out))
            return tuple(_cast_tree(grads, dtypes))

        vjp_fn.defvjp(fwd, bwd)
        fn = vjp_fn
    return [Slot.of(x) for x in fn(*_values(slots))]


paint.PAINTERS.update(
    {
        **dict.fromkeys(CALLS, paint_call),
        "remat2": paint_remat,
        "checkpoint": paint_remat,
        "scan": paint_scan,
        "while": paint_while,
        "cond": paint_cond,
        "shard_map": paint_shard_map,
        "custom_jvp_call": paint_custom,
        "custom_vjp_call": paint_custom,
    }
)
interpret.RUNNERS.update(
    {
        **dict.fromkeys(CALLS, run_call),
        "remat2": run_remat,
        "checkpoint": run_remat,
        "scan": run_scan,
        "while": run_while,
        "cond": run_cond,
        "shard_map": run_shard_map,
        "custom_jvp_call": run_custom,
        "custom_vjp_call": run_custom,
    }
)
