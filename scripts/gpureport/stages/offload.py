"""Stage offload: step time with the optimizer state in host memory (update on the device or on
the host) against no offload, and the largest GPT that trains on this device with and without
offload (a search over layers at fixed width, one process per probe)."""
from __future__ import annotations

import copy

from benchlib import gpt
from benchlib.search import layer_search, predicted_max_layers
from gpureport.runner import Context, Item, Outcome, Summary
from gpureport.stages.training import gpt_item
from gpureport.tables import good, num, of_stage, params, size, table

TITLE = "Offload"
RATIO, LARGEST = "ratio", "largest"


def _with(spec: dict, offload: str, update_on: str, layers: int | None = None) -> dict:
    out = copy.deepcopy(spec)
    out["offload"], out["update_on"] = offload, update_on if offload != "none" else "device"
    if layers is not None:
        out["model"]["num_layers"] = layers
    return out


def plan(ctx: Context):
    p = ctx.profile
    budget = p.budgets["offload"]
    for offload, update_on in p.offload_ratio["choices"]:
        yield gpt_item(f"{RATIO} {offload}/{update_on}", _with(p.offload_ratio["base"], offload, update_on),
                       budget)
    for offload, update_on in p.largest["searches"]:
        yield from _largest(ctx, offload, update_on)


def _limits(ctx: Context) -> tuple[float, float | None]:
    """(device bytes, host bytes) a probe may use."""
    settings = ctx.profile.largest
    if settings["fit_by"] == "compile":
        return settings["compile_budget"], None
    env = ctx.env() or {}
    host = ctx.host.get("mem_available_bytes")
    return (env.get("bytes_limit") or ctx.profile.device_memory,
            host * settings["host_memory_fraction"] if host else None)


def _verdict(outcome: Outcome, fit_by: str) -> bool | None:
    if outcome.status == "oom":
        return False
    if outcome.status != "ok":
        return None
    return bool(outcome.result["fits"]) if fit_by == "compile" else True


def _largest(ctx: Context, offload: str, update_on: str):
    settings = ctx.profile.largest
    name = f"{LARGEST} {offload}/{update_on}"
    base = _with(settings["base"], offload, update_on)
    device_bytes, host_bytes = _limits(ctx)
    estimate_at = lambda layers: gpt.estimate(_with(base, offload, update_on, layers))  # noqa: E731
    max_layers = settings["max_layers"]
    host_cap = max_layers
    if host_bytes is not None:  # never probe a model whose host state would not fit the host
        host_cap = predicted_max_layers(estimate_at, device_bytes=float("inf"), host_bytes=host_bytes,
                                        max_layers=max_layers)
    predicted = predicted_max_layers(estimate_at, device_bytes=device_bytes, host_bytes=host_bytes,
                                     max_layers=max_layers)
    search = layer_search(max(predicted, 1), max_layers=max(host_cap, 1), max_probes=settings["max_probes"])
    budget = ctx.profile.budgets["offload"]
    layers = next(search)
    while True:
        spec = _with(base, offload, update_on, layers)
        if settings["fit_by"] == "compile":
            item = Item(f"{name} L={layers}", "benchlib.gpt:compile_fit_case",
                        {"device_budget": device_bytes, **spec}, timeout_s=min(budget, 300), min_s=2)
        else:
            item = Item(f"{name} L={layers}", "benchlib.gpt:train_case", spec, timeout_s=min(budget, 300),
                        case_timeout_s=min(budget, 290), min_s=min(40.0, budget / 4))
        outcome = yield item
        try:
            layers = search.send(_verdict(outcome, settings["fit_by"]))
        except StopIteration as stop:
            found = stop.value
            break
    def params_at(layers):
        return gpt.num_params(_with(base, offload, update_on, layers)) if layers else None

    yield Summary(name, {
        **found, "offload": offload, "update_on": update_on, "fit_by": settings["fit_by"],
        "largest_params": params_at(found["largest_fits"]) or 0,
        "smallest_fail_params": params_at(found["smallest_fails"]),
        "predicted_layers": predicted, "host_cap_layers": host_cap if host_bytes is not None else None,
        "device_bytes": device_bytes, "host_bytes": host_bytes,
        "width": base["model"]["embed_dim"]})


def ratio_rows(records: list[dict]) -> list[dict]:
    """Ratio items' results with ``ratio`` = step time / the first (no offload) one's."""
    results = [{**r["result"], "item": r["item"]} for r in good(of_stage(records, "offload"))
               if r["item"].startswith(RATIO + " ") and "step_s" in r["result"]]
    base = next((res["step_s"] for res in results if res["item"] == f"{RATIO} none/device"), None)
    return [{**res, "ratio": res["step_s"] / base if base and res["step_s"] else None} for res in results]


def largest_rows(records: list[dict]) -> list[dict]:
    return [r["result"] for r in good(of_stage(records, "offload"))
            if r["item"].startswith(LARGEST + " ") and "largest_fits" in r["result"]]


def render(records: list[dict]) -> list[str]:
    lines = []
    rows = [[res["item"].removeprefix(RATIO + " "), params(res["params"]), num(res["step_s"], "{:.3f}"),
             num(res["ratio"], "{:.2f}x"), num(res["tokens_per_s"], "{:,.0f}"), f"{res['loss']:.3f}"]
            for res in ratio_rows(records)]
    if rows:
        lines += ["**Step time with offload** (median step; ratio to no offload)", ""]
        lines += table(["offload/update_on", "params", "step s", "vs none", "tokens/s", "loss"], rows)
        lines += [""]
    rows = []
    for res in largest_rows(records):
        fail = (f"{res['smallest_fails']} ({params(res['smallest_fail_params'])})"
                if res["smallest_fails"] else "none up to the limit")
        over = "OOM" if res["fit_by"] == "run" else "over"
        probes = ", ".join(f"{layers}:{'fits' if v else over if v is False else 'failed'}"
                           for layers, v in res["probes"])
        capped = res["smallest_fails"] is None and res.get("host_cap_layers") == res["largest_fits"]
        note = res.get("stopped") or ("host memory limit: no larger model probed" if capped else "")
        fits = f"{res['largest_fits']} ({params(res['largest_params'])})"
        choice = f"{res['offload']}/{res['update_on']}"
        rows.append([choice, fits, fail, res["predicted_layers"], probes, note])
    if rows:
        first = largest_rows(records)[0]
        if first["fit_by"] == "run":
            title = f"**Largest GPT that trains** (width {first['width']}; fits = two real steps ran)"
        else:
            title = (f"**Largest GPT that fits** (width {first['width']}; by XLA's memory analysis "
                     f"against {size(first['device_bytes'])}: a CPU smoke test)")
        headers = ["offload/update_on", "largest that fit (params)", "smallest that did not",
                   "estimator's guess", "probes (layers: verdict)", "note"]
        lines += [title, ""] + table(headers, rows)
    return lines
