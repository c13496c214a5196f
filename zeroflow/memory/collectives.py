"""The collectives of a compiled step, read from its scheduled HLO: what each moves, whether it
runs asynchronously, and how much compute the scheduler placed between its start and its end.

XLA:GPU turns every all-gather / reduce-scatter / all-reduce into a ``*-start`` / ``*-done``
pair and, where nothing can run beside it, marks it ``"is_sync":true``. A collective overlaps
compute when a kernel (a fusion, a custom call such as a GEMM or a Triton kernel) is scheduled
between its start and its done: that is the overlap FSDP's prefetch aims for, and what
``collectives(compiled)`` counts. XLA:CPU runs collectives in line (no pairs): there every
collective is synchronous.

Each collective also says how many bytes one device exchanges with devices of its own host and
with devices of other hosts (``within_host``, ``cross_host``), read from its replica groups
(``zeroflow.memory.replica_groups``) and the host of each logical device id
(``zeroflow.engine.hosts_of``: a compiled program's ids index its mesh's ``devices.flat``).
The count is that of a direct exchange, in which every member sends each other member the
piece that member needs: ``bytes / group`` per peer for an all-gather (the gathered result)
and an all-to-all, the output slice for a reduce-scatter, twice ``bytes / group`` for an
all-reduce (a reduce-scatter and an all-gather), the whole buffer for a collective-permute
whose target is on another host. Summed over a device's peers this is the textbook per-device
volume, ``(group - 1) / group`` of the buffer, split by where the peer is; a ring or tree
algorithm routes it differently but cannot make the data a device lacks come from nearer.
``runs`` is how often the step runs it (a while loop's known trip count, nested loops
multiplied), so ``traffic(colls)`` is per step.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Sequence
from typing import Any

from zeroflow.engine.hosts import hosts_of
from zeroflow.memory.replica_groups import groups_of, permute_pairs

KINDS = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "collective-permute")
_COMPUTE = re.compile(
    r"\s(fusion|custom-call|convolution|dot|triangular-solve|cholesky|while|"
    r"conditional)\("
)
_INSTRUCTION = re.compile(
    r"^\s*(?:ROOT\s+)?%(?P<name>[\w.\-]+)\s*=\s*(?P<type>.*?)\s"
    r"(?P<op>[\w\-]+)\((?P<args>[^)]*)\)"
)
_SHAPE = re.compile(
    r"\b(pred|s4|u4|s8|u8|s16|u16|s32|u32|s64|u64|f8\w*|bf16|f16|f32|f64|c64|c128)"
    r"\[([\d,]*)\]"
)
_BYTES = {
    "pred": 1,
    "s4": 0.5,
    "u4": 0.5,
    "s8": 1,
    "u8": 1,
    "s16": 2,
    "u16": 2,
    "bf16": 2,
    "f16": 2,
    "s32": 4,
    "u32": 4,
    "f32": 4,
    "s64": 8,
    "u64": 8,
    "f64": 8,
    "c64": 8,
    "c128": 16,
}
_HEADER = re.compile(r"^(ENTRY\s+)?%(?P<name>[\w.\-]+)\s.*\{\s*$")


@dataclasses.dataclass(frozen=True)
class Collective:
    """One collective of a compiled program."""

    kind: str
    "'all-gather', 'reduce-scatter', 'all-reduce', 'all-to-all' or 'collective-permute'."
    name: str
    "The HLO instruction (its start, when asynchronous)."
    bytes: int
    "Bytes of the largest buffer it touches per device (the gathered result, the reduced input)."
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
    computations = _computations(text)
    looped = _loop_bodies(computations)
    runs = _runs(computations, _entry(text))

    def make(kind, name, line, asynchronous, between, comp):
        within, cross = _host_bytes(kind, line, hosts)
        return Collective(
            kind,
            name,
            _bytes(line),
            asynchronous,
            between,
            comp in looped,
            comp,
            runs.get(comp, 1),
            within,
            cross,
        )

    found = []
    for comp, lines in computations.items():
        parsed = [m for m in (_INSTRUCTION.match(line) for line in lines)]
        starts = {}
        for i, m in enumerate(parsed):
            if m is None:
                continue
            op = m["op"]
            kind = _kind(op, lines[i])
            if kind is None:
                continue
            if op.endswith("-start") or op == "async-start":
                starts[m["name"]] = (i, kind, '"is_sync":true' in lines[i])
            elif op.endswith("-done") or op == "async-done":
                first = m["args"].split(",")[0].strip().lstrip("%")
                if first not in starts:
                    continue
                j, kind, sync = starts.pop(first)
                between = sum(1 for line in lines[j + 1 : i] if _COMPUTE.search(line))
                found.append((j, make(kind, first, lines[j], not sync, between, comp)))
            else:  # in line (XLA:CPU, or a GPU collective left synchronous)
                found.append((i, make(kind, m["name"], lines[i], False, 0, comp)))
        for name, (j, kind, _) in starts.items():  # a start without a done (not expected)
            found.append((j, make(kind, name, lines[j], False, 0, comp)))
    order = {c: k for k, c in enumerate(computations)}
    return [c for _, c in sorted(found, key=lambda p: (order[p[1].computation], p[0]))]


def overlap(
    colls: Sequence[Collective], kinds: Sequence[str] = ("all-gather", "reduce-scatter")
) -> dict:
    """Per kind: how many collectives, how many overlap compute, and the share, plus the
    total over ``kinds``."""
    out: dict[str, dict[str, Any]] = {}
    for kind in kinds:
        of_kind = [c for c in colls if c.kind == kind]
        done = sum(c.overlapped for c in of_kind)
        out[kind] = {
            "count": len(of_kind),
            "overlapped": done,
            "fraction": done / len(of_kind) if of_kind else None,
            "bytes": sum(c.bytes for c in of_kind),
        }
    total = sum(out[k]["count"] for k in kinds)
    overlapped = sum(out[k]["overlapped"] for k in kinds)
    out["total"] = {
        "count": total,
        "overlapped": overlapped,
        "fraction": overlapped / total if total else None,
    }
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
    total = _payload(kind, line)
    if kind == "collective-permute":
        pairs = permute_pairs(line)
        if pairs is None:
            return None, None
        within = cross = 0
        for src, dst in pairs:
            if hosts[src] != hosts[dst]:
                cross = total
            else:
                within = total
        return within, cross
    groups = groups_of(line, len(hosts))
    if groups is None:
        return None, None
    within = cross = 0
    for group in groups:
        size = len(group)
        piece = {
            "all-gather": total / size,
            "reduce-scatter": total,
            "all-reduce": 2 * total / size,
            "all-to-all": total / size,
        }[kind]
        for d in group:
            here = sum(1 for p in group if hosts[p] == hosts[d]) - 1
            within = max(within, int(piece * here))
            cross = max(cross, int(piece * (size - 1 - here)))
    return within, cross


def _payload(kind: str, line: str) -> int:
    """Bytes of the collective's results on one device (all results of a combined one): the
    gathered arrays, the reduce-scattered slices, the reduced or exchanged buffers. An
    asynchronous start returns its operands before its results (an all-reduce's start only its
    results); scalar context values are not data."""
    op = _INSTRUCTION.match(line)
    lhs = op["type"] if op else line.split("=", 1)[-1]
    arrays = [(dtype, dims) for dtype, dims in _SHAPE.findall(lhs) if dims]
    name = op["op"] if op else ""
    if (name.endswith("-start") or name == "async-start") and kind != "all-reduce":
        arrays = arrays[len(arrays) // 2 :]
    return int(
        sum(
            math.prod(int(d) for d in dims.split(",")) * _BYTES.get(dtype, 1)
            for dtype, dims in arrays
        )
    )


def _entry(text: str) -> str | None:
    for line in text.splitlines():
        header = _HEADER.match(line)
        if header and header[1]:
            return header["name"]
    return None


_TRIPS = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')


def _runs(computations: dict[str, list[str]], entry: str | None) -> dict[str, int]:
    """How many times one run of ``entry`` runs each computation: a while body its loop's known
    trip count times its caller's (1 when the count is unknown); other callees as their caller."""
    runs: dict[str, int] = {}
    todo = [(entry, 1)] if entry in computations else []
    while todo:
        name, times = todo.pop()
        if runs.get(name, 0) >= times:
            continue
        runs[name] = times
        for line in computations.get(name, ()):
            trips = _TRIPS.search(line)
            for callee in re.findall(r"\bbody=%([\w.\-]+)", line):
                todo.append((callee, times * (int(trips[1]) if trips else 1)))
            for callee in re.findall(
                r"(?:calls|to_apply|condition|branch_computations)=\{?%"
                r"([\w.\-]+)",
                line,
            ):
                todo.append((callee, times))
    return runs


def _kind(op: str, line: str) -> str | None:
    base = op.removesuffix("-start").removesuffix("-done")
    if base in KINDS:
        return base
    if op in ("async-start", "async-done"):  # a collective wrapped in an async computation
        for kind in KINDS:
            if kind in line:
                return kind
    return None


def _bytes(line: str) -> int:
    """The largest array shape on the instruction's left-hand side (its result type)."""
    lhs = line.split("=", 1)[1] if "=" in line else line
    lhs = lhs.split("(", 1)[0] if not lhs.lstrip().startswith("(") else lhs[: lhs.find(")") + 1]
    sizes = [
        math.prod(int(d) for d in dims.split(",") if d) * _BYTES.get(dtype, 1)
        for dtype, dims in _SHAPE.findall(lhs)
    ]  # f8 types: one byte
    return int(max(sizes, default=0))


def _computations(text: str) -> dict[str, list[str]]:
    comps: dict[str, list[str]] = {}
    current: str | None = None
    for line in text.splitlines():
        header = _HEADER.match(line)
        if header:
            current = header["name"]
            comps[current] = []
        elif line.startswith("}"):
            current = None
        elif current is not None:
            comps[current].append(line)
    return comps


def _loop_bodies(computations: dict[str, list[str]]) -> set[str]:
    """Computations run inside a while loop: loop bodies and everything they call."""
    calls = {
        name: set(re.findall(r"(?:body|calls|to_apply|condition)=%([\w.\-]+)", "\n".join(lines)))
        for name, lines in computations.items()
    }
    bodies = {
        b
        for lines in computations.values()
        for line in lines
        for b in re.findall(r"\bbody=%([\w.\-]+)", line)
    }
    inside, todo = set(), list(bodies)
    while todo:
        name = todo.pop()
        if name in inside:
            continue
        inside.add(name)
        todo += calls.get(name, ())
    return inside
