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


def env_of(records: list[dict]) -> dict:
    return next((r["result"] for r in good(of_stage(records, "env"))), {})


def mfu(result: dict, env: dict) -> tuple[float | None, str]:
    """(MFU, what it divides by): the datasheet peak the child found for its device, else the
    bf16 matmul the env stage measured (marked *), else nothing."""
    if result.get("mfu") is not None:
        return result["mfu"], ""
    measured = env.get("matmul_bf16_flops")
    if measured and result.get("tokens_per_s") and env.get("backend") != "cpu":
        return result["flops_per_token"] * result["tokens_per_s"] / measured, "*"
    return None, ""


def row(r: dict, env: dict) -> list:
    res = r["result"]
    step_ms = res["step_s"] and res["step_s"] * 1e3
    loss = f"{res['loss']:.3f}" + ("" if res["loss_finite"] else " **not finite**")
    value, mark = mfu(res, env)
    return [r["item"], params(res["params"]), f"{res['tokens_per_step']:,}", num(step_ms, "{:.1f}"),
            num(res["tokens_per_s"], "{:,.0f}"), num(value, "{:.1%}") + mark, loss, f"{res['compile_s']:.0f}"]


def render(records: list[dict]) -> list[str]:
    env = env_of(records)
    rows = [row(r, env) for r in good(of_stage(records, "training"))]
    if not rows:
        return []
    return (["MFU = flops_per_token (6N + 12·L·H·D·S, no remat recompute) x tokens/s / the bf16 "
             "peak in the environment section (* where the device is not in the peak table: / the "
             "bf16 matmul the env stage measured). Median of the timed steps, each synchronised.", ""]
            + table(["run", "params", "tokens/step", "step ms", "tokens/s", "MFU", "loss", "compile s"],
                    rows))
