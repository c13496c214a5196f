"""Stage memory: for the training configurations (and the offload ones), what
``zeroflow.memory`` estimates next to what XLA plans for the compiled step and what the
allocator actually reached (``memory_stats()['peak_bytes_in_use']``, one process per
configuration so that the peak is that configuration's)."""
from __future__ import annotations

import dataclasses

from gpureport.runner import Context, Summary
from gpureport.stages.training import gpt_item
from gpureport.tables import good, num, size, table

TITLE = "Memory: estimate vs compiled vs allocated"
_SOURCES = ("memory", "offload")


def plan(ctx: Context):
    """With the training stage in the same run, only reuse its results (a configuration it did
    not reach is left for the next call of both); without it, measure each configuration."""
    budget = ctx.profile.budgets["memory"]
    with_training = "training" in ctx.stages
    for label, spec in ctx.profile.training_runs:
        trained = [r for r in ctx.records if r["stage"] == "training" and r["item"] == label]
        if with_training and trained and trained[-1]["status"] not in ("ok", "skipped"):
            yield Summary(label, status="skipped", note="its training item did not produce a result")
            continue
        item = gpt_item(label, {**spec, "steps": 1, "warmup": 1}, budget)
        yield dataclasses.replace(item, reuse_only=with_training)


def render(records: list[dict]) -> list[str]:
    rows = []
    for r in good([r for r in records if r["stage"] in _SOURCES]):
        mem = r["result"].get("memory")
        if not mem:
            continue
        compiled, est = mem.get("compiled") or {}, mem["estimate"]
        allocated = mem.get("allocated_peak")
        predicted = est.get("peak", est["device"])
        ratio = predicted / allocated if allocated else None
        rows.append([f"{r['stage']}: {r['item']}", size(predicted), size(compiled.get("total_bytes")),
                     size(compiled.get("peak_bytes") or None), size(allocated), num(ratio, "{:.2f}"),
                     size(est["host"]), size(compiled.get("host_argument_bytes"))])
    if not rows:
        return []
    return (["estimate: `zeroflow.memory.estimate_config_step` (the step's peak from shapes: "
             "model states, gradients, jax's residuals, the layer in flight, the update); "
             "compiled: XLA's memory_analysis "
             "(arguments + outputs + temporaries - aliased); XLA peak where the backend "
             "reports one; allocated: the allocator's peak in a fresh process after the steps.", ""]
            + table(["configuration", "estimate", "compiled", "XLA peak", "allocated peak",
                     "estimate / allocated", "host (estimate)", "host args (compiled)"], rows))
