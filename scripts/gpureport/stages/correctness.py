"""Stage correctness: the Pallas kernels compiled for this device, forward and backward,
against fp32 references; the bar is twice the error of XLA computing in the same dtype."""
from __future__ import annotations

from gpureport.runner import Context, Item
from gpureport.tables import good, of_stage, table

TITLE = "Correctness on the device"
_OUTPUTS = {"flash attention": ("out", "dq", "dk", "dv"), "block-sparse matmul": ("y", "dx", "dblocks")}


def plan(ctx: Context):
    p = ctx.profile
    budget = p.budgets["correctness"]
    yield Item("flash attention", "benchlib.attention:correctness_cases",
               {"checks": list(p.attention_checks)}, timeout_s=budget, case_timeout_s=120, min_s=5)
    yield Item("block-sparse matmul", "benchlib.block_sparse:correctness_cases",
               {"checks": list(p.block_sparse_checks)}, timeout_s=budget, case_timeout_s=120, min_s=5)


def _cell(err: dict) -> str:
    mark = "" if err["ok"] else " **FAIL**"
    return f"{err['kernel']:.2e} / {err['naive']:.2e}{mark}"


def render(records: list[dict]) -> list[str]:
    lines = ["Each cell: max |error| vs the fp32 reference of the kernel / of XLA in the same "
             "dtype. A case passes when every kernel error is at most twice XLA's (+1e-3 of "
             "the output scale). Kernel calls: Mosaic GPU kernels compiled into the step (0 "
             "means the interpreter ran them).", ""]
    for kernel, outputs in _OUTPUTS.items():
        rows = []
        for r in good([r for r in of_stage(records, "correctness") if r["item"] == kernel]):
            res = r["result"]
            calls = res.get("kernel_calls", res.get("compiled_calls", res.get("triton_calls", "-")))
            rows.append([r["case"], *(_cell(res["errors"][o]) for o in outputs), calls,
                         "pass" if res["passed"] else "**FAIL**"])
        if rows:
            headers = ["case", *outputs, "kernel calls", "result"]
            lines += [f"**{kernel}**", ""] + table(headers, rows) + [""]
    return lines
