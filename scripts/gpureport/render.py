"""The markdown report and the JSON summary, both rebuilt from the records alone (so that the
records of several runs can be merged and rendered again: ``gpu_report.py --render``)."""
from __future__ import annotations

import dataclasses
import re
import shlex

from gpureport import targets
from gpureport.profiles import PROFILES, STAGE_ORDER
from gpureport.runner import BUDGET_SKIP
from gpureport.stages import STAGES
from gpureport.tables import failure_lines, of_stage, table

META = "meta"


def metas(records: list[dict]) -> list[dict]:
    return [r["result"] for r in records if r["stage"] == META]


def env_result(records: list[dict]) -> dict | None:
    return next((r["result"] for r in records if r["stage"] == "env" and r["status"] == "ok"), None)


def latest(records: list[dict]) -> list[dict]:
    """The last record of each (stage, item, case), in the order they were last written: when
    runs are merged, a later measurement replaces an earlier one (or its skip)."""
    out: dict[tuple, dict] = {}
    for i, r in enumerate(records):
        key = (r["stage"], r["item"], r["case"]) if r["stage"] != META else (META, i)
        out.pop(key, None)
        out[key] = r
    return list(out.values())


def _left_for_later(records: list[dict]) -> list[dict]:
    return [r for r in latest(records) if r["stage"] not in (META, "env") and r["status"] == "skipped"
            and (r.get("note") or "").startswith(BUDGET_SKIP)]


def remaining_stages(records: list[dict]) -> list[str]:
    """Stages with an item whose latest record says it was skipped for lack of time, in run
    order: what a second call should run."""
    pending = {r["stage"] for r in _left_for_later(records)}
    return [s for s in STAGE_ORDER if s in pending]


def next_command(records: list[dict]) -> str | None:
    """The call that measures exactly what was skipped for lack of time (a search's probes are
    selected by the search's name, since the next call picks its own layer counts)."""
    stages = remaining_stages(records)
    if not stages:
        return None
    names = dict.fromkeys(re.sub(r" L=\d+$", "", r["item"]) for r in _left_for_later(records))
    pattern = "^(" + "|".join(re.escape(name) for name in names) + ")"
    return (f"PYTHONPATH=. python scripts/gpu_report.py --out $OUT --stages {','.join(stages)} "
            f"--items {shlex.quote(pattern)}{_budget_flags(records, stages)}")


def _budget_flags(records: list[dict], stages: list[str]) -> str:
    """Give the stages of the next call the whole time limit, shared as the profile shares it."""
    runs = metas(records)
    profile = PROFILES.get(runs[-1]["profile"]) if runs else None
    if profile is None:
        return ""
    spare = profile.time_limit_s - profile.budgets["env"] / 2  # env takes a few seconds
    scale = spare / sum(profile.budgets[s] for s in stages)
    if scale <= 1:
        return ""
    return "".join(f" --budget {s}={profile.budgets[s] * scale:.0f}" for s in stages)


def _header(records: list[dict]) -> list[str]:
    lines = ["# zeroflow GPU report", ""]
    for meta in metas(records):
        lines += [f"- run {meta['started']}: `{meta['command']}` (profile `{meta['profile']}`, "
                  f"stages {', '.join(meta['stages'])}, time limit {meta['time_limit_s']:.0f} s)",
                  f"  - git {meta.get('git') or 'not available (no .git in this tree)'}; python "
                  f"{meta['python']}; {meta['cpu_count']} CPU cores; host memory "
                  f"{meta.get('mem_total_bytes', 0) / 1e9:.0f} GB; "
                  f"nvidia-smi: {meta.get('nvidia_smi') or 'not available'}"]
    return lines + [""]


def is_smoke_test(records: list[dict]) -> bool:
    runs = metas(records)
    return bool(runs) and all(meta["profile"] == "quick" for meta in runs)


def _targets(records: list[dict]) -> list[str]:
    smoke = is_smoke_test(records)
    mark = {True: "met", False: "**not met**", None: "-"}
    rows = [[t.name, t.goal, t.value, "n/a (smoke test)" if smoke else mark[t.met]]
            for t in targets.evaluate(records)]
    note = (["**Quick profile: tiny shapes on a CPU, kernels interpreted. No number here says "
             "anything about speed; the report only shows that every stage runs.**", ""] if smoke else [])
    return ["## Targets", ""] + note + table(["target", "goal", "measured", "met"], rows) + [""]


def _section(name: str, records: list[dict]) -> list[str]:
    """The stage's section; none for a stage this run (or these merged runs) did not select."""
    own = of_stage(records, name)
    if not own:
        return []
    stage = STAGES[name]
    try:
        body = stage.render(records)
    except Exception as err:  # one stage's odd record must not cost the report
        body = [f"_Could not render this section: {type(err).__name__}: {err}_"]
    lines = [f"## {stage.TITLE}", ""] + body + [""]
    failures = failure_lines(own)
    if failures:
        lines += ["Not measured:", ""] + failures + [""]
    return lines


def render(records: list[dict]) -> str:
    records = latest(records)
    lines = _header(records) + _targets(records)
    for name in STAGE_ORDER:
        lines += _section(name, records)
    command = next_command(records)
    if command:
        lines += ["## Left for another call", "",
                  "Items were skipped for lack of time. On the GPU machine, run:", "", f"    {command}", "",
                  "then merge: `python scripts/gpu_report.py --render first/results.jsonl "
                  "second/results.jsonl --out experiments/results/gpu` (docs/gpu_report.md).", ""]
    return "\n".join(lines) + "\n"


def summarize(records: list[dict]) -> dict:
    """report.json: the targets and the next call are computed from the latest records; all
    records are kept."""
    current = latest(records)
    return {"meta": metas(records), "env": env_result(current),
            "targets": [dataclasses.asdict(t) for t in targets.evaluate(current)],
            "remaining_stages": remaining_stages(records), "next_command": next_command(records),
            "records": [r for r in records if r["stage"] != META]}


MEASURED_HEADING = "## GPU"
"The section of docs/measured.md that a report on a GPU rewrites (``measured_section``)."


def measured_section(records: list[dict]) -> list[str]:
    """docs/measured.md's GPU section from a report's records: device, date and command of each
    run, the targets, then the kernels' tables (our Mosaic GPU attention next to cuDNN's and
    XLA's, block-sparse against dense); the rest stays in the report's own files."""
    records = latest(records)
    env = env_result(records) or {}
    lines = [MEASURED_HEADING, ""]
    if is_smoke_test(records):
        lines += ["**Quick profile (tiny shapes on a CPU, kernels interpreted): these are not "
                  "speed figures.**", ""]
    lines += [f"Device: {env.get('device_kind', 'unknown')} x{env.get('device_count', '?')} "
              f"(jax {env.get('jax', '?')}, backend `{env.get('backend', '?')}`).", ""]
    lines += [f"- {meta['started'][:10]}: `{meta['command']}` (git {meta.get('git') or 'n/a'})"
              for meta in metas(records)]
    lines += ["", "### Targets", ""] + _targets(records)[2:]
    kernels = STAGES["kernels"].render(records) if of_stage(records, "kernels") else []
    lines += ["### Kernels", ""] + (kernels or ["_The kernels stage did not run._", ""])
    return lines + ["Training MFU, memory, offload and autocast: the run's own `report.md` "
                    "(`experiments/results/gpu/`, [docs/gpu_report.md](gpu_report.md)).", ""]

