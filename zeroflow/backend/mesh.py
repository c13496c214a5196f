"""Device meshes with the axes zeroflow shards over: ``data`` (ZeRO + data parallel),
``context`` (the sequence split, present when its size is above 1) and ``model`` (tensor
parallel).

ZeRO shards states over ``data`` x ``context``: the weights are the same on every context
device, so the devices of both axes together hold one copy between them, and gradients are
reduced over both (``zero_axes``). The batch's rows split over ``data``, its sequence over
``context``.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import numpy as np
from jax.sharding import AbstractMesh, AxisType, Mesh

DATA = "data"
CONTEXT = "context"
MODEL = "model"


def axis_names(context: int) -> tuple[str, ...]:
    """The mesh axes, outermost first: a context axis only where the sequence is split."""
    return (DATA, CONTEXT, MODEL) if context > 1 else (DATA, MODEL)


def zero_axes(mesh=None) -> str | tuple[str, str]:
    """The axis (or pair of axes) ZeRO shards states over and sums gradients over: ``data``, or
    ``("data", "context")`` where ``mesh`` has a context axis. ``mesh=None``: the mesh being
    traced (inside ``shard_map``; outside one, none, and so ``data``)."""
    mesh = jax.sharding.get_abstract_mesh() if mesh is None else mesh
    return (DATA, CONTEXT) if CONTEXT in mesh.axis_names else DATA


def zero_axis_names(mesh=None) -> tuple[str, ...]:
    """``zero_axes(mesh)`` as a tuple of axis names."""
    axes = zero_axes(mesh)
    return (axes,) if isinstance(axes, str) else axes


def _check_sizes(sizes: dict[str, int], free_allowed: bool) -> None:
    for name, size in sizes.items():
        if isinstance(size, bool) or not isinstance(size, (int, np.integer)):
            raise ValueError(f"mesh axis {name!r} must be a positive int, got {size!r}")
        if size < 1 and not (free_allowed and size == -1):
            allowed = "a positive int or -1" if free_allowed else "a positive int"
            raise ValueError(f"mesh axis {name!r} must be {allowed}, got {size!r}")


def make_mesh(
    data: int = -1,
    model: int = 1,
    *,
    context: int = 1,
    devices: Sequence[jax.Device] | None = None,
) -> Mesh:
    """A ``Mesh`` with axes ``("data", "model")``, or ``("data", "context", "model")`` when
    ``context > 1``, over ``devices`` (default: all devices).

    ``-1`` on one axis takes the remaining devices. The product must equal the device count:
    a mesh that silently leaves devices idle is almost always a mistake.
    """
    devices = list(jax.devices() if devices is None else devices)
    n = len(devices)
    sizes = {DATA: data, CONTEXT: context, MODEL: model}
    _check_sizes(sizes, free_allowed=True)
    free = [name for name, size in sizes.items() if size == -1]
    if len(free) > 1:
        raise ValueError("only one mesh axis may be -1")
    if free:
        known = int(np.prod([s for s in sizes.values() if s != -1]))
        if n % known:
            raise ValueError(
                f"mesh: {n} devices do not divide by "
                + " x ".join(f"{k}={v}" for k, v in sizes.items() if v != -1)
            )
        sizes[free[0]] = n // known
    if int(np.prod(list(sizes.values()))) != n:
        shown = " x ".join(f"{k}={v}" for k, v in sizes.items() if k != CONTEXT or v > 1)
        raise ValueError(
            f"mesh {shown} needs {int(np.prod(list(sizes.values())))} devices, but {n} are "
            f"available ({jax.default_backend()}); use -1 for one axis to take the rest"
        )
    names = axis_names(sizes[CONTEXT])
    grid = np.asarray(devices, dtype=object).reshape(tuple(sizes[a] for a in names))
    # Auto axes: shardings are propagated by the compiler (GSPMD/Shardy); zeroflow places the
    # explicit collectives itself inside shard_map where the HLO must show them.
    return Mesh(grid, names, axis_types=(AxisType.Auto,) * len(names))


def planning_mesh(data: int, model: int = 1, *, context: int = 1) -> AbstractMesh:
    """A device-free mesh of ``data x context x model`` devices, for planning and memory
    estimates of a machine this one is not (``zf.ZeroPlan(planning_mesh(64), stage=3)``):
    shardings and shard shapes work, steps cannot run on it."""
    sizes = {DATA: data, CONTEXT: context, MODEL: model}
    _check_sizes(sizes, free_allowed=False)
    names = axis_names(int(context))
    return AbstractMesh(
        tuple(int(sizes[a]) for a in names), names, axis_types=(AxisType.Auto,) * len(names)
    )
