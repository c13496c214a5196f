"""Device meshes with the two axes zeroflow shards over: ``data`` (ZeRO + data parallel) and
``model`` (tensor parallel)."""

from __future__ import annotations

from collections.abc import Sequence

import jax
import numpy as np
from jax.sharding import AbstractMesh, AxisType, Mesh

DATA = "data"
MODEL = "model"


def make_mesh(
    data: int = -1, model: int = 1, *, devices: Sequence[jax.Device] | None = None
) -> Mesh:
    """A ``Mesh`` with axes ``("data", "model")`` over ``devices`` (default: all devices).

    ``-1`` on one axis takes the remaining devices. The product must equal the device count:
    a mesh that silently leaves devices idle is almost always a mistake.
    """
    devices = list(jax.devices() if devices is None else devices)
    n = len(devices)
    for name, size in ((DATA, data), (MODEL, model)):
        if not isinstance(size, (int, np.integer)) or (size < 1 and size != -1):
            raise ValueError(f"mesh axis {name!r} must be a positive int or -1, got {size!r}")
    if data == -1 and model == -1:
        raise ValueError("only one mesh axis may be -1")
    if data == -1 or model == -1:
        known = model if data == -1 else data
        if n % known:
            raise ValueError(
                f"mesh: {n} devices do not divide by {MODEL if data == -1 else DATA}={known}"
            )
        data, model = (n // known, model) if data == -1 else (data, n // known)
    if data * model != n:
        raise ValueError(
            f"mesh data={data} x model={model} needs {data * model} devices, but {n} are available "
            f"({jax.default_backend()}); use -1 for one axis to take the rest"
        )
    grid = np.asarray(devices, dtype=object).reshape(data, model)
    # Auto axes: shardings are propagated by the compiler (GSPMD/Shardy); zeroflow places the
    # explicit collectives itself inside shard_map where the HLO must show them.
    return Mesh(grid, (DATA, MODEL), axis_types=(AxisType.Auto, AxisType.Auto))


def planning_mesh(data: int, model: int = 1) -> AbstractMesh:
    """A device-free mesh of ``data x model`` devices, for planning and memory estimates of a
    machine this one is not (``zf.ZeroPlan(planning_mesh(64), stage=3)``): shardings and shard
    shapes work, steps cannot run on it."""
    for name, size in ((DATA, data), (MODEL, model)):
        if isinstance(size, bool) or not isinstance(size, (int, np.integer)) or size < 1:
            raise ValueError(f"mesh axis {name!r} must be a positive int, got {size!r}")
    return AbstractMesh(
        (int(data), int(model)), (DATA, MODEL), axis_types=(AxisType.Auto, AxisType.Auto)
    )
