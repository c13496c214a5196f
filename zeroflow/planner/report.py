"""The planner's short table: one row per GPU x device count, and the lines that say what its
figures are."""

from __future__ import annotations

from zeroflow.memory.estimate import format_bytes
from zeroflow.planner.results import Plan, Summary
from zeroflow.planner.search import COMPILED, FAILED

COLUMNS = (
    "GPU",
    "devices",
    "best plan",
    "peak/device (XLA)",
    "host RAM/process",
    "est. step",
    "tokens/s",
    "MFU",
    "compiled",
)
STEP_MARK = {"xla": "", "xla-target": "~ ", "peak": "≥ ", "what-if": "what-if "}


def cells(s: Summary) -> list[str]:
    where = s.row.where
    tried = len(s.row.compiled()) + sum(c.status == FAILED for c in s.row.candidates)
    compiled = f"{tried} of {len(s.row.candidates)}"
    head = [where.name, str(where.devices)]
    if s.best is None:
        return head + ["nothing fits", "-", "-", "-", "-", "-", compiled]
    return head + [
        s.best.choice.label(),
        format_bytes(s.peak_bytes),
        format_bytes(s.host_bytes_per_process) if s.host_bytes_per_process else "0",
        f"{STEP_MARK[s.step_costed_by]}{s.step_ms:.1f} ms",
        f"{s.tokens_per_s:,.0f}",
        "-" if s.mfu is None else f"{100 * s.mfu:.0f}%",
        compiled,
    ]


def render(plan: Plan, console=None) -> None:
    from rich.console import Console
    from rich.table import Table

    console = console or Console(width=max(Console().width, 140))
    table = Table(title=plan.title)
    for name in COLUMNS:
        table.add_column(name, justify="left" if name in ("GPU", "best plan") else "right")
    summaries = plan.summaries()
    for s in summaries:
        table.add_row(*cells(s))
    console.print(table)
    for line in notes(plan, summaries):
        console.print(line)


def notes(plan: Plan, summaries: list[Summary]) -> list[str]:
    out = [
        f"fits: XLA's compiled peak is at most {100 * (1 - plan.margin):.0f}% of the GPU's "
        f"memory (--margin {plan.margin:g}: CUDA context, NCCL and cuDNN workspaces live "
        "there too); host RAM/process: pinned host memory for the offloaded state of one "
        "process's GPUs, to provision beyond the process's own."
    ]
    marks = {s.step_costed_by for s in summaries if s.best is not None}
    if marks & {"xla", "xla-target", "peak"}:
        out.append(
            "est. step: XLA:GPU's latency-hiding scheduler's cost model of the compiled step "
            "(nothing ran; not a measurement). ~: loops XLA prints no cost for (no "
            "collective in them, e.g. on one device) are costed at the time per matmul flop "
            "XLA gave this GPU's other programs; ≥: at the dense bf16 peak, a lower bound. "
            "MFU: the model's FLOPs per step (a config's: 6 x matmul weights + attention, as "
            "the trainer counts them; zf.plan's: 6 x params) / est. step / dense bf16 peak."
        )
    if "what-if" in marks:
        out.append(
            "est. step 'what-if': this backend gives no step estimate (XLA:CPU); the figure "
            "is the planner's roofline, which only orders the plans."
        )
    if any(s.row.where.devices == 1 for s in summaries):
        out.append(
            "1 device: stages 1-2 shard over one device and equal stage 0, so they are not "
            "listed; stage 3 differs only where it drops the compute-weight copy."
        )
    out += _slow_model_notes(plan)
    for s in summaries:
        for line in s.row.notes:
            out.append(f"{s.row.where.title}: {line}")
        for advice in plan.advice.get(s.row.where.title, []):
            out.append(f"{s.row.where.title}, nothing fits; could work: {advice.line()}")
        if s.best is None and not plan.advice.get(s.row.where.title):
            out.append(_nothing_fits(s))
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
