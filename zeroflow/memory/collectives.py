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

Sizes are read from the HLO types of the instructions, per HLO's semantics, not from how a jax
version prints them: an asynchronous start (``all-gather-start``, ``reduce-scatter-start``,
``async-start``) returns ``(operands, results, context...)``, whose operand part prints as one
array for a single operand on jax 0.10 and as a tuple from 0.11 on; an all-reduce start returns
its results alone; an in-line collective returns its results, and an in-line reduce-scatter's
inputs are the types of the operands it names.
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
_HEADER = re.compile(r"^(ENTRY\s+)?%(?P<name>[\w.\-]+)\s.*\{\s*$")


@dataclasses.dataclass(frozen=True)
class Collective:
    """One collective of a compiled program."""

    kind: str
    "'all-gather', 'reduce-scatter', 'all-reduce', 'all-to-all' or 'collective-permute'."
    name: str
    "The HLO instruction (its start, when asynchronous)."
    bytes: int
    """Bytes of one device's copy at its largest, summed over the arrays of a combined one: an
    all-gather's gathered results, a reduce-scatter's inputs (the whole buffers before the
    scatter), an all-reduce's, all-to-all's or collective-permute's buffers. Read from HLO's
    types, the same on every jax: an asynchronous start's result is ``(operands, results)``."""
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
    types = {comp: _result_types(lines) for comp, lines in computations.items()}

    def make(kind, name, line, asynchronous, between, comp):
        within, cross = _host_bytes(kind, line, hosts)
        return Collective(
            kind,
            name,
            _bytes(kind, line, types[comp]),
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
    gathered arrays, the reduce-scattered slices, the reduced or exchanged buffers."""
    return _size(_results(line))


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


def _bytes(kind: str, line: str, types: dict[str, str]) -> int:
    """What one device's copy of the collective holds at its largest, summed over the arrays of
    a combined one: the results (the gathered arrays of an all-gather, the reduced buffers of an
    all-reduce), except for a reduce-scatter its inputs (the whole gradients, not the slices).
    ``types``: the result type of each instruction of the computation, by name (an in-line
    reduce-scatter names its operands without their shapes)."""
    if kind != "reduce-scatter":
        return _size(_results(line))
    op = _INSTRUCTION.match(line)
    if op and _is_async_start(op["op"]):
        return _size(_part(_type_tree(op["type"]), 0))
    args = op["args"] if op else ""
    if "[" in args:  # operands printed with their types
        return _size(_type_tree(args))
    names = re.findall(r"%([\w.\-]+)", args)
    if names and all(n in types for n in names):
        return _size([_type_tree(types[n]) for n in names])
    group = max((len(g) for g in groups_of(line, 0) or ()), default=1)
    return _size(_results(line)) * max(group, 1)  # an input is its slice times the group


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
    tree = _type_tree(op["type"])
    return _part(tree, 1) if _is_async_start(op["op"]) else tree


def _part(tree: Any, index: int) -> Any:
    """Element ``index`` of a tuple type; the whole type when it is not a tuple of that many."""
    return tree[index] if isinstance(tree, list) and len(tree) > index else tree


_COMMENT = re.compile(r"/\*.*?\*/")
_TYPE_TOKEN = re.compile(
    r"(?P<open>\()|(?P<close>\))|(?P<dtype>[a-z][a-z0-9]*)\[(?P<dims>[^\]]*)\](?:\{[^}]*\})?"
)


def _type_tree(text: str) -> Any:
    """An HLO type as a tree: ``(dtype, dims)`` for an array, a list for a tuple. Layouts
    (``{1,0:T(8,128)}``) and index comments (``/*index=5*/``) are skipped."""
    stack: list[list] = [[]]
    for m in _TYPE_TOKEN.finditer(_COMMENT.sub("", text)):
        if m["open"]:
            stack.append([])
        elif m["close"]:
            if len(stack) > 1:
                done = stack.pop()
                stack[-1].append(done)
        else:  # dynamic dims print as <=n: their bound
            stack[-1].append((m["dtype"], tuple(int(d) for d in re.findall(r"\d+", m["dims"]))))
    while len(stack) > 1:  # an unclosed tuple (a cut line)
        done = stack.pop()
        stack[-1].append(done)
    top = stack[0]
    return top[0] if len(top) == 1 else top


def _size(tree: Any) -> int:
    """Bytes of every array in a type tree (f8 one byte, s4 half a byte, token none)."""
    if isinstance(tree, list):
        return sum(_size(t) for t in tree)
    dtype, dims = tree
    bits = 8 if dtype == "pred" else int(m[1]) if (m := re.match(r"[a-z]+(\d+)", dtype)) else 0
    return int(math.prod(dims) * bits // 8)


def _result_types(lines: Sequence[str]) -> dict[str, str]:
    """The result type of each instruction of a computation, by name."""
    return {m["name"]: m["type"] for m in map(_INSTRUCTION.match, lines) if m}


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
