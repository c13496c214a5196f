"""The interpreter: trace ``fn`` to a jaxpr, paint it, and replay it with the planned casts.

A small loop in the manner of jax's "Writing custom interpreters" notebook: an environment
from jaxpr variables to values, each equation bound with its params. Because every step binds
ordinary jax primitives, ``jax.grad`` of the interpreted function derives the backward pass
from the half-precision forward (a low ``dot_general`` transposes into low dots), and the
result composes with ``jit``, ``shard_map``, ``vmap`` and the rest.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend import core as jcore

from zeroflow.autocast import fp8, fp8_delayed, fp8_marks, lists, paint
from zeroflow.autocast.policy import AutocastPolicy
from zeroflow.util import jaxprs

RUNNERS: dict[str, Callable] = {}
"""Primitive name -> ``runner(plan, slots) -> slots`` for higher-order primitives, filled by
``higher_order.py`` (which builds on this module) when ``zeroflow.autocast`` is imported."""


class Copies:
    """One value and its casts, by dtype. A loop body sees the copies made outside the loop
    (``parent``) but keeps the casts it makes itself: they belong to the body's trace."""

    def __init__(self, array=None, *, parent: Copies | None = None, literal: bool = False):
        self.arrays: dict = {} if array is None else {paint.dtype_of(array): array}
        self.parent = parent
        self.literal = literal

    def _find(self, dtype):
        node = self
        while node is not None:
            if dtype in node.arrays:
                return node.arrays[dtype]
            node = node.parent
        return None

    def _widest(self):
        node, best = self, None
        while node is not None:
            for dtype, array in node.arrays.items():
                if best is None or dtype.itemsize > paint.dtype_of(best).itemsize:
                    best = array
            node = node.parent
        return best

    def get(self, dtype):
        dtype = paint.norm(dtype)
        found = self._find(dtype)
        if found is None:
            source = self._widest()  # cast from the most precise copy
            found = (
                literal_as(source, dtype)
                if self.literal
                else lax.convert_element_type(source, dtype)
            )
            self.arrays[dtype] = found
        return found


def literal_as(value, dtype):
    """A typed literal: finite values beyond the half range clip to its largest finite value
    (a -1e9 mask stays a large negative number in fp16 instead of becoming -inf)."""
    value = np.asarray(value)
    if jnp.issubdtype(dtype, jnp.floating) and jnp.issubdtype(value.dtype, jnp.floating):
        big = jnp.finfo(dtype).max
        value = np.where(np.isfinite(value), np.clip(value, -big, big), value)
    return np.asarray(value, dtype)


class Slot(NamedTuple):
    """A jaxpr variable's copies and the dtype the painting says it currently has."""

    copies: Copies
    dtype: Any

    @property
    def value(self):
        return self.copies.get(self.dtype)

    @classmethod
    def of(cls, array) -> Slot:
        return cls(Copies(array), paint.dtype_of(array))


def const_slots(consts) -> list[Slot]:
    return [Slot.of(c if hasattr(c, "dtype") else np.asarray(c)) for c in consts]


def run_jaxpr(painting: paint.Painting, consts: list[Slot], ins: list[Slot]) -> list[Slot]:
    """Replay ``painting`` on ``ins``; returns one ``Slot`` per jaxpr output."""
    jaxpr = painting.jaxpr
    env: dict = dict(zip(jaxpr.constvars, consts))
    env.update(zip(jaxpr.invars, ins))

    def read(atom) -> Slot:
        if isinstance(atom, jcore.Literal):
            # a Literal's aval is a ShapedArray; jax types it as the dtype-less AbstractValue
            dtype = paint.norm(atom.aval.dtype)  # type: ignore[attr-defined]
            return Slot(Copies(np.asarray(atom.val, dtype), literal=True), dtype)
        return env[atom]

    for index, plan in enumerate(painting.eqns):
        eqn = plan.eqn
        slots = [read(v) for v in eqn.invars]
        with jaxprs.source_context(eqn), eqn.ctx.manager, fp8_delayed.at(index):
            if plan.decision == "alias":
                outs = [Slot(slots[0].copies, paint.norm(plan.outs[0].dtype))]
            elif eqn.primitive.name in RUNNERS and plan.sub is not None:
                outs = RUNNERS[eqn.primitive.name](plan, slots)
            else:
                outs = _bind(plan, slots)
        for var, slot in zip(eqn.outvars, outs):
            if not isinstance(var, jcore.DropVar):
                env[var] = slot

    outs = [read(v) for v in jaxpr.outvars]
    return [
        slot if target is None else Slot(slot.copies, paint.norm(target))
        for slot, target in zip(outs, painting.out_dtypes)
    ]


def _bind(plan: paint.EqnPlan, slots: list[Slot]) -> list[Slot]:
    eqn = plan.eqn
    args = [
        slot.value if dtype is None else slot.copies.get(dtype)
        for slot, dtype in zip(slots, plan.in_dtypes)
    ]
    if plan.fp8 is not None:
        out = [_fp8_dot(args, eqn, plan)]
    else:
        out = jaxprs.bind(eqn, args, plan.params)
    result = []
    for array, value in zip(out, plan.outs):
        if paint.dtype_of(array) != paint.norm(value.dtype):  # a primitive typed its result unlike
            array = lax.convert_element_type(array, value.dtype)  # the painting: keep the plan
        result.append(Slot.of(array))
    return result


def _fp8_dot(args, eqn, plan: paint.EqnPlan):
    """The FP8 matmul of ``eqn``, bound in the name scope that marks it (``fp8_marks``)."""
    dims = fp8.as_dims(eqn.params["dimension_numbers"])
    out_dtype, scaling = plan.outs[0].dtype, plan.fp8
    assert scaling is not None  # _bind calls this for FP8 matmuls only
    sites = fp8_delayed.active() if scaling == "delayed" else None
    margin = sites.margin if sites is not None else 0
    spec = fp8_marks.DotSpec(dims, str(jnp.dtype(out_dtype)), scaling, margin)
    with jax.named_scope(fp8_marks.scope(spec)):
        if scaling != "delayed":
            return fp8.scaled_dot(*args, dims, out_dtype, scaling)
        if sites is None:
            raise ValueError(
                "fp8_scaling='delayed' needs its state: call the autocast function as "
                "f(fp8_state, *args) with fp8_state = f.init(*args)"
            )
        return fp8_delayed.scaled_dot_delayed(*args, sites.take(), dims, out_dtype, margin)


# --------------------------------------------------------------------------- the transform
def _is_traced_leaf(leaf) -> bool:
    return isinstance(leaf, (jax.Array, np.ndarray, np.generic, jax.ShapeDtypeStruct))


def trace(fn, args, kwargs):
    """``fn`` as a closed jaxpr of its array leaves; everything else (callables, None, Python
    scalars, strings) is closed over as a static value. Returns ``(closed_jaxpr, arrays,
    out_tree)``."""
    leaves, tree = jax.tree.flatten((args, kwargs))
    traced = [_is_traced_leaf(x) for x in leaves]
    arrays = [x for x, t in zip(leaves, traced) if t]
    out_tree = []

    def flat_fn(*dynamic):
        it = iter(dynamic)
        full = [next(it) if t else x for x, t in zip(leaves, traced)]
        a, k = jax.tree.unflatten(tree, full)
        out_leaves, treedef = jax.tree.flatten(fn(*a, **k))
        out_tree.append(treedef)
        return out_leaves

    closed = jax.make_jaxpr(flat_fn)(*arrays)
    return closed, arrays, out_tree[0]


def paint_closed(closed, low, policy: AutocastPolicy, fp8: bool = False) -> paint.Painting:
    groups = paint.Groups()
    ctx = paint.Ctx(low=low, policy=policy, groups=groups, fp8=fp8)
    consts = [
        paint.Value(dtype=paint.dtype_of(c), group=groups.new(paint.dtype_of(c)))
        for c in closed.consts
    ]
    ins = [
        paint.Value(dtype=paint.norm(v.aval.dtype), group=groups.new(v.aval.dtype))
        for v in closed.jaxpr.invars
    ]
    declared_out = [v.aval.dtype for v in closed.jaxpr.outvars]
    return paint.paint_jaxpr(closed.jaxpr, consts, ins, ctx, out_targets=declared_out)


def autocast(fn, dtype="bf16", policy: AutocastPolicy | None = None):
    """``fn`` with half-precision compute and no change to the model: same signature, same
    output dtypes. ``dtype="fp8"``: as bf16, with the large matmuls in FP8 (``fp8.py``). See
    ``docs/autocast.md``."""
    low, use_fp8 = lists.parse_mode(dtype)
    policy = AutocastPolicy() if policy is None else policy
    if not isinstance(policy, AutocastPolicy):
        raise ValueError(f"policy must be a zf.AutocastPolicy, got {type(policy).__name__}")
    if not callable(fn):
        raise ValueError(f"autocast needs a callable, got {type(fn).__name__}")

    def run(args, kwargs):
        closed, arrays, out_tree = trace(fn, args, kwargs)
        painting = paint_closed(closed, low, policy, use_fp8)
        outs = run_jaxpr(painting, const_slots(closed.consts), [Slot.of(a) for a in arrays])
        return jax.tree.unflatten(out_tree, [slot.value for slot in outs])

    if use_fp8 and policy.fp8_scaling == "delayed":
        return _with_fp8_state(fn, run, policy)

    @functools.wraps(fn)
    def cast_fn(*args, **kwargs):
        return run(args, kwargs)

    return cast_fn


def _with_fp8_state(fn, run, policy: AutocastPolicy):
    """Delayed FP8 scaling: ``f(fp8_state, *args, **kwargs)`` returns ``fn``'s output; the
    gradient with respect to ``fp8_state`` is the next step's state (``fp8_delayed.py``);
    ``f.init(*args, **kwargs)`` is the first step's state."""

    def sites(metas: dict, init: bool) -> fp8_delayed.Sites:
        return fp8_delayed.Sites(metas, init, policy.fp8_history, policy.fp8_margin)

    @functools.wraps(fn)
    def cast_fn(fp8_state, *args, **kwargs):
        if not fp8_delayed.is_state(fp8_state):
            raise ValueError(
                "fp8_scaling='delayed': the first argument must be the fp8 state dict from "
                f"f.init(*args), got {type(fp8_state).__name__}"
            )
        with fp8_delayed.using(sites(dict(fp8_state), init=False)):
            return run(args, kwargs)

    def init(*args, **kwargs) -> dict:
        def shapes(*a, **k):
            with fp8_delayed.using(sites({}, init=True)) as found:
                run(a, k)
            return found.metas

        return fp8_delayed.materialize(jax.eval_shape(shapes, *args, **kwargs), policy.fp8_history)

    def traced_init(*args, **kwargs):
        """``(fn's output, {site key: loops' lengths})``, run in the trace being built (a train
        step's, where ``fn`` meets the step's own gathers): what ``init`` finds, as shapes."""
        with fp8_delayed.using(sites({}, init=True)) as found:
            out = run(args, kwargs)
        return out, {key: tuple(jnp.shape(m.lhs.scale)) for key, m in found.metas.items()}

    cast_fn.init = init  # type: ignore[attr-defined]
    cast_fn.traced_init = traced_init  # type: ignore[attr-defined]
    return cast_fn
