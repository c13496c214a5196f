"""Why a checkpoint cannot be read, in words a person can act on: which file, what is wrong.

Orbax and TensorStore report damage in their own terms (zarr drivers, OCDBT databases, byte
ranges, pybind objects, or a ``TypeError`` when a metadata file is gone). ``describe`` looks
at the step's folder first (the files every complete checkpoint has) and otherwise turns the
library's message into one sentence that names the file.
"""

from __future__ import annotations

import json
import logging
import os
import re
import sys
from pathlib import Path

# The files Orbax writes for every step of a RunCheckpoints: item folder -> files in it (and
# the OCDBT index, when the arrays were written to an OCDBT database: per-process folders).
REQUIRED: dict[str, tuple[str, ...]] = {"state": ("_METADATA",), "meta": ("metadata",)}
OCDBT_INDEX = "manifest.ocdbt"
_TRUNCATED = re.compile(
    r'local file "([^"]+)": Requested byte range \[\d+, (\d+)\) is not valid '
    r"for value of size (\d+)"
)
_MISSING_ARRAY = re.compile(
    r'Metadata at "([^"]+)/\.zarray" in OCDBT database at local file '
    r'"([^"]+)" does not exist'
)
_FILE_FAULT = re.compile(r'local file "([^"]*[^/"])": ([^;\[]+)')
_NOISE = re.compile(
    r"\s*\[tensorstore_spec=.*|\s*See full TensorStore details.*|\s*\[source locations=.*"
)


def shown(path: Path, root: Path) -> str:
    """``path`` relative to the run folder (``root``'s parent) when it lies inside it."""
    try:
        return str(Path(path).relative_to(root.parent))
    except ValueError:
        return str(path)


def _bad_json(file: Path) -> str | None:
    try:
        json.loads(file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError):
        return "is not valid JSON (damaged or cut short)"
    return None


def missing_or_damaged(step_dir: Path, root: Path) -> str | None:
    """The first required file of ``step_dir`` that is missing, empty or not JSON, or None."""
    if not step_dir.is_dir():
        return f"{shown(step_dir, root)} is missing"
    for item, names in REQUIRED.items():
        folder = step_dir / item
        if not folder.is_dir():
            return f"{shown(folder, root)}/ is missing (the step was not copied or written whole)"
        if item == "state" and any(folder.glob("ocdbt.process_*")):
            names = (*names, OCDBT_INDEX)
        for name in names:
            file = folder / name
            if not file.is_file():
                return f"{shown(file, root)} is missing"
            if file.stat().st_size == 0:
                return f"{shown(file, root)} is empty"
            if name != OCDBT_INDEX and (problem := _bad_json(file)):
                return f"{shown(file, root)} {problem}"
    return None


def from_error(error: BaseException, step_dir: Path, root: Path) -> str:
    """One sentence from a library error raised while reading ``step_dir``."""
    text = " ".join(str(error).split())
    if m := _TRUNCATED.search(text):
        file, wanted, size = m.groups()
        return f"{shown(Path(file), root)} is cut short ({size} bytes, at least {wanted} expected)"
    if m := _MISSING_ARRAY.search(text):
        array, db = m.groups()
        return (
            f"array '{array}' is missing from {shown(Path(db), root)} (its index files "
            "are missing or damaged)"
        )
    if isinstance(error, KeyError):
        return f"{shown(step_dir, root)} lacks part of the checkpoint ({text.strip(chr(39))})"
    if faults := _FILE_FAULT.findall(text):
        file, fault = faults[-1]  # the innermost: the file that is damaged, and how
        return f"{shown(Path(file), root)} is damaged ({fault.strip()[:120]})"
    return f"{shown(step_dir, root)} cannot be read ({type(error).__name__}: {_NOISE.sub('', text)[:160]})"


def describe(error: BaseException, step_dir: Path, root: Path) -> str:
    """Why ``step_dir`` (a step folder under ``root``) could not be read, in one sentence."""
    return missing_or_damaged(step_dir, root) or from_error(error, step_dir, root)


class _DropTensorStoreLeftovers(logging.Filter):
    """asyncio's "... exception was never retrieved" for the TensorStore reads that failed
    after Orbax had already raised the first failure."""

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        return not (
            str(record.msg).split("\n")[0].endswith("exception was never retrieved")
            and "tensorstore_spec" in str(error)
        )


class _DropClosedLoops:
    """An unraisable hook that drops "Event loop is closed" and hands the rest to ``previous``."""

    def __init__(self, previous):
        self.previous = previous

    def __call__(self, unraisable) -> None:
        value = unraisable.exc_value
        if not (isinstance(value, RuntimeError) and str(value) == "Event loop is closed"):
            self.previous(unraisable)


def quiet_closed_loops() -> None:
    """After a failed read, TensorStore's worker threads still hand their results to the event
    loop Orbax has closed; each would print a traceback (through ``sys.unraisablehook``) or an
    asyncio error. Those, and only those, are dropped; installed once per process."""
    if isinstance(sys.unraisablehook, _DropClosedLoops):
        return
    sys.unraisablehook = _DropClosedLoops(sys.unraisablehook)
    logging.getLogger("asyncio").addFilter(_DropTensorStoreLeftovers())


_RERAISED = (
    "_SignalingThread.run() raised an exception",
    "in background save thread",  # async saves: raised again by wait_until_finished
    "Save Finalize thread (save_finalize) failed",
)


class _DropReraisedThreadErrors(logging.Filter):
    """Orbax logs the traceback of an error in one of its writer threads (or, for an async
    save, its background thread), then raises the same error in the thread that waits for the
    save; the raised one is reported (in one line)."""

    def filter(self, record: logging.LogRecord) -> bool:
        text = record.getMessage()
        return not any(mark in text for mark in _RERAISED)


def quiet_writer_threads() -> None:
    """Before a save: a failed write (disk full, read-only) is reported once, by the caller,
    not also as the tracebacks of Orbax's threads and TensorStore's leftover callbacks.
    Installed once per process; ``ZEROFLOW_TRACEBACK=1`` leaves everything as it was."""
    if os.environ.get("ZEROFLOW_TRACEBACK"):
        return
    quiet_closed_loops()
    absl = logging.getLogger("absl")
    if not any(isinstance(f, _DropReraisedThreadErrors) for f in absl.filters):
        absl.addFilter(_DropReraisedThreadErrors())
    loop_log = logging.getLogger("asyncio")
    if not any(isinstance(f, _DropSiblingWriteErrors) for f in loop_log.filters):
        loop_log.addFilter(_DropSiblingWriteErrors())


_FAILED_WRITES = (
    "write_fragment",
    "RESOURCE_EXHAUSTED",
    "No space left on device",
    "File too large",  # EFBIG: a file over the process's or the file system's size limit
    "Read-only file system",
)


class _DropSiblingWriteErrors(logging.Filter):
    """When one of a save's concurrent writes fails, the others that fail too (the same full
    or read-only disk) are logged by asyncio as never retrieved once they are collected (tasks
    and futures), each with a traceback; the first failure is the one reported."""

    def filter(self, record: logging.LogRecord) -> bool:
        text = record.getMessage()
        if record.exc_info and record.exc_info[1] is not None:
            text += " " + str(record.exc_info[1])
        return not (
            "exception was never retrieved" in text and any(mark in text for mark in _FAILED_WRITES)
        )


class _DropReadOnlyNote(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("Given directory is read only")


def quiet_read_only_notes() -> None:
    """Readers open checkpoints read-only on purpose: Orbax's note that a folder is read-only
    (a run folder on a read-only disk) says nothing to act on."""
    absl = logging.getLogger("absl")
    if not any(isinstance(f, _DropReadOnlyNote) for f in absl.filters):
        absl.addFilter(_DropReadOnlyNote())
