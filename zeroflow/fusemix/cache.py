"""The latent cache: a frozen encoder's outputs for a whole dataset, computed once and kept on
disk, so that training never runs the encoder.

One folder per encoder: ``latents.npy`` (a numpy memmap, float32 [rows, dim]) and
``cache.json``, which records what made the latents (the encoder's architecture and the
SHA-256 of its config.json and weights, the preprocessing, the pooling, the compute dtype, the
dataset and its digest) and how many rows are written. Encoding is batched, sharded over the
devices, shown with a rich progress bar, and resumable: an interrupted build continues from
the last row it recorded. A cache made by anything else is refused with one line naming the
first field that differs, never read as if it were this run's.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

LATENTS, META = "latents.npy", "cache.json"
ROWS_DONE = "rows_done"


class StaleCache(ValueError):
    """A cache folder made by another encoder, preprocessing or dataset (one line)."""


def _first_difference(old: Mapping[str, Any], new: Mapping[str, Any], prefix: str = ""):
    for key in sorted(set(old) | set(new)):
        a, b = old.get(key), new.get(key)
        if isinstance(a, Mapping) and isinstance(b, Mapping):
            found = _first_difference(a, b, f"{prefix}{key}.")
            if found:
                return found
        elif a != b:
            return f"{prefix}{key}", a, b
    return None


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 24 else text[:20] + "..."


def check_identity(folder: Path, recorded: Mapping[str, Any], identity: Mapping[str, Any]) -> None:
    """StaleCache naming the first field of ``identity`` that ``recorded`` disagrees with."""
    diff = _first_difference(recorded, identity)
    if diff is not None:
        key, was, now = diff
        raise StaleCache(
            f"{folder}: latent cache made with {key}={_short(was)}, this run needs "
            f"{key}={_short(now)}; delete the folder to encode again, or give "
            "another fusemix.cache"
        )


def _write_meta(folder: Path, meta: Mapping[str, Any]) -> None:
    tmp = folder / (META + ".tmp")
    tmp.write_text(json.dumps(meta, indent=1, sort_keys=True))
    os.replace(tmp, folder / META)


def open_cache(folder: str | os.PathLike, identity: Mapping[str, Any], rows: int, dim: int):
    """``(latents memmap, rows already written)``: the folder's cache, checked against
    ``identity``, or a new empty one."""
    folder = Path(folder)
    meta_file = folder / META
    if meta_file.is_file():
        meta = json.loads(meta_file.read_text())
        check_identity(folder, meta["identity"], identity)
        latents = np.load(folder / LATENTS, mmap_mode="r+")
        if latents.shape != (rows, dim):
            raise StaleCache(
                f"{folder}: {LATENTS} has shape {latents.shape}, expected "
                f"{(rows, dim)}; delete the folder to encode again"
            )
        return latents, int(meta[ROWS_DONE])
    folder.mkdir(parents=True, exist_ok=True)
    latents = np.lib.format.open_memmap(
        folder / LATENTS, mode="w+", dtype=np.float32, shape=(rows, dim)
    )
    _write_meta(folder, {"identity": dict(identity), ROWS_DONE: 0})
    return latents, 0


def encode_to_cache(
    folder: str | os.PathLike,
    identity: Mapping[str, Any],
    encode: Callable[[Any, dict[str, jax.Array]], jax.Array],
    params: Any,
    inputs: Mapping[str, np.ndarray],
    dim: int,
    *,
    batch_size: int,
    mesh: jax.sharding.Mesh,
    label: str = "latents",
    progress: bool = True,
    stop_after: int | None = None,
) -> np.ndarray:
    """Encode every row of ``inputs`` (arrays sharing a leading axis) with ``encode`` (a
        jittable function of the params and one batch dict -> [batch, dim]) into ``folder``; returns the latents
        read-only. ``encode(params, batch)`` is jitted once (the encoder's weights are an argument,
    not constants of the program). Batches are split over the mesh's devices (``batch_size`` is rounded up to a
        multiple of them); the last one is padded, so one program serves every batch.
        ``stop_after``: encode at most that many batches, then return (an interrupted build)."""
    rows = len(next(iter(inputs.values())))
    latents, done = open_cache(folder, identity, rows, dim)
    sharding = NamedSharding(mesh, P(mesh.axis_names))
    batch_size = -(-batch_size // mesh.size) * mesh.size
    step = jax.jit(encode, out_shardings=NamedSharding(mesh, P()))
    columns = [
        TextColumn(f"encoding {label}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeRemainingColumn(),
    ]
    with Progress(*columns, disable=not progress, transient=True) as bar:
        task = bar.add_task(label, total=rows, completed=done)
        for count, start in enumerate(range(done, rows, batch_size)):
            if stop_after is not None and count >= stop_after:
                break
            stop = min(start + batch_size, rows)
            batch = {k: _padded(v[start:stop], batch_size) for k, v in inputs.items()}
            out = step(params, jax.device_put(batch, sharding))
            latents[start:stop] = np.asarray(out, np.float32)[: stop - start]
            latents.flush()  # the rows first, then the record that they are there
            _write_meta(Path(folder), {"identity": dict(identity), ROWS_DONE: stop})
            bar.update(task, completed=stop)
    return np.load(Path(folder) / LATENTS, mmap_mode="r")


def _padded(rows: np.ndarray, size: int) -> np.ndarray:
    if len(rows) == size:
        return rows
    pad = np.zeros((size - len(rows), *rows.shape[1:]), rows.dtype)
    return np.concatenate([rows, pad])


def rows_done(folder: str | os.PathLike) -> int:
    return int(json.loads((Path(folder) / META).read_text())[ROWS_DONE])
