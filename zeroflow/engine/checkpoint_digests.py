"""A checkpoint's digests: proof that its files are the bytes that were saved.

After a checkpoint is complete, ``write_manifest(folder)`` records the size and SHA-256 of every
file under ``folder`` in ``folder/zeroflow_manifest.json`` (written aside, then renamed, so it
is either whole or absent). ``verify(folder)`` hashes the files again before they are read: a
missing file, another size or another digest (any flipped bit) raises ``DigestMismatch`` naming
the file. The manifest carries a digest of its own entries and is compared byte for byte with
its canonical form, so a flipped bit in the manifest itself is caught too.

Hashing runs at disk speed: files are read in large blocks by ``hashlib.file_digest`` (which
releases the GIL), several files at once. Checkpoints written before manifests existed have
none; ``verify`` then returns False (loaded unverified) unless the caller knows one was written.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import json
import os
import time
from pathlib import Path

MANIFEST = "zeroflow_manifest.json"
PART = f"{MANIFEST}.part-"
"A process's part of a multi-process step's manifest, merged into it by process 0."
PROCESS_NAMES = ("ocdbt.process_", "process_")
"How Orbax names what one process writes: its arrays' folder, its array metadata file."
ALGORITHM = "sha256"
FORMAT = 1


UNFINISHED = "is missing (the save did not finish)"
"The fault of a step whose save stopped before its manifest: no finished checkpoint, not damage."


class DigestMismatch(ValueError):
    """A checkpoint file that is not what was saved; ``path`` is the file, ``fault`` the words."""

    def __init__(self, path: Path, fault: str):
        super().__init__(f"{path} {fault}")
        self.path, self.fault = Path(path), fault


def _files(folder: Path) -> list[Path]:
    return sorted(
        p
        for p in folder.rglob("*")
        if p.is_file() and p.name != MANIFEST and not p.name.startswith(MANIFEST)
    )


def _digest(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, ALGORITHM).hexdigest()


MAX_THREADS = 8
"Files hashed at once by one process (at most; never more than its CPUs)."


def _digests(paths: list[Path], threads: int = MAX_THREADS) -> list[str]:
    workers = max(1, min(threads, os.cpu_count() or 1, len(paths)))
    if workers == 1:
        return [_digest(p) for p in paths]
    with concurrent.futures.ThreadPoolExecutor(workers) as pool:
        return list(pool.map(_digest, paths))


def _canonical(entries: dict) -> bytes:
    body = {"format": FORMAT, "algorithm": ALGORITHM, "files": entries}
    body["self"] = hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()
    return (json.dumps(body, sort_keys=True, indent=1) + "\n").encode()


def owner(name: str, process_count: int) -> int:
    """The process that wrote the file ``name`` (relative to the step's folder): Orbax writes
    each process's arrays under ``ocdbt.process_<i>/`` and their metadata to
    ``array_metadatas/process_<i>``; everything else is process 0's."""
    for piece in name.split("/"):
        for prefix in PROCESS_NAMES:
            index = piece[len(prefix) :] if piece.startswith(prefix) else ""
            if index.isdigit() and int(index) < process_count:
                return int(index)
    return 0


def _entries(folder: Path, process: int = 0, process_count: int = 1) -> dict:
    """Size and digest of the files under ``folder`` that ``process`` wrote."""
    files = [
        p
        for p in _files(folder)
        if owner(p.relative_to(folder).as_posix(), process_count) == process
    ]
    return {
        p.relative_to(folder).as_posix(): {"bytes": p.stat().st_size, ALGORITHM: d}
        for p, d in zip(files, _digests(files))
    }


def _write_atomically(target: Path, data: bytes) -> None:
    tmp = target.with_name(f"{target.name}.tmp-{os.getpid()}")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, target)
    _fsync_dir(target.parent)


def write_part(folder: str | os.PathLike, process: int, process_count: int) -> Path:
    """Process ``process`` (not 0) of a multi-process save records the files it wrote, in its
    part of the manifest (``zeroflow_manifest.json.part-<i>``); no process reads another's."""
    folder = Path(folder)
    target = folder / f"{PART}{process}"
    _write_atomically(target, json.dumps(_entries(folder, process, process_count)).encode())
    return target


def write_manifest(
    folder: str | os.PathLike, process_count: int = 1, wait_s: float = 600.0
) -> Path:
    """Record every file under ``folder`` (its size and digest); returns the manifest's path.
    With ``process_count > 1`` (process 0 calls it) process 0 hashes only its own files and
    takes the others' entries from their parts (``write_part``), waiting ``wait_s`` at most."""
    folder = Path(folder)
    entries = _entries(folder, 0, process_count)
    for process in range(1, process_count):
        part = folder / f"{PART}{process}"
        deadline = time.monotonic() + wait_s
        while not part.is_file():
            if time.monotonic() > deadline:
                raise DigestMismatch(part, f"was not written within {wait_s:.0f} s")
            time.sleep(0.05)
        entries.update(json.loads(part.read_text("utf-8")))
    _write_atomically(folder / MANIFEST, _canonical(entries))
    for process in range(1, process_count):
        (folder / f"{PART}{process}").unlink(missing_ok=True)
    return folder / MANIFEST


def _fsync_dir(folder: Path) -> None:
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _read_manifest(path: Path) -> dict:
    raw = path.read_bytes()
    try:
        body = json.loads(raw.decode("utf-8"))
        entries = body["files"]
        intact = isinstance(entries, dict) and _canonical(entries) == raw
    except (UnicodeDecodeError, ValueError, KeyError, TypeError, AttributeError):
        intact = False
    if not intact:
        raise DigestMismatch(path, "is damaged (it is not the manifest that was written)")
    return entries


def verify(
    folder: str | os.PathLike,
    *,
    expected: bool = False,
    process: int | None = None,
    process_count: int = 1,
    threads: int = MAX_THREADS,
) -> bool:
    """True when every file ``folder``'s manifest lists is as saved; False when there is no
    manifest and ``expected`` is False (an older checkpoint). Raises ``DigestMismatch``.
    ``process``: check only the files that process wrote (each process of a multi-process
    restore checks its own, at once; the caller combines their verdicts). ``threads``: files
    hashed at once (at most this process's CPUs)."""
    folder = Path(folder)
    manifest = folder / MANIFEST
    if not manifest.is_file():
        if expected:
            raise DigestMismatch(manifest, UNFINISHED)
        return False
    entries = _read_manifest(manifest)
    if process is not None:
        entries = {k: v for k, v in entries.items() if owner(k, process_count) == process}
    paths = []
    for name, entry in sorted(entries.items()):
        path = folder / name
        if not path.is_file():
            raise DigestMismatch(path, "is missing")
        size = path.stat().st_size
        if size != entry["bytes"]:
            raise DigestMismatch(path, f"has {size} bytes, {entry['bytes']} when it was saved")
        paths.append(path)
    for path, digest in zip(paths, _digests(paths, threads)):
        if digest != entries[path.relative_to(folder).as_posix()][ALGORITHM]:
            raise DigestMismatch(
                path, f"does not match its {ALGORITHM} digest (changed after it was saved)"
            )
    return True
