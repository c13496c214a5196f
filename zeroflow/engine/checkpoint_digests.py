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
from pathlib import Path

MANIFEST = "zeroflow_manifest.json"
ALGORITHM = "sha256"
FORMAT = 1


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


def _digests(paths: list[Path]) -> list[str]:
    workers = max(1, min(8, os.cpu_count() or 1, len(paths)))
    if workers == 1:
        return [_digest(p) for p in paths]
    with concurrent.futures.ThreadPoolExecutor(workers) as pool:
        return list(pool.map(_digest, paths))


def _canonical(entries: dict) -> bytes:
    body = {"format": FORMAT, "algorithm": ALGORITHM, "files": entries}
    body["self"] = hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()
    return (json.dumps(body, sort_keys=True, indent=1) + "\n").encode()


def write_manifest(folder: str | os.PathLike) -> Path:
    """Record every file under ``folder`` (its size and digest); returns the manifest's path."""
    folder = Path(folder)
    files = _files(folder)
    entries = {
        p.relative_to(folder).as_posix(): {"bytes": p.stat().st_size, ALGORITHM: d}
        for p, d in zip(files, _digests(files))
    }
    target = folder / MANIFEST
    tmp = folder / f"{MANIFEST}.tmp-{os.getpid()}"
    with open(tmp, "wb") as f:
        f.write(_canonical(entries))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, target)
    _fsync_dir(folder)
    return target


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


def verify(folder: str | os.PathLike, *, expected: bool = False) -> bool:
    """True when every file ``folder``'s manifest lists is as saved; False when there is no
    manifest and ``expected`` is False (an older checkpoint). Raises ``DigestMismatch``."""
    folder = Path(folder)
    manifest = folder / MANIFEST
    if not manifest.is_file():
        if expected:
            raise DigestMismatch(manifest, "is missing (the save did not finish)")
        return False
    entries = _read_manifest(manifest)
    paths = []
    for name, entry in sorted(entries.items()):
        path = folder / name
        if not path.is_file():
            raise DigestMismatch(path, "is missing")
        size = path.stat().st_size
        if size != entry["bytes"]:
            raise DigestMismatch(path, f"has {size} bytes, {entry['bytes']} when it was saved")
        paths.append(path)
    for path, digest in zip(paths, _digests(paths)):
        if digest != entries[path.relative_to(folder).as_posix()][ALGORITHM]:
            raise DigestMismatch(
                path, f"does not match its {ALGORITHM} digest (changed after it was saved)"
            )
    return True
