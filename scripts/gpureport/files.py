"""The report's files under ``--out``, each brought up to date as soon as a record exists.

A run killed at any moment leaves everything recorded so far on disk: ``results.jsonl`` is
appended and fsynced per record; ``report.md`` and ``report.json`` are rewritten (write to a
temporary name, then rename) after each record; ``errors.log`` holds the tracebacks and child
output of failures; ``progress.log`` every progress line; ``nvidia-smi.txt`` the driver's view.
Six small files, quick to copy off the GPU machine.
"""
from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

RESULTS, REPORT_JSON, REPORT_MD = "results.jsonl", "report.json", "report.md"
ERRORS, PROGRESS, NVIDIA_SMI = "errors.log", "progress.log", "nvidia-smi.txt"
MAX_ERRORS_BYTES = 4 * 2**20
"errors.log stops growing here, so that the report folder stays small enough to copy anywhere."


def write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def read_records(paths: list[Path]) -> list[dict]:
    """Records of one or more ``results.jsonl`` files, in order (a cut-off last line is dropped)."""
    records = []
    for path in paths:
        for line in Path(path).read_text().splitlines():
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                break
    return records


class ReportFiles:
    def __init__(self, out: Path, render: Callable[[list[dict]], str],
                 summarize: Callable[[list[dict]], dict], *, echo: Callable[[str], None] = print):
        self.out, self.records = Path(out), []
        self._render, self._summarize, self._echo = render, summarize, echo
        self.out.mkdir(parents=True, exist_ok=True)
        for name in (RESULTS, ERRORS, PROGRESS):
            (self.out / name).write_text("")

    def add(self, record: dict, *, detail: str | None = None) -> None:
        self.records.append(record)
        with open(self.out / RESULTS, "a") as f:
            f.write(json.dumps(record) + "\n")
            f.flush()
            os.fsync(f.fileno())
        if detail:
            self._error_detail(record, detail)
        self.log(progress_line(record))
        self.refresh()

    def refresh(self) -> None:
        """Re-render the markdown and the JSON from every record so far."""
        write_atomic(self.out / REPORT_MD, self._render(self.records))
        write_atomic(self.out / REPORT_JSON, json.dumps(self._summarize(self.records), indent=1))

    def log(self, line: str) -> None:
        self._echo(line)
        with open(self.out / PROGRESS, "a") as f:
            f.write(line + "\n")

    def write_text(self, name: str, text: str) -> None:
        write_atomic(self.out / name, text)

    def _error_detail(self, record: dict, detail: str) -> None:
        path = self.out / ERRORS
        if path.stat().st_size > MAX_ERRORS_BYTES:
            return
        head = f"===== {record['stage']} / {record['item']} / {record['case'] or '-'}: {record['status']}"
        with open(path, "a") as f:
            f.write(f"{head}\n{record.get('error') or ''}\n{detail.rstrip()}\n\n")


def brief(result: dict | None) -> str:
    """A few headline numbers of a result, for a progress line."""
    if not result:
        return ""
    parts = []
    for key, fmt in (("tflops", "{:.1f} TFLOP/s"), ("ms", "{:.3f} ms"), ("mfu", "MFU {:.1%}"),
                     ("tokens_per_s", "{:,.0f} tok/s"), ("passed", "passed={}"), ("fits", "fits={}"),
                     ("device_kind", "{}"), ("largest_fits", "largest {} layers"),
                     ("fp8_speedup", "FP8 {:.2f}x bf16")):
        value = result.get(key)
        if value is not None:
            parts.append(fmt.format(value))
    return ", ".join(parts)


def progress_line(record: dict) -> str:
    name = record["item"] + (f" | {record['case']}" if record["case"] else "")
    tail = record.get("error") or record.get("note") or brief(record.get("result"))
    return (f"[{record['elapsed_s']:6.1f}s] {record['stage']:<11} {name} -> {record['status']}"
            f" ({record['seconds']:.1f}s) {tail}")


def replace_section(text: str, heading: str, section: list[str]) -> str:
    """``text`` (markdown) with the section that starts at the line ``heading`` (up to the next
    heading of the same level, or the end) replaced by ``section``; appended if it has none."""
    lines = text.splitlines()
    level = heading.split(" ", 1)[0] + " "
    try:
        start = lines.index(heading)
    except ValueError:
        return text.rstrip("\n") + "\n\n" + "\n".join(section).rstrip("\n") + "\n"
    end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith(level)), len(lines))
    tail = [""] + lines[end:] if end < len(lines) else []
    return "\n".join([*lines[:start], *"\n".join(section).rstrip("\n").split("\n"), *tail]) + "\n"

