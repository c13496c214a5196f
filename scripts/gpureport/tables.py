"""Small helpers the stages' renderers share: markdown tables and number formats."""
from __future__ import annotations

from collections.abc import Iterable, Sequence

GOOD = ("ok", "reused")


def table(headers: Sequence[str], rows: Iterable[Sequence]) -> list[str]:
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return lines


def num(value, fmt: str = "{:.3g}", missing: str = "-") -> str:
    return missing if value is None else fmt.format(value)


def size(n) -> str:
    """Bytes in decimal units (1 GB = 1e9 B), as zeroflow.memory reports them."""
    if n is None:
        return "-"
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f} B"


def params(n) -> str:
    if n is None:
        return "-"
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.0f}M" if n >= 1e6 else f"{n:,}"


def of_stage(records: list[dict], stage: str) -> list[dict]:
    return [r for r in records if r["stage"] == stage]


def good(records: list[dict]) -> list[dict]:
    return [r for r in records if r["status"] in GOOD and r.get("result") is not None]


def not_good(records: list[dict]) -> list[dict]:
    return [r for r in records if r["status"] not in GOOD]


def failure_lines(records: list[dict]) -> list[str]:
    """One line per item or case that did not produce a result, with why."""
    lines = []
    for r in not_good(records):
        name = r["item"] + (f" / {r['case']}" if r["case"] else "")
        lines.append(f"- {name}: **{r['status']}** {r.get('error') or r.get('note') or ''}".rstrip())
    return lines
