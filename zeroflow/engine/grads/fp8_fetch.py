"""Weights gathered in FP8 (``ZeroPlan(quantize_weights="fp8")``) inside a rematerialised
operation of a layer scan (``gather_on_use``): each such weight is left unfetched (``Pending``)
while the operation's body is replayed, so that an FP8 matmul of ``zf.autocast`` that reads it
(``zeroflow.autocast.fp8_marks``) gathers it itself as e4m3 bytes and feeds them to its GEMM
(``zeroflow.engine.zeropp.fp8_dot``). Any other use fetches it as before (once)."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp

from zeroflow.autocast import fp8_delayed, fp8_marks
from zeroflow.engine.zeropp import fp8_dot


@dataclasses.dataclass(eq=False)
class Pending:
    """A stored weight (``(shard, stand_in)``) of ``source`` not fetched yet; ``dtype``: the
    float dtype the program casts it to before its use (None: as fetched)."""

    stored: Any
    source: Any
    dtype: Any = None
    cache: dict = dataclasses.field(default_factory=dict)
    "The fetched weight, once fetched: shared by a weight's casts."

    def fetched(self):
        """The weight fetched as ``source.fetch_for_grad`` fetches it (once), in ``dtype``."""
        if "weight" not in self.cache:
            self.cache["weight"] = self.source.fetch_for_grad(self.stored)
        weight = self.cache["weight"]
        return weight if self.dtype is None else weight.astype(self.dtype)


def cast(eqn, values) -> list | None:
    """A float cast of a ``Pending`` weight (autocast's cast of an fp32 weight to bf16 before
    its FP8 matmul): still pending, in the new dtype; None for any other equation."""
    if eqn.primitive.name != "convert_element_type" or not isinstance(values[0], Pending):
        return None
    new = jnp.dtype(eqn.params["new_dtype"])
    if not jnp.issubdtype(new, jnp.floating) or jnp.dtype(new).itemsize < 2:
        return None
    weight = values[0]
    return [Pending(weight.stored, weight.source, new, weight.cache)]


def pending(weight_only: dict, sources) -> set[int]:
    """The weights (indices into ``sources``) to leave ``Pending``: gathered in FP8 and read by
    the operation as they are (no weight-only computation of them before the operation)."""
    used = {i for v in weight_only.values() for i in v.sources}
    return {
        i
        for i in used
        if fp8_dot.fuses(sources[i])
        and all(v.direct == i for v in weight_only.values() if i in v.sources)
    }


def fetched(value):
    return value.fetched() if isinstance(value, Pending) else value


def dot(eqn, values) -> list | None:
    """``eqn``'s outputs computed by ``fp8_dot.gathered_dot`` when ``eqn`` is an FP8 matmul of
    autocast whose right operand is ``Pending`` (and nothing else is), else None."""
    spec = fp8_marks.spec_of(eqn)
    if spec is None or spec.scaling not in fp8_dot.FUSED_SCALINGS:
        return None
    if eqn.params.get("num_consts", 0) or len(values) < 2:
        return None
    lhs, rhs, *rest = values
    if not isinstance(rhs, Pending) or any(isinstance(v, Pending) for v in (lhs, *rest)):
        return None
    if spec.scaling == "delayed":
        if len(rest) != 6:
            return None
        scale_metas = [fp8_delayed.ScaleMeta(*rest[k : k + 2]) for k in (0, 2, 4)]
        meta: fp8_delayed.SiteMeta | tuple = fp8_delayed.SiteMeta(*scale_metas)
    elif rest:
        return None
    else:
        meta = ()  # current scaling: no state
    shard, stand_in = rhs.stored
    source = rhs.source if rhs.dtype is None else dataclasses.replace(rhs.source, dtype=rhs.dtype)
    return [fp8_dot.gathered_dot(lhs, shard, stand_in, meta, source, spec)]
