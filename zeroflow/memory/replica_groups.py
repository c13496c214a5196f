"""The device groups of a collective in HLO text, as lists of logical device ids.

XLA prints them in three forms: explicit (``replica_groups={{0,1},{2,3}}``; ``{}`` is one group
of every device), iota (``replica_groups=[2,8]<=[16]``, or ``[2,8]<=[8,2]T(1,0)``: the ids
0..n-1 laid out as the second shape, transposed, read as the first), and mesh axes
(``replica_groups=mesh['axis_0'=4,'axis_1'=2] {'axis_0'}``: the ids laid out as the mesh, one
group per position of the axes not listed). A collective-permute names
``source_target_pairs={{0,1},{1,2}}`` instead.
"""

from __future__ import annotations

import re

import numpy as np

_EXPLICIT = re.compile(r"replica_groups=\{((?:\{[\d,\s]*\},?\s*)*)\}")
_IOTA = re.compile(r"replica_groups=\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?")
_MESH = re.compile(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}")
_PAIRS = re.compile(r"source_target_pairs=\{((?:\{\d+,\d+\},?)*)\}")


def groups_of(line: str, num_devices: int) -> list[list[int]] | None:
    """The groups of the collective on ``line`` (None when it names none this reads)."""
    explicit = _EXPLICIT.search(line)
    if explicit:
        groups = [
            [int(i) for i in g.split(",") if i.strip()]
            for g in re.findall(r"\{([\d,\s]*)\}", explicit[1])
        ]
        return groups or [list(range(num_devices))]
    iota = _IOTA.search(line)
    if iota:
        shape = [int(d) for d in iota[1].split(",")]
        ids = np.arange(int(np.prod([int(d) for d in iota[2].split(",")]))).reshape(
            [int(d) for d in iota[2].split(",")]
        )
        if iota[3]:
            ids = ids.transpose([int(p) for p in iota[3].split(",")])
        return ids.reshape(shape).tolist()
    mesh = _MESH.search(line)
    if mesh:
        axes = re.findall(r"'([^']+)'=(\d+)", mesh[1])
        if not axes:
            return None
        names, sizes = [a for a, _ in axes], [int(s) for _, s in axes]
        grouped = re.findall(r"'([^']+)'", mesh[2])
        if any(g not in names for g in grouped):
            return None  # sub-axes ('axis_0':(1)2) are not read
        ids = np.arange(int(np.prod(sizes))).reshape(sizes)
        rest = [k for k, a in enumerate(names) if a not in grouped]
        ids = ids.transpose(rest + [names.index(g) for g in grouped])
        return ids.reshape(-1, int(np.prod([sizes[names.index(g)] for g in grouped]))).tolist()
    return None


def permute_pairs(line: str) -> list[tuple[int, int]] | None:
    """The ``(source, target)`` pairs of a collective-permute on ``line``."""
    pairs = _PAIRS.search(line)
    if not pairs:
        return None
    return [(int(a), int(b)) for a, b in re.findall(r"\{(\d+),(\d+)\}", pairs[1])]
