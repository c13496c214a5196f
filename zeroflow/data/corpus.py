"""Text sources and the train/validation split, both deterministic.

A source is ``"stdlib"`` (the ``.py`` files of the running interpreter's standard library, no
``site-packages``/``dist-packages``), one text file, or a folder. A folder contributes every
regular file below it, recursively, except hidden files and folders (``.git``), ``__pycache__``,
files whose first 8 KiB hold a NUL byte (binaries), and files that are not valid UTF-8.

Files are listed sorted by their path relative to the source, and each is held out for
validation when a hash of that relative path falls below ``val_fraction``: the split depends
only on names, so it is the same on every machine and no file lands in both splits. A source
with a single file is split inside the file instead: its last ``val_fraction`` (cut at a line
break) is validation.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import sysconfig
from collections.abc import Iterator, Sequence
from pathlib import Path

STDLIB = "stdlib"
_SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__"}
_SNIFF_BYTES = 8192


@dataclasses.dataclass(frozen=True)
class SourceFile:
    name: str
    "Path relative to the source root, '/'-separated: the key of the split."
    path: Path
    size: int
    "Bytes on disk."
    limit: int = 0
    "Read only this many bytes (0 = all); set on the last file under a max_bytes cap."


@dataclasses.dataclass(frozen=True)
class Document:
    split: str
    "'train' or 'val'."
    name: str
    text: str


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def _walk(root: Path, keep_file) -> list[SourceFile]:
    found = []
    for folder, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if d not in _SKIP_DIRS and not d.startswith(".")]
        for filename in files:
            path = Path(folder, filename)
            if not filename.startswith(".") and path.is_file() and keep_file(path):
                found.append(
                    SourceFile(path.relative_to(root).as_posix(), path, path.stat().st_size)
                )
    return sorted(found, key=lambda f: f.name)


def _looks_textual(path: Path) -> bool:
    try:
        with open(path, "rb") as f:
            return b"\0" not in f.read(_SNIFF_BYTES)
    except OSError:
        return False


def list_source_files(source: str | os.PathLike) -> list[SourceFile]:
    """The files of ``source`` ('stdlib', a file or a folder), sorted by relative name."""
    if os.fspath(source) == STDLIB:
        return _walk(stdlib_root(), lambda p: p.suffix == ".py")
    path = Path(source)
    if path.is_file():
        return [SourceFile(path.name, path, path.stat().st_size)]
    if path.is_dir():
        return _walk(path, _looks_textual)
    raise FileNotFoundError(
        f"data source not found: {os.fspath(source)!r} "
        "(use 'stdlib', a text file, a folder, or a .bin token file)"
    )


def cap_files(files: Sequence[SourceFile], max_bytes: int) -> list[SourceFile]:
    """The leading files (in order) that fit in ``max_bytes``; the last one is truncated."""
    if max_bytes <= 0:
        return list(files)
    kept, total = [], 0
    for f in files:
        if total >= max_bytes:
            break
        room = max_bytes - total
        kept.append(f if f.size <= room else dataclasses.replace(f, limit=room))
        total += min(f.size, room)
    return kept


def _name_hash(name: str) -> float:
    """A stable number in [0, 1) for a file name (Python's hash() changes between runs)."""
    digest = hashlib.blake2b(name.encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2.0**64


def held_out(name: str, val_fraction: float) -> bool:
    """Whether the file ``name`` belongs to validation: a hash of the name, not of the content."""
    return _name_hash(name) < val_fraction


def split_files(
    files: Sequence[SourceFile], val_fraction: float
) -> tuple[list[SourceFile], list[SourceFile]]:
    """(train, val) by ``held_out``; with two or more files and val_fraction > 0 neither is empty.

    A lone file stays whole in train here; ``iter_documents`` splits it inside instead.
    """
    if len(files) < 2:
        return list(files), []
    val = [f for f in files if held_out(f.name, val_fraction)]
    if val_fraction > 0:
        if not val:  # a small or capped source: hold out the file that hashes lowest
            val = [min(files, key=lambda f: _name_hash(f.name))]
        elif len(val) == len(files):
            val.remove(max(val, key=lambda f: _name_hash(f.name)))
    val_names = {f.name for f in val}
    return [f for f in files if f.name not in val_names], val


def read_text(file: SourceFile) -> str | None:
    """The file's text (truncated to ``file.limit`` bytes), or None if unreadable or not UTF-8."""
    try:
        raw = file.path.read_bytes()
        text = raw.decode("utf-8")
    except (OSError, UnicodeDecodeError):
        return None
    if file.limit and file.limit < len(raw):
        text = raw[: file.limit].decode("utf-8", "ignore")  # drops a cut multi-byte character
    return text


def _why_unreadable(path: Path) -> str:
    """Why ``read_text`` gave nothing: the OS refused the file, or it is not UTF-8."""
    try:
        with open(path, "rb"):
            pass
    except OSError as e:
        return f"cannot be read ({e.strerror or e}): check its permissions (data.source)"
    return "is not readable UTF-8 text"


def _tail_split(text: str, val_fraction: float) -> tuple[str, str]:
    if val_fraction <= 0:
        return text, ""
    cut = int(len(text) * (1 - val_fraction))
    newline = text.find("\n", cut)
    cut = newline + 1 if 0 <= newline < len(text) - 1 else cut
    return text[:cut], text[cut:]


def iter_documents(
    source: str | os.PathLike,
    *,
    val_fraction: float,
    max_bytes: int = 0,
    files: Sequence[SourceFile] | None = None,
) -> Iterator[Document]:
    """Every document of ``source`` in sorted order, tagged with its split.

    Pass ``files`` (from ``list_source_files``) to skip listing the source again.
    """
    files = cap_files(files if files is not None else list_source_files(source), max_bytes)
    if len(files) == 1:
        text = read_text(files[0])
        if text is None:  # in a folder an unreadable file is skipped; alone it is the data
            raise ValueError(f"data file {files[0].path} {_why_unreadable(files[0].path)}")
        train, val = _tail_split(text, val_fraction)
        yield Document("train", files[0].name, train)
        if val:
            yield Document("val", files[0].name, val)
        return
    _, val_files = split_files(files, val_fraction)
    val_names = {f.name for f in val_files}
    for f in files:
        text = read_text(f)
        if text is not None:
            yield Document("val" if f.name in val_names else "train", f.name, text)
