"""Stage autocast: tokens/s of the same GPT with fp32 weights, fp32 weights under
``zf.Precision(autocast="bf16")`` (issue 12), and hand-written bf16 weights."""
from __future__ import annotations

import copy

from benchlib.gpt import spec_key
from gpureport.runner import Context, Item, Summary
from gpureport.tables import good, num, of_stage, table

TITLE = "Autocast"
UNAVAILABLE = "not available in this tree (zeroflow has no autocast)"


def autocast_available() -> bool:
    import zeroflow
    return hasattr(zeroflow, "autocast")


def plan(ctx: Context):
    if not autocast_available():
        yield Summary("autocast", status="unavailable", note=UNAVAILABLE)
        return
    budget = ctx.profile.budgets["autocast"]
    for label, params_dtype, autocast in ctx.profile.autocast["modes"]:
        spec = copy.deepcopy(ctx.profile.autocast["base"])
        spec["params"], spec["autocast"] = params_dtype, autocast
        yield Item(label, "benchlib.gpt:train_case", spec, key=spec_key(spec), timeout_s=min(budget, 300),
                   case_timeout_s=min(budget, 290), min_s=min(20.0, budget / 4))


def speedups(records: list[dict]) -> dict[str, dict]:
    """{label: result + vs_fp32 + vs_hand_bf16}."""
    results = {r["item"]: r["result"] for r in good(of_stage(records, "autocast"))
               if "tokens_per_s" in r["result"]}
    fp32 = results.get("fp32", {}).get("tokens_per_s")
    hand = results.get("hand bf16", {}).get("tokens_per_s")
    return {label: {**res, "vs_fp32": res["tokens_per_s"] / fp32 if fp32 else None,
                    "vs_hand_bf16": res["tokens_per_s"] / hand if hand else None}
            for label, res in results.items()}


def render(records: list[dict]) -> list[str]:
    rows = [[label, num(res["tokens_per_s"], "{:,.0f}"), num(res["vs_fp32"], "{:.2f}x"),
             num(res["vs_hand_bf16"], "{:.2f}x"), f"{res['loss']:.3f}",
             res.get("matmul_precision") or "default"]
            for label, res in speedups(records).items()]
    if not rows:
        return []
    return (["Same GPT, same batch; issue 12's goal on a GPU: autocast >= 1.4x fp32 and >= 0.95x "
             "hand bf16.", ""]
            + table(["mode", "tokens/s", "vs fp32", "vs hand bf16", "loss", "fp32 matmul precision"], rows))
