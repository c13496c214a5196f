"""Reading a compiled module's HLO text (``compiled.as_text()``): its computations, how often one
step runs each, the types and sizes of its instructions, and a collective's device groups.

Device groups come in three forms: explicit (``replica_groups={{0,1},{2,3}}``; ``{}`` is one
group of every device), iota (``replica_groups=[2,8]<=[16]``, or ``[2,8]<=[8,2]T(1,0)``: the ids
0..n-1 laid out as the second shape, transposed, read as the first), and mesh axes
(``replica_groups=mesh['axis_0'=4,'axis_1'=2] {'axis_0'}``: the ids laid out as the mesh, one
group per position of the axes not listed). A collective-permute names
``source_target_pairs={{0,1},{1,2}}`` instead.
"""

from __future__ import annotations

import math
import re
from typing import Any

import numpy as np

INSTRUCTION = re.compile(
    r"^\s*(?:ROOT\s+)?%(?P<name>[\w.\-]+)\s*=\s*(?P<type>.*?)\s"
    r"(?P<op>[\w\-]+)\((?P<args>[^)]*)\)"
)
_HEADER = re.compile(r"^(ENTRY\s+)?%(?P<name>[\w.\-]+)\s.*\{\s*$")
_TRIPS = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')
_CALLEES = re.compile(r"(?:calls|to_apply|condition|branch_computations)=\{?%([\w.\-]+)")
_BODY = re.compile(r"\bbody=%([\w.\-]+)")


def computations(text: str) -> dict[str, list[str]]:
    """``{computation name: its instruction lines}`` of a module's text."""
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


def entry(text: str) -> str | None:
    """The name of the module's entry computation."""
    for line in text.splitlines():
        header = _HEADER.match(line)
        if header and header[1]:
            return header["name"]
    return None


def runs(comps: dict[str, list[str]], entry: str | None) -> dict[str, int]:
    """How many times one run of ``entry`` runs each computation: a while body its loop's known
    trip count times its caller's (1 when the count is unknown); other callees as their caller."""
    out: dict[str, int] = {}
    todo = [(entry, 1)] if entry in comps else []
    while todo:
        name, times = todo.pop()
        if out.get(name, 0) >= times:
            continue
        out[name] = times
        for line in comps.get(name, ()):
            trips = _TRIPS.search(line)
            todo += [
                (body, times * (int(trips[1]) if trips else 1)) for body in _BODY.findall(line)
            ]
            todo += [(callee, times) for callee in _CALLEES.findall(line)]
    return out


def loop_bodies(comps: dict[str, list[str]]) -> set[str]:
    """Computations run inside a while loop: loop bodies and everything they call."""
    inside: set[str] = set()
    todo = [b for lines in comps.values() for line in lines for b in _BODY.findall(line)]
    while todo:
        name = todo.pop()
        if name not in inside:
            inside.add(name)
            for line in comps.get(name, ()):
                todo += _BODY.findall(line) + _CALLEES.findall(line)
    return inside


_COMMENT = re.compile(r"/\*.*?\*/")
_TYPE_TOKEN = re.compile(
    r"(?P<open>\()|(?P<close>\))|(?P<dtype>[a-z][a-z0-9]*)\[(?P<dims>[^\]]*)\](?:\{[^}]*\})?"
)


def type_tree(text: str) -> Any:
    """An HLO type as a tree: ``(dtype, dims)`` for an array, a list for a tuple. Layouts
    (``{1,0:T(8,128)}``) and index comments (``/*index=5*/``) are skipped."""
    stack: list[list] = [[]]
    for m in _TYPE_TOKEN.finditer(_COMMENT.sub("", text)):
        if m["open"]:
            stack.append([])
        elif m["close"] and len(stack) > 1:
            stack[-2].append(stack.pop())
        elif m["dtype"]:  # dynamic dims print as <=n: their bound
            stack[-1].append((m["dtype"], tuple(int(d) for d in re.findall(r"\d+", m["dims"]))))
    while len(stack) > 1:  # an unclosed tuple (a cut line)
        stack[-2].append(stack.pop())
    top = stack[0]
    return top[0] if len(top) == 1 else top


def size(tree: Any) -> int:
    """Bytes of every array in a type tree (f8 one byte, s4 half a byte, token none)."""
    if isinstance(tree, list):
        return sum(size(t) for t in tree)
    dtype, dims = tree
    bits = 8 if dtype == "pred" else int(m[1]) if (m := re.match(r"[a-z]+(\d+)", dtype)) else 0
    return int(math.prod(dims) * bits // 8)


_EXPLICIT = re.compile(r"replica_groups=\{((?:\{[\d,\s]*\},?\s*)*)\}")
_IOTA = re.compile(r"replica_groups=\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?")
_MESH = re.compile(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}")
_PAIRS = re.compile(r"source_target_pairs=\{((?:\{\d+,\d+\},?)*)\}")


def _ints(text: str) -> list[int]:
    return [int(d) for d in re.findall(r"\d+", text)]


def groups_of(line: str, num_devices: int) -> list[list[int]] | None:
    """The device groups of the collective on ``line`` (None when it names none this reads)."""
    explicit = _EXPLICIT.search(line)
    if explicit:
        groups = [_ints(g) for g in re.findall(r"\{([\d,\s]*)\}", explicit[1])]
        return groups or [list(range(num_devices))]
    iota = _IOTA.search(line)
    if iota:
        ids = np.arange(math.prod(_ints(iota[2]))).reshape(_ints(iota[2]))
        if iota[3]:
            ids = ids.transpose(_ints(iota[3]))
        return ids.reshape(_ints(iota[1])).tolist()
    mesh = _MESH.search(line)
    if mesh:
        axes = re.findall(r"'([^']+)'=(\d+)", mesh[1])
        names, sizes = [a for a, _ in axes], [int(s) for _, s in axes]
        grouped = re.findall(r"'([^']+)'", mesh[2])
        if not axes or any(g not in names for g in grouped):
            return None  # sub-axes ('axis_0':(1)2) are not read
        return mesh_axis_groups(names, sizes, grouped)
    return None


def mesh_axis_groups(names: list[str], sizes: list[int], grouped: list[str]) -> list[list[int]]:
    """The device groups of a collective over the mesh axes ``grouped`` of a mesh with axes
    ``names`` of ``sizes``: every device along those axes, the others fixed, devices numbered
    row-major over the mesh."""
    ids = np.arange(math.prod(sizes)).reshape(sizes)
    rest = [k for k, a in enumerate(names) if a not in grouped]
    ids = ids.transpose(rest + [names.index(g) for g in grouped])
    return ids.reshape(-1, math.prod(sizes[names.index(g)] for g in grouped)).tolist()


def permute_pairs(line: str) -> list[tuple[int, int]] | None:
    """The ``(source, target)`` pairs of a collective-permute on ``line``."""
    pairs = _PAIRS.search(line)
    if not pairs:
        return None
    return [(int(a), int(b)) for a, b in re.findall(r"\{(\d+),(\d+)\}", pairs[1])]
