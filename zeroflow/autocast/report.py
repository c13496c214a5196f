"""``zf.autocast_report``: every decision the painting made, and why."""

from __future__ import annotations

import collections
import dataclasses

from jax.extend import core as jcore

from zeroflow.autocast import higher_order, lists, paint
from zeroflow.autocast.interpret import paint_closed, trace
from zeroflow.autocast.policy import AutocastPolicy


@dataclasses.dataclass(frozen=True)
class Decision:
    path: str
    "Where the equation sits: ``scan#12/body/dot_general#3``."
    primitive: str
    scope: str
    "Its name scope (Flax module path / ``jax.named_scope``)."
    inputs: str
    "Declared input types, with ``->dtype`` where autocast casts an input."
    outputs: str
    decision: str
    "low, fp32, neutral, declared (as written), alias (the program's own cast), or a structure."
    reason: str


@dataclasses.dataclass(frozen=True)
class AutocastReport:
    dtype: str
    decisions: tuple

    def counts(self) -> dict[str, int]:
        return dict(collections.Counter(d.decision for d in self.decisions))

    def find(self, primitive: str) -> list[Decision]:
        return [d for d in self.decisions if d.primitive == primitive]

    def __str__(self) -> str:
        head = ("path", "op", "inputs", "outputs", "decision", "reason")
        rows = [head] + [
            (d.path, d.primitive, d.inputs, d.outputs, d.decision, d.reason) for d in self.decisions
        ]
        widths = [min(max(len(r[k]) for r in rows), 48) for k in range(len(head) - 1)]
        lines = [
            f"autocast {self.dtype}: {len(self.decisions)} decisions "
            + ", ".join(f"{n} {k}" for k, n in sorted(self.counts().items()))
        ]
        for r in rows:
            lines.append("  ".join(c[:w].ljust(w) for c, w in zip(r, widths)) + "  " + r[-1])
        return "\n".join(lines)


_SHORT = {"float32": "f32", "bfloat16": "bf16", "float16": "f16", "float64": "f64", "int32": "i32"}


def _short(dtype) -> str:
    name = getattr(paint.norm(dtype), "name", str(dtype))
    return _SHORT.get(name, name)


def _type(aval, dtype=None) -> str:
    return f"{_short(aval.dtype if dtype is None else dtype)}[{','.join(map(str, aval.shape))}]"


def _rows(painting: paint.Painting, out: list) -> None:
    for plan in painting.eqns:
        eqn = plan.eqn
        ins = []
        for var, value, cast in zip(eqn.invars, plan.in_values, plan.in_dtypes):
            text = _type(var.aval, value.dtype) + ("" if cast is None else f"->{_short(cast)}")
            ins.append(("lit " if isinstance(var, jcore.Literal) else "") + text)
        outs = [_type(v.aval, val.dtype) for v, val in zip(eqn.outvars, plan.outs)]
        out.append(
            Decision(
                plan.path,
                eqn.primitive.name,
                plan.scope,
                " ".join(ins),
                " ".join(outs),
                plan.decision,
                plan.reason,
            )
        )
        for sub in _sub_paintings(plan.sub):
            _rows(sub, out)


def _sub_paintings(sub) -> list:
    if sub is None:
        return []
    if isinstance(sub, higher_order.LoopPlan):
        return [sub.body] + ([sub.cond] if sub.cond is not None else [])
    if isinstance(sub, higher_order.CondPlan):
        return list(sub.branches)
    return [sub.body]


def autocast_report(
    fn, *args, dtype="bf16", policy: AutocastPolicy | None = None, **kwargs
) -> AutocastReport:
    """What ``zf.autocast(fn, dtype, policy)`` would do on these arguments (arrays or
    ``jax.ShapeDtypeStruct``s; nothing is computed). ``print()`` it for a table."""
    low, use_fp8 = lists.parse_mode(dtype)
    policy = AutocastPolicy() if policy is None else policy
    closed, _, _ = trace(fn, args, kwargs)
    rows: list = []
    _rows(paint_closed(closed, low, policy, use_fp8), rows)
    return AutocastReport(dtype=lists.FP8 if use_fp8 else low.name, decisions=tuple(rows))
