"""How a failure is named in a report: its kind and its first line."""
from __future__ import annotations

_OOM_MARKERS = ("RESOURCE_EXHAUSTED", "Out of memory", "out of memory", "OutOfMemory")


def is_oom(text: str) -> bool:
    """XLA and the allocators say out-of-memory in a few ways; all of them mean "does not fit"."""
    return any(marker in text for marker in _OOM_MARKERS)


def first_line(text: str, limit: int = 300) -> str:
    """The first non-empty line of an error message, shortened: what a report table shows."""
    for line in str(text).splitlines():
        if line.strip():
            return line.strip()[:limit]
    return ""


def describe(err: BaseException) -> str:
    return f"{type(err).__name__}: {first_line(str(err))}".rstrip(": ")
