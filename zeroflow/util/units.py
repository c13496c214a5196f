"""Vocabulary and units shared by the config and the layers below it, importable without jax
(a command checks its flags and config keys with these before jax starts)."""

from __future__ import annotations

import re

from zeroflow.util.settings import REMATS as REMATS  # the model's remat policies (model.remat)

_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
    "k": 10**3,
    "m": 10**6,
    "g": 10**9,
    "t": 10**12,
}


def parse_bytes(text: str | int | float) -> int:
    """'80GB' -> 80e9, '80GiB' -> 80 * 2**30, '512MB', '1.5TB', or a plain number of bytes."""
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        if text < 0:
            raise ValueError(f"memory size must be >= 0, got {text}")
        return int(text)
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][0-9]+)?)\s*([A-Za-z]*)\s*", str(text))
    if not match or match.group(2).lower() not in _UNITS:
        raise ValueError(
            f"bad memory size {text!r}; use a number with a unit such as "
            "80GB, 80GiB, 512MB or 1.5TB"
        )
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


def format_bytes(n: float) -> str:
    """Decimal units, as the ZeRO paper uses: 1 GB = 1e9 bytes."""
    for unit, size in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n:.0f} B"
