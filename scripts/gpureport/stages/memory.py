"""Stage memory: for the training configurations (and the offload ones), what
``zeroflow.memory`` estimates next to what XLA plans for the compiled step and what the
allocator actually reached (``memory_stats()['peak_bytes_in_use']``, one process per
configuration so that the peak is that configuration's)."""
from __future__ import annotations

from gpureport.runner import Context
from gpureport.stages.training import gpt_item
from gpureport.tables import size, good, num, table

TITLE = "Memory: estimate vs compiled vs allocated"
_SOURCES = ("memory", "offload")


def plan(ctx: Context):
    budget = ctx.profile.budgets["memory"]
    for label, spec in ctx.profile.training_runs:  # reused from the training stage when it ran
        yield gpt_item(label, {**spec, "steps": 1, "warmup": 1}, budget)


def render(records: list[dict]) -> list[str]:
    rows = []
    for r in good([r for r in records if r["stage"] in _SOURCES]):
        mem = r["result"].get("memory")
        if not mem:
            continue
        compiled, est = mem.get("compiled") or {}, mem["estimate"]
        allocated = mem.get("allocated_peak")
        ratio = est["device"] / allocated if allocated else None
        rows.append([f"{r['stage']}: {r['item']}", size(est["device"]), size(compiled.get("total_bytes")),
                     size(compiled.get("peak_bytes") or None), size(allocated), num(ratio, "{:.2f}"),
                     size(est["host"]), size(compiled.get("host_argument_bytes"))])
    if not rows:
        return []
    return (["estimate: `zeroflow.memory.estimate_config` (model states + activations, its "
             "attention term assumes stored S x S scores); compiled: XLA's memory_analysis "
             "(arguments + outputs + temporaries - aliased); XLA peak where the backend "
             "reports one; allocated: the allocator's peak in a fresh process after the steps.", ""]
            + table(["configuration", "estimate", "compiled", "XLA peak", "allocated peak",
                     "estimate / allocated", "host (estimate)", "host args (compiled)"], rows))
