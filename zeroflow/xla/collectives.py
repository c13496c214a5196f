"""The collectives of a compiled step, read from its scheduled HLO: what each moves, whether it
runs asynchronously, and how much compute the scheduler placed between its start and its end.

XLA:GPU turns a collective into a ``*-start`` / ``*-done`` pair, marked ``"is_sync":true`` where
nothing can run beside it; it overlaps compute when a kernel (a fusion, a custom call) is
scheduled between the two. XLA:CPU runs collectives in line: there every one is synchronous.
``within_host`` / ``cross_host`` count a direct exchange over the collective's device groups
(docs/engine.md, "Bytes inside and across hosts"); ``runs`` multiplies a collective inside
loops by their trip counts, so ``traffic`` is per step. Sizes are read from HLO's types, not
from how a jax version prints them: an asynchronous start returns ``(operands, results,
context...)`` (a single operand printed alone on jax 0.10, as a tuple from 0.11 on), an
all-reduce start and an in-line collective their results.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence
from typing import Any

from zeroflow.engine.hosts import hosts_of
from zeroflow.xla import hlo
from zeroflow.xla.hlo import INSTRUCTION as _INSTRUCTION

KINDS = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "collective-permute")
_COMPUTE = re.compile(
    r"\s(fusion|custom-call|convolution|dot|triangular-solve|cholesky|while|conditional)\("
)


@dataclasses.dataclass(frozen=True)
class Collective:
    """One collective of a compiled program."""

    kind: str
    "'all-gather', 'reduce-scatter', 'all-reduce', 'all-to-all' or 'collective-permute'."
    name: str
    "The HLO instruction (its start, when asynchronous)."
    bytes: int
    "One device's copy at its largest, summed over a combined one's arrays (``_bytes``)."
    asynchronous: bool
    "A start/done pair the scheduler did not mark synchronous."
    compute_between: int
    "Kernels (fusions, custom calls) scheduled between its start and done."
    in_loop: bool
    "It sits in a while loop's body (a scan), run once per iteration."
    computation: str
    "The HLO computation it is scheduled in."
    runs: int = 1
    "How many times one step runs it (the trip counts of the loops it sits in)."
    within_host: int | None = None
    "Bytes the busiest device exchanges with other devices of its own host (None: hosts unknown)."
    cross_host: int | None = None
    "Bytes the busiest device exchanges with devices of other hosts (None: hosts unknown)."

    @property
    def overlapped(self) -> bool:
        return self.asynchronous and self.compute_between > 0


def collectives(compiled, hosts: Sequence[int] | None = None) -> list[Collective]:
    """Every collective of ``compiled`` (a ``jax.stages.Compiled``, or its ``as_text()``), in
    schedule order within each computation. ``hosts``: the host of each logical device id
    (``zeroflow.engine.hosts_of(mesh)``); by default read from the mesh of a compiled step's
    inputs (a device's ``process_index``), unknown for text."""
    text = compiled if isinstance(compiled, str) else compiled.as_text()
    if hosts is None and not isinstance(compiled, str):
        hosts = _hosts_of_inputs(compiled)
    computations = hlo.computations(text)
    looped = hlo.loop_bodies(computations)
    runs = hlo.runs(computations, hlo.entry(text))
    types = {
        comp: {m["name"]: m["type"] for m in map(_INSTRUCTION.match, lines) if m}
        for comp, lines in computations.items()
    }

    def make(kind, name, line, asynchronous, between, comp):
        size = _bytes(kind, line, types[comp])
        where = (comp in looped, comp, runs.get(comp, 1))
        return Collective(
            kind, name, size, asynchronous, between, *where, *_host_bytes(kind, line, hosts)
        )

    found = []  # (computation's position, line's position, collective)
    for k, (comp, lines) in enumerate(computations.items()):
        starts = {}
        for i, line in enumerate(lines):
            m = _INSTRUCTION.match(line)
            kind = _kind(m["op"], line) if m else None
            if m is None or kind is None:
                continue
            if m["op"].endswith("-start"):
                starts[m["name"]] = (i, kind, '"is_sync":true' in line)
            elif m["op"].endswith("-done"):
                first = m["args"].split(",")[0].strip().lstrip("%")
                if first in starts:
                    j, kind, sync = starts.pop(first)
                    between = sum(1 for x in lines[j + 1 : i] if _COMPUTE.search(x))
                    found.append((k, j, make(kind, first, lines[j], not sync, between, comp)))
            else:  # in line (XLA:CPU, or a GPU collective left synchronous)
                found.append((k, i, make(kind, m["name"], line, False, 0, comp)))
        for name, (j, kind, _) in starts.items():  # a start without a done (not expected)
            found.append((k, j, make(kind, name, lines[j], False, 0, comp)))
    return [c for _, _, c in sorted(found, key=lambda f: f[:2])]


def overlap(
    colls: Sequence[Collective], kinds: Sequence[str] = ("all-gather", "reduce-scatter")
) -> dict:
    """Per kind: how many collectives, how many overlap compute, and the share, plus the
    total over ``kinds``."""
    out: dict[str, dict[str, Any]] = {}
    for kind in (*kinds, "total"):
        chosen = [c for c in colls if (c.kind in kinds if kind == "total" else c.kind == kind)]
        done = sum(c.overlapped for c in chosen)
        out[kind] = {
            "count": len(chosen),
            "overlapped": done,
            "fraction": done / len(chosen) if chosen else None,
        }
        if kind != "total":
            out[kind]["bytes"] = sum(c.bytes for c in chosen)
    return out


def traffic(colls: Sequence[Collective], kinds: Sequence[str] = KINDS) -> dict:
    """Per kind and in total: bytes per step the busiest device exchanges inside its host and
    across hosts (each collective's bytes times its ``runs``). Collectives whose hosts are
    unknown count in neither."""
    out: dict[str, dict[str, int]] = {}
    for kind in (*kinds, "total"):
        chosen = [
            (c.runs, c.within_host, c.cross_host)
            for c in colls
            if (c.kind == kind if kind != "total" else c.kind in kinds)
            and c.within_host is not None
            and c.cross_host is not None
        ]
        out[kind] = {
            "within_host": sum(runs * within for runs, within, _ in chosen),
            "cross_host": sum(runs * cross for runs, _, cross in chosen),
            "count": sum(runs for runs, _, _ in chosen),
        }
    return out


def _hosts_of_inputs(compiled) -> tuple[int, ...] | None:
    """The hosts of the mesh a compiled step's inputs are sharded over, when they are."""
    import jax

    try:
        shardings = jax.tree.leaves(compiled.input_shardings)
    except Exception:  # not a jax Compiled
        return None
    for s in shardings:
        mesh = getattr(s, "mesh", None)
        if mesh is not None and hasattr(mesh, "devices"):
            return hosts_of(mesh)
    return None


def _host_bytes(kind: str, line: str, hosts) -> tuple[int | None, int | None]:
    """``(within, cross)`` bytes of the busiest device for one collective (see the module's
    doc); ``(None, None)`` when the hosts or the groups are unknown."""
    if hosts is None:
        return None, None
    total = hlo.size(_results(line))
    if kind == "collective-permute":
        pairs = hlo.permute_pairs(line)
        if pairs is None:
            return None, None
        same = [hosts[src] == hosts[dst] for src, dst in pairs]
        return (total if any(same) else 0), (total if not all(same) else 0)
    groups = hlo.groups_of(line, len(hosts))
    if groups is None:
        return None, None
    within = cross = 0
    for group in groups:
        size = len(group)
        piece = {"reduce-scatter": total, "all-reduce": 2 * total / size}.get(kind, total / size)
        for d in group:
            here = sum(1 for p in group if hosts[p] == hosts[d]) - 1
            within = max(within, int(piece * here))
            cross = max(cross, int(piece * (size - 1 - here)))
    return within, cross


def _kind(op: str, line: str) -> str | None:
    base = op.removesuffix("-start").removesuffix("-done")
    if base in KINDS:
        return base
    if op in ("async-start", "async-done"):  # a collective wrapped in an async computation
        return next((kind for kind in KINDS if kind in line), None)
    return None


def _bytes(kind: str, line: str, types: dict[str, str]) -> int:
    """What one device's copy of the collective holds at its largest, summed over the arrays of
    a combined one: the results (the gathered arrays of an all-gather, the reduced buffers of an
    all-reduce), except for a reduce-scatter its inputs (the whole gradients, not the slices).
    ``types``: the result type of each instruction of the computation, by name (an in-line
    reduce-scatter names its operands without their shapes)."""
    if kind != "reduce-scatter":
        return hlo.size(_results(line))
    op = _INSTRUCTION.match(line)
    if op and _is_async_start(op["op"]):
        return hlo.size(_part(hlo.type_tree(op["type"]), 0))
    args = op["args"] if op else ""
    if "[" in args:  # operands printed with their types
        return hlo.size(hlo.type_tree(args))
    names = re.findall(r"%([\w.\-]+)", args)
    if names and all(n in types for n in names):
        return hlo.size([hlo.type_tree(types[n]) for n in names])
    group = max((len(g) for g in hlo.groups_of(line, 0) or ()), default=1)
    return hlo.size(_results(line)) * max(group, 1)  # an input is its slice times the group


def _is_async_start(op: str) -> bool:
    """An asynchronous start (``all-gather-start``, ``async-start``, ...), whose result is
    ``(operands, results, context...)``; an all-reduce's start returns its results alone."""
    return (op.endswith("-start") and op != "all-reduce-start") or op == "async-start"


def _results(line: str) -> Any:
    """The result arrays of the collective on ``line``, as HLO types them: an in-line
    collective's (or an all-reduce start's) whole result, an asynchronous start's second part.
    Read from the type tree, so that an operand printed alone (``(bf16[64,512], ...)``) or as a
    tuple (``((bf16[64,512]), ...)``, jax 0.11 on) reads the same."""
    op = _INSTRUCTION.match(line)
    if op is None:
        return []
    tree = hlo.type_tree(op["type"])
    return _part(tree, 1) if _is_async_start(op["op"]) else tree


def _part(tree: Any, index: int) -> Any:
    """Element ``index`` of a tuple type; the whole type when it is not a tuple of that many."""
    return tree[index] if isinstance(tree, list) and len(tree) > index else tree
