"""One report run: host facts first, then each selected stage through the runner, then the
targets and what is left for another call. Shared by gpu_report.py, bench_kernels.py and
bench_offload.py (which run single stages with their own sizes)."""
from __future__ import annotations

import dataclasses
import datetime
import importlib.metadata
import os
import platform
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

from benchlib.isolate import REPO_ROOT
from gpureport import files, render
from gpureport.profiles import STAGE_ORDER, Profile
from gpureport.runner import Context, Runner
from gpureport.stages import STAGES


@dataclasses.dataclass(frozen=True)
class RunOptions:
    out: Path
    command: str
    "As typed, for the report's header."
    stages: tuple[str, ...] = STAGE_ORDER
    time_limit_s: float | None = None
    "Default: the profile's."
    items: str | None = None
    "Only items whose name matches this regex."
    budgets: dict = dataclasses.field(default_factory=dict)
    "Per-stage overrides of the profile's budgets, in seconds."
    require_gpu: bool = True
    "Skip every stage after env when jax sees no GPU."
    timeout_scale: float = 1.0
    "Multiplies every item's and case's time limit (``Runner``)."


def _run(cmd: list[str]) -> str | None:
    try:
        done = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def _meminfo() -> dict[str, int | None]:
    try:
        lines = Path("/proc/meminfo").read_text().splitlines()
    except OSError:
        return {}
    fields = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in lines if line.endswith("kB")}
    return {"mem_total_bytes": fields.get("MemTotal"), "mem_available_bytes": fields.get("MemAvailable")}


def _versions() -> dict[str, str | None]:
    out = {}
    for name in ("jax", "jaxlib", "flax", "optax"):
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = None
    return out


def host_metadata(profile: Profile, options: RunOptions, time_limit_s: float) -> tuple[dict, str | None]:
    """Facts about the host, read without touching the GPU, and the full nvidia-smi output. The
    tree on the GPU machine is a copy that may have no .git: then git is None."""
    git = None
    if (REPO_ROOT / ".git").exists():
        commit = _run(["git", "rev-parse", "--short=12", "HEAD"])
        dirty = _run(["git", "status", "--porcelain"])
        git = commit and f"{commit}{' (with uncommitted changes)' if dirty else ''}"
    smi = _run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version,power.limit,clocks.max.sm",
                "--format=csv,noheader"])
    meta = {"started": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "command": options.command, "profile": profile.name, "stages": list(options.stages),
            "time_limit_s": time_limit_s, "git": git, "python": platform.python_version(),
            "cpu_count": os.cpu_count(), "nvidia_smi": smi, "versions": _versions(), **_meminfo()}
    return meta, _run(["nvidia-smi"])


def _gpu_missing(records: list[dict]) -> str | None:
    env = render.env_result(records)
    if env is None:
        return "the environment stage failed (see errors.log)"
    if env["backend"] != "gpu":
        return f"no GPU: jax's backend is {env['backend']!r}; use --quick on a CPU (or --allow-cpu)"
    return None


def _parent_record(stage: str, item: str, status: str, *, result=None, note=None) -> dict:
    return {"stage": stage, "item": item, "case": "", "status": status, "seconds": 0.0, "elapsed_s": 0.0,
            "result": result, "error": None, "note": note, "attempt": 1}


def run_report(profile: Profile, options: RunOptions) -> list[dict]:
    """Run the stages of ``options`` (env first) and return every record; the files under
    ``options.out`` are current after each record."""
    time_limit = options.time_limit_s or profile.time_limit_s
    deadline = time.monotonic() + time_limit
    child_base = dict(os.environ)
    os.environ["JAX_PLATFORMS"] = "cpu"  # this process must never take the GPU from its children
    report = files.ReportFiles(options.out, render.render, render.summarize)
    meta, smi_full = host_metadata(profile, options, time_limit)
    report.write_text(files.NVIDIA_SMI, smi_full or "nvidia-smi not available\n")
    report.add(_parent_record(render.META, "run", "ok", result=meta))
    workdir = Path(tempfile.mkdtemp(prefix="gpu_report_"))
    runner = Runner(report.add, report.log, deadline=deadline, workdir=workdir,
                    child_vars=profile.child_vars, base_env=child_base, item_filter=options.items,
                    timeout_scale=options.timeout_scale)
    ctx = Context(profile=profile, host=meta, records=report.records, stages=tuple(options.stages))
    try:
        for name in [s for s in STAGE_ORDER if s == "env" or s in options.stages]:
            if name != "env" and options.require_gpu and (why := _gpu_missing(report.records)):
                report.add(_parent_record(name, "(stage)", "skipped", note=why))
                continue
            runner.run_stage(name, STAGES[name].plan, ctx, options.budgets.get(name, profile.budgets[name]))
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    for target in render.summarize(report.records)["targets"]:
        report.log(f"target: {target['name']}: {target['value']} (goal {target['goal']})")
    report.log(f"wrote {options.out}/{files.REPORT_MD}, {files.REPORT_JSON} and {files.RESULTS}")
    command = render.next_command(report.records)
    if command:  # the last line of the output, where a truncated console log still shows it
        report.log(f"left for another call: {command}")
    return report.records
