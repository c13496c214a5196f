"""Which host each device of a mesh is on: the one place that decides it.

On a real multi-process mesh (and on a GPU target's abstract devices, ``zf.target_mesh(...,
hosts=2)``) a device's host is its ``process_index``. Emulated CPU devices all belong to one
process, so there the hosts are given: ``hosts=H`` splits the ``data`` axis into H equal
contiguous runs, ``(hosts, local)``, the layout ``target_mesh`` and ``jax.make_mesh`` give a
real machine (devices numbered host-major).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from zeroflow.backend.mesh import DATA, zero_axis_names


def hosts_of(mesh, hosts: int | None = None) -> tuple[int, ...]:
    """The host of every device of ``mesh``, in ``mesh.devices.flat`` order: the order of the
    logical device ids of a program compiled for the mesh (its replica groups index it)."""
    if hosts is None:
        return tuple(int(d.process_index) for d in np.asarray(mesh.devices).flat)
    data = mesh.shape[DATA]
    if isinstance(hosts, bool) or not isinstance(hosts, int) or hosts < 1 or data % hosts:
        raise ValueError(f"hosts must be a positive int dividing data={data}, got {hosts!r}")
    axis = list(mesh.axis_names).index(DATA)
    index = np.indices(tuple(mesh.shape[a] for a in mesh.axis_names))[axis]
    return tuple(int(i) // (data // hosts) for i in index.flat)


class HostSplit(NamedTuple):
    """The ``data`` axis as ``hosts`` runs of ``local`` consecutive indices, one run per host
    (data index ``d`` is on host ``d // local``). The groups are ``axis_index_groups`` of the
    ``data`` axis, as tuples so that they can be static arguments of jitted collectives."""

    hosts: int
    local: int

    @property
    def within(self) -> tuple[tuple[int, ...], ...]:
        """One group per host: its ``local`` data indices, in order."""
        return tuple(
            tuple(h * self.local + i for i in range(self.local)) for h in range(self.hosts)
        )

    @property
    def across(self) -> tuple[tuple[int, ...], ...]:
        """One group per local index: the devices at that place on every host, host by host."""
        return tuple(
            tuple(h * self.local + i for h in range(self.hosts)) for i in range(self.local)
        )


def index_groups(groups):
    """``groups`` (tuples of ``data`` indices, hashable for static arguments, or None: every
    device) as the ``axis_index_groups`` jax's collectives take."""
    return None if groups is None else [list(g) for g in groups]


def host_split(mesh, hosts: int | None = None) -> HostSplit:
    """How the ``data`` axis of ``mesh`` runs over hosts (``hosts_of``); a ValueError when a
    host's devices are not one run of equally many consecutive ``data`` indices (every device
    of a ``data`` index on that host), the layout the within-host groups of ZeRO++ rest on."""
    grid = np.asarray(hosts_of(mesh, hosts)).reshape(tuple(mesh.shape[a] for a in mesh.axis_names))
    # With a context axis the index is that of the (data, context) pair, data-major, as
    # collectives over both axes number the devices.
    axes = zero_axis_names(mesh)
    positions = [list(mesh.axis_names).index(a) for a in axes]
    size = int(np.prod([mesh.shape[a] for a in axes]))
    by_index = np.moveaxis(grid, positions, range(len(axes))).reshape(size, -1)
    if (by_index != by_index[:, :1]).any():
        raise ValueError(
            "a data index's devices span several hosts; ZeRO++ needs every host to "
            "hold whole rows of the model axis"
        )
    order = by_index[:, 0]
    count = len(np.unique(order))
    local = len(order) // count
    if (
        len(order) % count
        or (order != np.repeat(order[::local], local)).any()
        or len(set(order[::local])) != count
    ):
        raise ValueError(
            f"hosts of the data axis {order.tolist()} are not {count} equal runs of "
            f"consecutive indices; build the mesh host-major (zf.make_mesh)"
        )
    return HostSplit(count, local)
