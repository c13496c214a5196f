"""Stage memory: for the training configurations (and the offload ones), what
``zeroflow.memory`` estimates next to what XLA plans for the compiled step and what the
allocator actually reached (``memory_stats()['peak_bytes_in_use']``, one process per
configuration so that the peak is that configuration's)."""
from __future__ import annotations

import dataclasses

from gpureport.runner import Context, Item, Summary
from gpureport.stages.training import gpt_item
from gpureport.tables import good, num, size, table

TITLE = "Memory: estimate vs compiled vs allocated"
_SOURCES = ("memory", "offload")
DEVICELESS = " / deviceless"
"Suffix of the item that compiles a configuration for the GPU's abstract twin."


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
        yield Item(label + DEVICELESS, "benchlib.gpt:deviceless_case", {"spec": spec},
                   timeout_s=min(budget, 330), min_s=min(60.0, budget / 4))


def render(records: list[dict]) -> list[str]:
    rows = []
    twins = {r["item"][:-len(DEVICELESS)]: r["result"] for r in good(records)
             if r["stage"] == "memory" and r["item"].endswith(DEVICELESS)}
    for r in good([r for r in records if r["stage"] in _SOURCES]):
        mem = r["result"].get("memory")
        if not mem:
            continue
        compiled, est = mem.get("compiled") or {}, mem["estimate"]
        allocated = mem.get("allocated_peak")
        predicted = est.get("peak", est["device"])
        ratio = predicted / allocated if allocated else None
        deviceless = (twins.get(r["item"]) or {}).get("device_peak")
        rows.append([f"{r['stage']}: {r['item']}", size(predicted), size(deviceless),
                     size(compiled.get("total_bytes")),
                     size(compiled.get("peak_bytes") or None), size(allocated), num(ratio, "{:.2f}"),
                     size(est["host"]), size(compiled.get("host_argument_bytes"))])
    if not rows:
        return []
    return (["estimate: `zeroflow.memory.estimate_config` (the ZeRO formula's model states and "
             "the GPT's activation formula); "
             "deviceless: the same step compiled for this GPU's abstract twin on the CPU "
             "platform (zf.target_mesh: what a machine without a GPU predicts); "
             "compiled: XLA's memory_analysis "
             "(arguments + outputs + temporaries - aliased); XLA peak where the backend "
             "reports one; allocated: the allocator's peak in a fresh process after the steps.", ""]
            + table(["configuration", "estimate", "deviceless", "compiled", "XLA peak",
                     "allocated peak",
                     "estimate / allocated", "host (estimate)", "host args (compiled)"], rows))
