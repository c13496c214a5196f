"""The collectives of a compiled step, read from its scheduled HLO: what each moves, whether it
runs asynchronously, and how much compute the scheduler placed between its start and its end.

XLA:GPU turns every all-gather / reduce-scatter / all-reduce into a ``*-start`` / ``*-done``
pair and, where nothing can run beside it, marks it ``"is_sync":true``. A collective overlaps
compute when a kernel (a fusion, a custom call such as a GEMM or a Triton kernel) is scheduled
between its start and its done: that is the overlap FSDP's prefetch aims for, and what
``collectives(compiled)`` counts. XLA:CPU runs collectives in line (no pairs): there every
collective is synchronous.
"""
from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Sequence

KINDS = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "collective-permute")
_COMPUTE = re.compile(r"\s(fusion|custom-call|convolution|dot|triangular-solve|cholesky|while|"
                      r"conditional)\(")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%(?P<name>[\w.\-]+)\s*=\s*(?P<type>.*?)\s"
                          r"(?P<op>[\w\-]+)\((?P<args>[^)]*)\)")
_SHAPE = re.compile(r"\b(pred|s4|u4|s8|u8|s16|u16|s32|u32|s64|u64|f8\w*|bf16|f16|f32|f64|c64|c128)"
                    r"\[([\d,]*)\]")
_BYTES = {"pred": 1, "s4": 0.5, "u4": 0.5, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "bf16": 2,
          "f16": 2, "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8,
          "c128": 16}
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

    @property
    def overlapped(self) -> bool:
        return self.asynchronous and self.compute_between > 0


def collectives(compiled) -> list[Collective]:
    """Every collective of ``compiled`` (a ``jax.stages.Compiled``, or its ``as_text()``), in
    schedule order within each computation."""
    text = compiled if isinstance(compiled, str) else compiled.as_text()
    computations = _computations(text)
    looped = _loop_bodies(computations)
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
                between = sum(1 for line in lines[j + 1:i] if _COMPUTE.search(line))
                found.append((j, Collective(kind, first, _bytes(lines[j]), not sync, between,
                                            comp in looped, comp)))
            else:  # in line (XLA:CPU, or a GPU collective left synchronous)
                found.append((i, Collective(kind, m["name"], _bytes(lines[i]), False, 0,
                                            comp in looped, comp)))
        for name, (j, kind, sync) in starts.items():  # a start without a done (not expected)
            found.append((j, Collective(kind, name, _bytes(lines[j]), False, 0, comp in looped,
                                        comp)))
    order = {c: k for k, c in enumerate(computations)}
    return [c for _, c in sorted(found, key=lambda p: (order[p[1].computation], p[0]))]


def overlap(colls: Sequence[Collective], kinds: Sequence[str] = ("all-gather", "reduce-scatter")
            ) -> dict:
    """Per kind: how many collectives, how many overlap compute, and the share, plus the
    total over ``kinds``."""
    out = {}
    for kind in kinds:
        of_kind = [c for c in colls if c.kind == kind]
        done = sum(c.overlapped for c in of_kind)
        out[kind] = {"count": len(of_kind), "overlapped": done,
                     "fraction": done / len(of_kind) if of_kind else None,
                     "bytes": sum(c.bytes for c in of_kind)}
    total = sum(out[k]["count"] for k in kinds)
    overlapped = sum(out[k]["overlapped"] for k in kinds)
    out["total"] = {"count": total, "overlapped": overlapped,
                    "fraction": overlapped / total if total else None}
    return out


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
    lhs = lhs.split("(", 1)[0] if not lhs.lstrip().startswith("(") else lhs[:lhs.find(")") + 1]
    sizes = [math.prod(int(d) for d in dims.split(",") if d) * _BYTES.get(dtype, 1)
             for dtype, dims in _SHAPE.findall(lhs)]  # f8 types: one byte
    return int(max(sizes, default=0))


def _computations(text: str) -> dict[str, list[str]]:
    comps, current = {}, None
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
    calls = {name: set(re.findall(r"(?:body|calls|to_apply|condition)=%([\w.\-]+)",
                                  "\n".join(lines))) for name, lines in computations.items()}
    bodies = {b for lines in computations.values() for line in lines
              for b in re.findall(r"\bbody=%([\w.\-]+)", line)}
    inside, todo = set(), list(bodies)
    while todo:
        name = todo.pop()
        if name in inside:
            continue
        inside.add(name)
        todo += calls.get(name, ())
    return inside
