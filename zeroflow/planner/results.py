"""What a search found: figures per row (``Summary``), the full search in JSON, the short table
a person reads (one row per GPU x device count and the lines that say what its figures are),
and the files ``python -m zeroflow.planner`` writes."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from zeroflow.config.io import apply_overrides, save_config
from zeroflow.memory.estimate import format_bytes
from zeroflow.planner.compiling import Compiler
from zeroflow.planner.search import COMPILED, FAILED, Candidate, Row


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
    "'xla', 'xla-target', 'peak' (see ``Measured.costed_by``), 'model-flops' (XLA's estimate was"
    " below the model's FLOPs at the dense peak: that bound), or 'what-if' (no XLA estimate)."
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
    ms, costed, mfu = got.step(compiler.rates, where, problem.model_flops())
    seconds = best.what_if.prior_s if ms is None else ms / 1e3
    return Summary(
        row=row,
        best=best,
        peak_bytes=got.peak_bytes,
        host_bytes_per_process=best.host_bytes(where.per_process),
        step_ms=seconds * 1e3,
        step_costed_by=costed,
        tokens_per_s=problem.spec.tokens_per_step / seconds,
        mfu=mfu,
        overrides=problem.overrides(best.choice, where.devices),
    )


def _candidate_json(cand: Candidate, compiler: Compiler, where) -> dict:
    w, got = cand.what_if, cand.measured
    out = {"choice": cand.choice.as_json(), "status": cand.status}
    out["what_if"] = {
        "floor_bytes": round(w.floor_bytes),
        "predicted_bytes": round(w.predicted_bytes),
        "host_bytes_per_process": round(w.host_bytes),
        "prior_ms": round(w.prior_s * 1e3, 3),
    }
    out |= {"reason": cand.reason} if cand.reason else {}
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
    where, best = s.row.where, s.best
    return {
        "gpu": where.name,
        "device_kind": where.device_kind,
        "devices": where.devices,
        "hosts": where.hosts,
        "compiled_for": "this machine" if where.local else "target (XLA:GPU, no GPU)",
        "device_memory_bytes": where.memory_bytes,
        "usable_bytes": round(s.row.usable_bytes),
        "best": best
        and {
            "choice": best.choice.as_json(),
            "label": best.choice.label(),
            "peak_bytes": round(s.peak_bytes),
            "host_bytes_per_process": round(s.host_bytes_per_process),
            "step_ms": round(s.step_ms, 3),
            "step_costed_by": s.step_costed_by,
            "tokens_per_s": round(s.tokens_per_s, 1),
            "mfu": None if s.mfu is None else round(s.mfu, 4),
            "overrides": s.overrides,
        },
        "notes": s.row.notes + list(s.row.gpu_notes),
        "advice": [a.as_json() for a in advice],
        "candidates": [_candidate_json(c, compiler, where) for c in s.row.candidates],
    }


COLUMNS = "GPU|devices|best plan|peak/device (XLA)|host RAM/process|est. step|tokens/s|MFU|compiled"
STEP_MARK = {
    "xla": "",
    "xla-target": "~ ",
    "peak": "≥ ",
    "model-flops": "≥ ",
    "what-if": "what-if ",
}
"How a step's loops were costed (``Measured.step``), as the tables mark it."


def cells(s: Summary) -> list[str]:
    where, row = s.row.where, s.row
    tried = len(row.compiled()) + row.failures()
    head, tail = [where.name, str(where.devices)], [f"{tried} of {len(row.candidates)}"]
    if unplanned(row) or s.best is None:  # no attention to plan with: the row says why
        return head + [row.gpu_notes[0] if unplanned(row) else "nothing fits"] + ["-"] * 5 + tail
    mfu = (
        "-"
        if s.mfu is None
        else ("≤ " if s.step_costed_by == "peak" else "") + f"{100 * s.mfu:.0f}%"
    )
    return (
        head
        + [
            s.best.choice.label(),
            format_bytes(s.peak_bytes),
            format_bytes(s.host_bytes_per_process) if s.host_bytes_per_process else "0",
            f"{STEP_MARK[s.step_costed_by]}{s.step_ms:.1f} ms",
            f"{s.tokens_per_s:,.0f}",
            mfu,
        ]
        + tail
    )


def render(plan: Plan, console=None) -> None:
    from rich.console import Console
    from rich.table import Table

    console = console or Console(width=max(Console().width, 140))
    if plan.rows and plan.rows[0].where.local:
        here = plan.rows[0].where
        console.print(
            f"No --gpus given: planning for this machine's devices ({here.name}, "
            f"{here.device_kind}); name GPUs with --gpus h100,a100,l4"
        )
    table = Table(title=plan.title)
    for name in COLUMNS.split("|"):
        table.add_column(name, justify="left" if name in ("GPU", "best plan") else "right")
    summaries = plan.summaries()
    for s in summaries:
        table.add_row(*cells(s))
    console.print(table)
    for line in notes(plan, summaries):
        console.print(line)


NOTES = {
    "fits": "fits: XLA's compiled peak is at most {usable:.0f}% of the GPU's memory (--margin "
    "{margin:g}: CUDA context, NCCL and cuDNN workspaces live there too); host RAM/process: pinned "
    "host memory for the offloaded state of one process's GPUs, to provision beyond the "
    "process's own.",
    "xla": "est. step: XLA:GPU's latency-hiding scheduler's cost model of the compiled step "
    "(nothing ran; not a measurement). ~: loops XLA prints no cost for (no collective in them, "
    "e.g. on one device) are costed at the time per matmul flop XLA gave this GPU's other "
    "programs; ≥: at the dense bf16 peak, a lower bound (its MFU then an upper bound, ≤). MFU: "
    "the model's FLOPs per step (a config's as the trainer counts them: 6 per trained matmul "
    "weight, 4 per frozen one, 6 per LoRA adapter element, plus attention; zf.plan's: 6 per "
    "trained param, 4 per frozen one) / est. step / dense bf16 peak.",
    "model-flops": "≥ without an MFU: XLA's estimate was below the model's FLOPs at the dense "
    "bf16 peak (its cost model leaves custom calls such as cuDNN attention out); the step shown "
    "is that bound, and tokens/s an upper bound.",
    "what-if": "est. step 'what-if': this backend gives no step estimate (XLA:CPU); the figure "
    "is the planner's roofline, which only orders the plans.",
    "one device": "1 device: stages 1-2 shard over one device and equal stage 0, so they are "
    "not listed; stage 3 differs only where it drops the compute-weight copy.",
}
"The lines under the planner's table, each where its case is in it."


def notes(plan: Plan, summaries: list[Summary]) -> list[str]:
    marks = {s.step_costed_by for s in summaries if s.best is not None}
    out = [NOTES["fits"].format(usable=100 * (1 - plan.margin), margin=plan.margin)]
    out += [NOTES["xla"]] if marks & {"xla", "xla-target", "peak"} else []
    out += [NOTES[mark] for mark in ("model-flops", "what-if") if mark in marks]
    out += [NOTES["one device"]] if any(s.row.where.devices == 1 for s in summaries) else []
    out += _slow_model_notes(plan)
    gpu_notes = (f"{s.row.where.name}: {line}" for s in summaries for line in s.row.gpu_notes)
    out += list(dict.fromkeys(gpu_notes))  # what a GPU cannot run, once per GPU
    for s in summaries:
        title, advice = s.row.where.title, plan.advice.get(s.row.where.title, [])
        out += [f"{title}: {line}" for line in s.row.notes] + failure_lines(s.row)
        out += [f"{title}, nothing fits; could work: {a.line()}" for a in advice]
        if s.best is None and not advice and not unplanned(s.row):
            out.append(_nothing_fits(s))
    return out


def unplanned(row: Row) -> bool:
    """Whether the row had nothing to search: its GPU cannot run any attention asked for."""
    return not row.candidates and bool(row.gpu_notes)


def failure_lines(row: Row) -> list[str]:
    """One line per reason the row's compiles failed for, naming the first plan it failed
    and how many more (a failed compile is not a plan that does not fit)."""
    failed = [(c.reason, c.choice.label()) for c in row.candidates if c.status == FAILED]
    return [
        f"{row.where.title}: did not compile ({which}): {why}"
        for why, which in grouped_failures(failed, 1)
    ]


def grouped_failures(failed: list[tuple[str, str]], named: int) -> list[tuple[str, str]]:
    """``(reason, which)`` per reason of ``(reason, what failed)`` pairs, ``which`` naming the
    first ``named`` and how many more."""
    by_reason: dict[str, list[str]] = {}
    for reason, what in failed:
        by_reason.setdefault(reason, []).append(what)
    out = []
    for reason, whats in by_reason.items():
        more = f" and {len(whats) - named} more" if len(whats) > named else ""
        out.append((reason, ", ".join(whats[:named]) + more))
    return out


def _slow_model_notes(plan: Plan) -> list[str]:
    """How fast XLA's cost model runs each GPU's layer loops, per matmul flop: the rows of
    one GPU compare with each other; across GPUs only as far as XLA's model of each holds."""
    parts = []
    for name, per_flop in sorted(plan.compiler.rates.us_per_flop.items()):
        where = next(r.where for r in plan.rows if r.where.name == name)
        rate = 1e6 / per_flop
        parts.append(f"{name} {rate / 1e12:.0f} TFLOP/s ({100 * rate / where.peak_flops:.0f}%)")
    if not parts:
        return []
    return [
        "XLA:GPU's cost model runs the layer loops at (matmul flops per second, share of the "
        "dense bf16 peak): " + ", ".join(parts) + "; compare plans within a GPU's rows, and "
        "GPUs with each other only as far as XLA's model of each holds."
    ]


def _nothing_fits(s: Summary) -> str:
    compiled = [c for c in s.row.candidates if c.status == COMPILED]
    smallest = min(compiled, key=lambda c: c.got.peak_bytes, default=None)
    tried = (
        f"; the smallest compiled peak was {format_bytes(smallest.got.peak_bytes)} "
        f"({smallest.choice.label()})"
        if smallest
        else ""
    )
    return (
        f"{s.row.where.title}: nothing fits in {format_bytes(s.row.usable_bytes)}{tried}; "
        "add devices, offload, or shrink the batch"
    )


def write(plan: Plan, cfg, out: Path, config_path: str | None, seconds: float) -> None:
    """The whole search to ``out/search.json``, each row's plan to
    ``out/<gpu>-x<devices>.overrides`` and ``.yaml``, and how to run one."""
    out.mkdir(parents=True, exist_ok=True)
    data = {**plan.as_json(), "wall_seconds": round(seconds, 1)}
    (out / "search.json").write_text(json.dumps(data, indent=1))
    written = []
    for s in plan.summaries():
        if s.best is not None and s.overrides:
            stem = out / f"{s.row.where.name}-x{s.row.where.devices}"
            stem.with_suffix(".overrides").write_text(" ".join(s.overrides) + "\n")
            save_config(apply_overrides(cfg, s.overrides), stem.with_suffix(".yaml"))
            written.append(stem)
    print(f"wrote {out / 'search.json'} (the whole search) in {seconds:.0f} s")
    if written:
        config = f"--config {config_path} " if config_path else ""
        print(
            f"run a plan: python -m zeroflow.train {config}$(cat {written[0]}.overrides), "
            f"or --config {written[0]}.yaml"
        )
