"""Records: one training example per JSON object, read from local files.

A source is a ``.jsonl`` / ``.json`` / ``.parquet`` file, a folder of them (read recursively,
sorted by relative path), or a dataset written by Hugging Face ``datasets``' ``save_to_disk``
(Arrow files, memory-mapped by ``datasets.load_from_disk``; a ``DatasetDict`` contributes its
``train`` split). Parquet files are read in batches with ``pyarrow``.

JSON is parsed record by record with the standard ``json`` module rather than by Arrow's
reader: Arrow infers one schema for the whole file and rejects the file when one record
has a field of another type, where we want to count that record as bad and go on.

Every record comes with where it was found (``file line N`` / ``file record N``), for
the one-line message about a bad one, and a stable key for the train/validation split.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

RECORD_SUFFIXES = (".jsonl", ".json", ".parquet")
_SAVED_DATASET_FILES = ("state.json", "dataset_dict.json")
"What datasets' save_to_disk writes at the top of its folder (a Dataset, a DatasetDict)."
_PARQUET_BATCH = 1024


@dataclasses.dataclass(frozen=True)
class Record:
    where: str
    "Source file (relative to the source) and line or record number, for messages."
    value: Any
    "The decoded record (a dict when well formed), or None when it could not be decoded."
    problem: str = ""
    "Why the record could not be decoded (``invalid JSON``, ``not UTF-8``); empty when it was."
    detail: str = ""
    "Where in the line it went wrong, for the first example of each problem."


def is_saved_dataset(path: Path) -> bool:
    return path.is_dir() and any((path / name).is_file() for name in _SAVED_DATASET_FILES)


def record_files(source: str | os.PathLike) -> list[Path]:
    """The record files of ``source`` (a file or a folder), sorted; [] when it holds none."""
    path = Path(source)
    if path.is_file():
        return [path] if path.suffix in RECORD_SUFFIXES else []
    if not path.is_dir() or is_saved_dataset(path):
        return []
    found = [
        p
        for p in path.rglob("*")
        if p.is_file()
        and p.suffix in RECORD_SUFFIXES
        and not any(part.startswith(".") for part in p.relative_to(path).parts)
    ]
    return sorted(found, key=lambda p: p.relative_to(path).as_posix())


def _jsonl(path: Path, name: str) -> Iterator[Record]:
    """Lines are decoded one by one, so a line that is not UTF-8 is one bad record."""
    with open(path, "rb") as f:
        for number, raw in enumerate(f, 1):
            where = f"{name} line {number}"
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                yield Record(
                    where,
                    None,
                    "not UTF-8",
                    f"byte 0x{raw[e.start]:02x} at byte {e.start + 1} of the line",
                )
                continue
            if not line.strip():
                continue
            try:
                yield Record(where, json.loads(line))
            except json.JSONDecodeError as e:
                yield Record(where, None, "invalid JSON", f"{e.msg} at column {e.colno}")


def _json(path: Path, name: str) -> Iterator[Record]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(
            f"{path}: not a JSON file ({e}); a .json source holds one list of "
            "records (use .jsonl for one record per line)"
        ) from None
    if not isinstance(data, list):
        raise ValueError(f"{path}: expected a JSON list of records, got a {type(data).__name__}")
    for number, value in enumerate(data):
        yield Record(f"{name} record {number}", value)


def _parquet(path: Path, name: str) -> Iterator[Record]:
    import pyarrow.parquet as pq

    number = 0
    for batch in pq.ParquetFile(path).iter_batches(batch_size=_PARQUET_BATCH):
        for value in batch.to_pylist():
            yield Record(f"{name} record {number}", value)
            number += 1


def _saved_dataset(path: Path) -> Iterator[Record]:
    import datasets

    dataset = datasets.load_from_disk(os.fspath(path))
    if isinstance(dataset, datasets.DatasetDict):
        if "train" not in dataset:
            raise ValueError(
                f"{path} is a DatasetDict without a 'train' split "
                f"(splits: {', '.join(dataset)}); point data.source at one split"
            )
        dataset = dataset["train"]
    number = 0
    for batch in dataset.with_format(None).iter(batch_size=_PARQUET_BATCH):
        columns = list(batch)
        for values in zip(*(batch[c] for c in columns)):
            yield Record(f"{path.name} record {number}", dict(zip(columns, values)))
            number += 1


_READERS = {".jsonl": _jsonl, ".json": _json, ".parquet": _parquet}


def iter_records(source: str | os.PathLike) -> Iterator[Record]:
    """Every record of ``source`` in a fixed order (files sorted, records in file order)."""
    path = Path(source)
    if is_saved_dataset(path):
        yield from _saved_dataset(path)
        return
    files = record_files(path)
    if not files:
        raise ValueError(
            f"data.source {os.fspath(source)!r} holds no records: expected a "
            f".jsonl, .json or .parquet file, a folder of them, or a folder "
            f"written by datasets' save_to_disk"
        )
    for file in files:
        name = file.name if path.is_file() else file.relative_to(path).as_posix()
        yield from _READERS[file.suffix](file, name)
