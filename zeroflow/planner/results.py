"""What a search found, as figures per row (``Summary``) and as the full search in JSON."""

from __future__ import annotations

import dataclasses

from zeroflow.planner.compiling import Compiler
from zeroflow.planner.search import Candidate, Row, step_seconds


@dataclasses.dataclass(frozen=True)
class Summary:
    """The best plan of a row and its figures (``best`` None, figures 0, where nothing fits)."""

    row: Row
    best: Candidate | None
    peak_bytes: float = 0.0
    host_bytes_per_process: float = 0.0
    "Pinned host memory one process needs for its devices' offloaded state and activations."
    step_ms: float = 0.0
    step_costed_by: str = ""
    "'xla', 'xla-target', 'peak' (see ``Measured.costed_by``), or 'what-if' (no XLA estimate)."
    tokens_per_s: float = 0.0
    mfu: float | None = None
    overrides: list[str] | None = None


@dataclasses.dataclass
class Plan:
    """``zf.plan``'s answer: one row per GPU x device count."""

    title: str
    rows: list[Row]
    margin: float
    compiler: Compiler
    problem: object
    advice: dict = dataclasses.field(default_factory=dict)
    "Row title -> list of ``zeroflow.planner.advice.Advice`` where nothing fits."

    def summaries(self) -> list[Summary]:
        return [summarize(row, self.problem, self.compiler) for row in self.rows]

    def best(self, gpu: str, devices: int) -> Summary:
        for s in self.summaries():
            if s.row.where.name == gpu and s.row.where.devices == devices:
                return s
        raise KeyError(f"no row for {devices} x {gpu}")

    def as_json(self) -> dict:
        return {
            "title": self.title,
            "margin": self.margin,
            "xla_us_per_matmul_flop": self.compiler.rates.us_per_flop,
            "compiles": self.compiler.compiles,
            "compile_seconds": round(self.compiler.compile_seconds, 1),
            "rows": [
                _row_json(s, self.compiler, self.advice.get(s.row.where.title, []))
                for s in self.summaries()
            ],
        }


def summarize(row: Row, problem, compiler: Compiler) -> Summary:
    best = row.best
    if best is None:
        return Summary(row, None)
    where, got = row.where, best.got
    step_ms = got.step_ms(compiler.rates, where)
    costed = got.costed_by(compiler.rates, where) if step_ms is not None else "what-if"
    seconds = step_seconds(best, compiler, where)
    flops = problem.model_flops()
    return Summary(
        row=row,
        best=best,
        peak_bytes=got.peak_bytes,
        host_bytes_per_process=(
            got.host_bytes * where.per_process if got.host_bytes else best.what_if.host_bytes
        ),
        step_ms=seconds * 1e3,
        step_costed_by=costed,
        tokens_per_s=problem.facts.tokens_per_step / seconds,
        mfu=(
            None
            if flops is None or costed == "what-if"
            else flops / where.devices / seconds / where.peak_flops
        ),
        overrides=problem.overrides(best.choice, where.devices),
    )


def _candidate_json(cand: Candidate, compiler: Compiler, where) -> dict:
    out = {
        "choice": cand.choice.as_json(),
        "status": cand.status,
        "what_if": {
            "floor_bytes": round(cand.what_if.floor_bytes),
            "predicted_bytes": round(cand.what_if.predicted_bytes),
            "host_bytes_per_process": round(cand.what_if.host_bytes),
            "prior_ms": round(cand.what_if.prior_s * 1e3, 3),
        },
    }
    if cand.reason:
        out["reason"] = cand.reason
    got = cand.measured
    if got is not None:
        step = got.step_ms(compiler.rates, where)
        out["xla"] = {
            "peak_bytes": round(got.peak_bytes),
            "host_bytes_per_device": round(got.host_bytes),
            "step_ms": None if step is None else round(step, 3),
            "step_costed_by": got.costed_by(compiler.rates, where) if step is not None else None,
            "exposed_ms": {k: round(v / 1e3, 3) for k, v in got.exposed_us.items()},
            "compile_s": round(got.compile_s, 1),
        }
    return out


def _row_json(s: Summary, compiler: Compiler, advice: list) -> dict:
    where = s.row.where
    return {
        "gpu": where.name,
        "device_kind": where.device_kind,
        "devices": where.devices,
        "hosts": where.hosts,
        "compiled_for": "this machine" if where.local else "target (XLA:GPU, no GPU)",
        "device_memory_bytes": where.memory_bytes,
        "usable_bytes": round(s.row.usable_bytes),
        "best": None
        if s.best is None
        else {
            "choice": s.best.choice.as_json(),
            "label": s.best.choice.label(),
            "peak_bytes": round(s.peak_bytes),
            "host_bytes_per_process": round(s.host_bytes_per_process),
            "step_ms": round(s.step_ms, 3),
            "step_costed_by": s.step_costed_by,
            "tokens_per_s": round(s.tokens_per_s, 1),
            "mfu": None if s.mfu is None else round(s.mfu, 4),
            "overrides": s.overrides,
        },
        "notes": s.row.notes,
        "advice": [a.as_json() for a in advice],
        "candidates": [_candidate_json(c, compiler, where) for c in s.row.candidates],
    }
