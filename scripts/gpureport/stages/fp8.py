"""Stage fp8: what FP8 buys on this GPU, each figure next to its bf16 baseline from the same
process: an e4m3 GEMM against bf16 ``jnp.dot``; the trainer's GPT step with bf16 weights under
``precision.autocast=bf16`` against ``fp8`` (current, then delayed scaling), timed interleaved;
and the allocated peak with saved activations in e4m3 (``model.remat_dtype=fp8``) against the
compute dtype (one process each, so that each peak is its own). On a GPU without FP8 tensor
cores every item is "not applicable"."""
from __future__ import annotations

import copy
import types

from gpureport.runner import Context, Item, Summary
from gpureport.stages.training import gpt_item
from gpureport.tables import good, num, of_stage, params, size, table

TITLE = "FP8"
GEMM, STEP, SAVED = "fp8 GEMM", "fp8 step", "fp8 saved activations"
NOT_APPLICABLE = "not applicable: "
"How the note of a stage skipped for its GPU starts (targets show it as the value)."


def not_applicable(env: dict | None) -> str | None:
    """Why the GPU of the env record has no FP8 matmuls, else None (a CPU computes with the
    float8 types, so the smoke test runs every item). The compute capability's check is
    ``zeroflow.autocast.fp8``'s; a record without one falls back to the accelerator table."""
    if not env or env.get("backend") != "gpu":
        return None
    from zeroflow.autocast import fp8
    from zeroflow.backend import accelerators
    if env.get("compute_capability"):
        device = types.SimpleNamespace(platform="gpu", device_kind=env.get("device_kind", "this GPU"),
                                       compute_capability=env["compute_capability"])
        return fp8.device_problem(device)
    kind = env.get("device_kind") or ""
    known = accelerators.of_kind(kind)
    if known is not None and known.fp8_flops is None:
        return f"{kind} has no FP8 tensor cores (zeroflow/backend/accelerators.py)"
    return None


def saved_spec(base: dict, remat_dtype: str) -> dict:
    """``base`` with its saved activations in ``remat_dtype``; 'compute' leaves the spec as it
    is, so that its key is the training stage's run of the same configuration (reused)."""
    spec = copy.deepcopy(base)
    if remat_dtype != "compute":
        spec["model"]["remat_dtype"] = remat_dtype
    return spec


def plan(ctx: Context):
    """In priority order: the GEMM (seconds), the step (the headline), the saved activations."""
    problem = not_applicable(ctx.env())
    if problem:
        yield Summary("fp8", status="unavailable", note=NOT_APPLICABLE + problem)
        return
    settings, budget = ctx.profile.fp8, ctx.profile.budgets["fp8"]
    yield Item(f"{GEMM} {settings['gemm']['size']}^3", "benchlib.fp8:gemm_cases", settings["gemm"],
               timeout_s=min(budget, 120), case_timeout_s=min(budget, 90), min_s=min(15.0, budget / 4))
    # The headline may run past the stage's budget (up to the run's limit): on a first call the
    # stages after this one are left for the second call anyway.
    yield Item(STEP, "benchlib.fp8:step_cases", settings["step"], timeout_s=min(2 * budget, 300),
               case_timeout_s=min(2 * budget, 290), min_s=min(45.0, budget / 3))
    for remat_dtype in settings["saved"]["remat_dtypes"]:
        spec = saved_spec(settings["saved"]["base"], remat_dtype)
        yield gpt_item(f"{SAVED} {spec['model']['remat']}/{remat_dtype}", spec, budget)


def _results(records: list[dict], prefix: str) -> list[tuple[dict, dict]]:
    return [(r, r["result"]) for r in good(of_stage(records, "fp8")) if r["item"].startswith(prefix)]


def gemm_rows(records: list[dict]) -> list[dict]:
    """One row per GEMM measurement: size, pass, and each implementation's ms / TFLOP/s /
    speed-up over bf16."""
    return [res for _, res in _results(records, GEMM) if "bf16" in res]


def step_result(records: list[dict]) -> dict | None:
    """The step item's comparisons (the baseline against one variant each) as one result: the
    baseline's row from the first, each variant's (its speed-up over the baseline timed in the
    same rounds) from its own."""
    found = [res for _, res in _results(records, STEP) if "variants" in res]
    if not found:
        return None
    merged = {**found[0], "variants": dict(found[0]["variants"])}
    for res in found[1:]:
        merged["variants"].update({label: var for label, var in res["variants"].items()
                                   if label != res["baseline"]})
    peaks = [res.get("allocated_peak_all") for res in found if res.get("allocated_peak_all")]
    merged["allocated_peak_all"] = max(peaks, default=None)
    return merged


def _compiled_total(row: dict) -> float | None:
    return (row["memory"].get("compiled") or {}).get("total_bytes")


def saved_rows(records: list[dict]) -> list[dict]:
    """The saved-activation runs with ``peak_ratio`` (allocated peak) and ``compiled_ratio``
    (XLA's compiled total), each / the compute-dtype run's."""
    rows = [{**res, "item": r["item"]} for r, res in _results(records, SAVED) if "memory" in res]
    base = next((row for row in rows if row["item"].endswith("/compute")), None)
    for row in rows:
        for key, value in (("peak_ratio", lambda r: r["memory"].get("allocated_peak")),
                           ("compiled_ratio", _compiled_total)):
            own, theirs = value(row), base and value(base)
            row[key] = own / theirs if own and theirs else None
    return rows


def not_applicable_note(records: list[dict]) -> str | None:
    """The stage's "not applicable: why", from the plan (the env record's GPU) or from a child
    that found its device without FP8 matmuls."""
    for r in of_stage(records, "fp8"):
        if (r.get("note") or "").startswith(NOT_APPLICABLE):
            return r["note"]
        if r["status"] == "ok" and (r.get("result") or {}).get("not_applicable"):
            return NOT_APPLICABLE + r["result"]["not_applicable"]
    return None


def _gemm_table(records: list[dict]) -> list[str]:
    rows = []
    for res in gemm_rows(records):
        for impl in ("e4m3", "scaled_dot"):
            if impl in res:
                got = res[impl]
                rows.append([f"{res['size']}^3", res["pass"], impl, f"{res['bf16']['ms']:.3f}",
                             f"{got['ms']:.3f}", f"{res['bf16']['tflops']:.1f}", f"{got['tflops']:.1f}",
                             f"{got['speedup']:.2f}x"])
    if not rows:
        return []
    return (["**FP8 GEMM** vs bf16 `jnp.dot`, interleaved in one process (median): `e4m3` the "
             "product of operands already in e4m3 (the FP8 GEMM alone), `scaled_dot` "
             "`zeroflow.autocast.fp8.scaled_dot` from bf16 operands (amax, scale and cast "
             "included; fwd+bwd: e5m2 gradient x e4m3 GEMMs)", ""]
            + table(["shape", "pass", "fp8", "bf16 ms", "fp8 ms", "bf16 TFLOP/s", "fp8 TFLOP/s",
                     "vs bf16"], rows) + [""])


def _step_table(records: list[dict]) -> list[str]:
    res = step_result(records)
    if res is None:
        return []
    rows = []
    for label, var in res["variants"].items():
        loss = f"{var['loss']:.3f}" + ("" if var["loss_finite"] else " **not finite**")
        low, high = var["speedup_iqr"]
        rows.append([label, f"{var['tokens_per_s']:,.0f}", f"{var['step_s'] * 1e3:.1f}",
                     f"{var['speedup']:.2f}x", f"{low:.2f}-{high:.2f}",
                     f"{var['gemms']['fp8']}/{var['gemms']['other']}",
                     size((var.get("compiled") or {}).get("temp_bytes")), loss])
    return ([f"**FP8 step**: the trainer's GPT ({params(res['params'])} parameters, "
             f"{res['tokens_per_step']:,} tokens per step, bf16 weights) under each precision, "
             f"one process, {res['baseline']} against each variant in turn, one step of each "
             f"per round ({res['steps']} rounds, medians); the variants share a train state "
             f"where its layout is the same. Allocated peak of the process (all variants): "
             f"{size(res.get('allocated_peak_all'))}.", ""]
            + table(["precision", "tokens/s", "step ms", f"vs {res['baseline']}", "round IQR",
                     "GEMMs fp8/other (XLA:GPU)", "XLA temp", "loss"], rows) + [""])


def _saved_table(records: list[dict]) -> list[str]:
    rows = [[row["item"].removeprefix(SAVED + " "), params(row["params"]),
             size(row["memory"].get("allocated_peak")), num(row["peak_ratio"], "{:.2f}x"),
             size(_compiled_total(row)), num(row["compiled_ratio"], "{:.2f}x"),
             num(row["tokens_per_s"], "{:,.0f}"), f"{row['loss']:.3f}"] for row in saved_rows(records)]
    if not rows:
        return []
    return (["**Saved activations in FP8** (`model.remat_dtype`, bf16 weights; one process each: "
             "the allocator's peak is that configuration's; XLA compiled: its memory analysis, "
             "arguments + outputs + temporaries - aliased)", ""]
            + table(["remat/saved dtype", "params", "allocated peak", "vs compute dtype",
                     "XLA compiled", "vs compute dtype", "tokens/s", "loss"], rows) + [""])


def render(records: list[dict]) -> list[str]:
    note = not_applicable_note(records)
    head = [f"_{note[0].upper()}{note[1:]}._", ""] if note else []
    return head + _gemm_table(records) + _step_table(records) + _saved_table(records)
