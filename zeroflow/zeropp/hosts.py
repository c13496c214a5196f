"""Which host each device of a mesh is on: the one place that decides it.

On a real multi-process mesh (and on a GPU target's abstract devices, ``zf.target_mesh(...,
hosts=2)``) a device's host is its ``process_index``. Emulated CPU devices all belong to one
process, so there the hosts are given: ``hosts=H`` splits the ``data`` axis into H equal
contiguous runs, ``(hosts, local)``, the layout ``target_mesh`` and ``jax.make_mesh`` give a
real machine (devices numbered host-major).
"""
from __future__ import annotations

import numpy as np

from zeroflow.mesh import DATA


def hosts_of(mesh, hosts: int | None = None) -> tuple[int, ...]:
    """The host of every device of ``mesh``, in ``mesh.devices.flat`` order: the order of the
    logical device ids of a program compiled for the mesh (its replica groups index it)."""
    grid = np.asarray(mesh.devices)
    if hosts is None:
        return tuple(int(d.process_index) for d in grid.flat)
    data = mesh.shape[DATA]
    if isinstance(hosts, bool) or not isinstance(hosts, int) or hosts < 1 or data % hosts:
        raise ValueError(f"hosts must be a positive int dividing data={data}, got {hosts!r}")
    axis = list(mesh.axis_names).index(DATA)
    index = np.indices(grid.shape)[axis]
    return tuple(int(i) // (data // hosts) for i in index.flat)
