"""Stage training: the trainer's GPT step on one device (stage 0, bf16 weights, fp32 master,
AdamW), step time, tokens/s and MFU, for several sizes, remat policies and attention kernels."""
from __future__ import annotations

from benchlib.gpt import spec_key
from gpureport.runner import Context, Item
from gpureport.tables import good, num, of_stage, params, table

TITLE = "Training (one device, stage 0)"


def gpt_item(label: str, spec: dict, budget: float) -> Item:
    return Item(label, "benchlib.gpt:train_case", spec, key=spec_key(spec), timeout_s=min(budget, 400),
                case_timeout_s=min(budget, 380), min_s=min(30.0, budget / 4))


def plan(ctx: Context):
    for label, spec in ctx.profile.training_runs:
        yield gpt_item(label, spec, ctx.profile.budgets["training"])


def row(r: dict) -> list:
    res = r["result"]
    step_ms = res["step_s"] and res["step_s"] * 1e3
    loss = f"{res['loss']:.3f}" + ("" if res["loss_finite"] else " **not finite**")
    return [r["item"], params(res["params"]), f"{res['tokens_per_step']:,}", num(step_ms, "{:.1f}"),
            num(res["tokens_per_s"], "{:,.0f}"), num(res["mfu"], "{:.1%}"), loss, f"{res['compile_s']:.0f}"]


def render(records: list[dict]) -> list[str]:
    rows = [row(r) for r in good(of_stage(records, "training"))]
    if not rows:
        return []
    return (["MFU = flops_per_token (6N + 12·L·H·D·S, no remat recompute) x tokens/s / the bf16 "
             "peak in the environment section. Median of the timed steps, each synchronised.", ""]
            + table(["run", "params", "tokens/step", "step ms", "tokens/s", "MFU", "loss", "compile s"],
                    rows))
