"""Everything a short GPU visit should measure, in one command that cannot be killed by any one
measurement: kernel correctness, kernel speed, training MFU, memory, offload, autocast.

    PYTHONPATH=. python scripts/gpu_report.py --out $OUT                       # on the GPU, < 9 min
    PYTHONPATH=. python scripts/gpu_report.py --out $OUT --stages offload,autocast   # a second call
    PYTHONPATH=. python scripts/gpu_report.py --quick --out /tmp/gpu_report    # CPU smoke test
    python scripts/gpu_report.py --render run1/results.jsonl run2/results.jsonl --out merged/

Every item runs in its own process (an OOM, a compiler crash or a hang costs that item), within
its stage's time budget and the run's time limit; each record is written to ``--out`` as soon
as it exists: report.md, report.json, results.jsonl, errors.log, progress.log, nvidia-smi.txt.
``--quick`` runs every stage on tiny shapes on the CPU (the Pallas kernels interpreted). How to
run it on the GPU machine and what each stage measures: docs/gpu_report.md.
"""
from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import json
import os
import platform
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parent
REPO = SCRIPTS.parent
for _path in (str(REPO), str(SCRIPTS)):  # zeroflow and benchlib, however this file is started
    if _path not in sys.path:
        sys.path.insert(0, _path)

from gpureport import files, render  # noqa: E402
from gpureport.profiles import PROFILES, STAGE_ORDER  # noqa: E402
from gpureport.runner import Context, Runner  # noqa: E402
from gpureport.stages import STAGES  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__.split("\n\n", 1)[1])
    parser.add_argument("--out", type=Path, required=True, help="folder for the report files")
    parser.add_argument("--quick", action="store_true", help="tiny shapes on the CPU (smoke test)")
    parser.add_argument("--stages", default="all",
                        help=f"comma-separated stages to run (env always runs first); any of {', '.join(STAGE_ORDER)}")
    parser.add_argument("--items", default=None, help="only items whose name matches this regex")
    parser.add_argument("--time-limit", type=float, default=None,
                        help="seconds for the whole run (default: the profile's, 540 on the GPU)")
    parser.add_argument("--budget", action="append", default=[], metavar="STAGE=SECONDS",
                        help="override one stage's time budget (repeatable)")
    parser.add_argument("--allow-cpu", action="store_true", help="run the full profile without a GPU")
    parser.add_argument("--render", nargs="+", type=Path, metavar="RESULTS_JSONL",
                        help="do not measure: render these results.jsonl files (merged) into --out")
    args = parser.parse_args(argv)
    try:
        args.stage_list = _stages(args.stages)
        args.budgets = _budgets(args.budget)
    except ValueError as err:
        parser.error(str(err))
    return args


def _stages(text: str) -> list[str]:
    wanted = STAGE_ORDER if text == "all" else [s.strip() for s in text.split(",") if s.strip()]
    unknown = [s for s in wanted if s not in STAGE_ORDER]
    if unknown:
        raise ValueError(f"unknown stage(s) {', '.join(unknown)}; choose from all, {', '.join(STAGE_ORDER)}")
    return [s for s in STAGE_ORDER if s == "env" or s in wanted]


def _budgets(pairs: list[str]) -> dict[str, float]:
    out = {}
    for pair in pairs:
        stage, _, seconds = pair.partition("=")
        if stage not in STAGE_ORDER:
            raise ValueError(f"--budget {pair!r}: unknown stage {stage!r}; choose from {', '.join(STAGE_ORDER)}")
        try:
            out[stage] = float(seconds)
        except ValueError:
            raise ValueError(f"--budget {pair!r}: seconds must be a number, e.g. offload=300") from None
    return out


# --------------------------------------------------------------------------- host facts
def _run(cmd: list[str], cwd: Path = REPO) -> str | None:
    try:
        done = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def _meminfo() -> dict[str, int]:
    try:
        lines = Path("/proc/meminfo").read_text().splitlines()
    except OSError:
        return {}
    fields = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in lines if line.endswith("kB")}
    return {"mem_total_bytes": fields.get("MemTotal"), "mem_available_bytes": fields.get("MemAvailable")}


def host_metadata(args, profile) -> tuple[dict, str | None]:
    """Facts about the host (never touching the GPU) and the full nvidia-smi output."""
    git = None
    if (REPO / ".git").exists():
        commit = _run(["git", "rev-parse", "--short=12", "HEAD"])
        dirty = _run(["git", "status", "--porcelain"])
        git = commit and f"{commit}{' (with uncommitted changes)' if dirty else ''}"
    smi_full = _run(["nvidia-smi"])
    smi = _run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version,power.limit,clocks.max.sm",
                "--format=csv,noheader"])
    versions = {}
    for name in ("jax", "jaxlib", "flax", "optax"):
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = None
    meta = {"started": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "command": shlex.join(["python", "scripts/gpu_report.py", *sys.argv[1:]]),
            "profile": profile.name, "stages": args.stage_list, "time_limit_s": args.time_limit,
            "git": git, "python": platform.python_version(), "cpu_count": os.cpu_count(),
            "nvidia_smi": smi, "versions": versions, **_meminfo()}
    return meta, smi_full


# --------------------------------------------------------------------------- the run
def _gpu_missing(records: list[dict]) -> str | None:
    env = render.env_result(records)
    if env is None:
        return "the environment stage failed (see errors.log)"
    if env["backend"] != "gpu":
        return f"no GPU: jax's backend is {env['backend']!r}; use --quick on a CPU (or --allow-cpu)"
    return None


def run(args) -> int:
    profile = PROFILES["quick" if args.quick else "full"]
    args.time_limit = args.time_limit or profile.time_limit_s
    deadline = time.monotonic() + args.time_limit
    child_base = dict(os.environ)
    os.environ["JAX_PLATFORMS"] = "cpu"  # this process must never take the GPU from its children
    report = files.ReportFiles(args.out, render.render, render.summarize)
    meta, smi_full = host_metadata(args, profile)
    report.write_text(files.NVIDIA_SMI, smi_full or "nvidia-smi not available\n")
    report.add({"stage": render.META, "item": "run", "case": "", "status": "ok", "seconds": 0.0,
                "elapsed_s": 0.0, "result": meta, "error": None, "note": None, "attempt": 1})
    workdir = Path(tempfile.mkdtemp(prefix="gpu_report_"))
    runner = Runner(report.add, report.log, deadline=deadline, workdir=workdir,
                    child_vars=profile.child_vars, base_env=child_base, item_filter=args.items)
    ctx = Context(profile=profile, host=meta, records=report.records)
    try:
        for name in args.stage_list:
            budget = args.budgets.get(name, profile.budgets[name])
            if name != "env" and not args.quick and not args.allow_cpu and (why := _gpu_missing(report.records)):
                report.add({"stage": name, "item": "(stage)", "case": "", "status": "skipped", "seconds": 0.0,
                            "elapsed_s": 0.0, "result": None, "error": None, "note": why, "attempt": 1})
                continue
            runner.run_stage(name, STAGES[name].plan, ctx, budget)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    for target in render.summarize(report.records)["targets"]:
        report.log(f"target: {target['name']}: {target['value']} (goal {target['goal']})")
    left = render.remaining_stages(report.records)
    if left:
        report.log(f"left for another call: --stages {','.join(left)}")
    report.log(f"wrote {args.out}/{files.REPORT_MD} and {files.REPORT_JSON}, {files.RESULTS}")
    return 0


def rerender(args) -> int:
    """Merge results.jsonl files (e.g. of a first call and of a second one for the stages it
    left) and write the report files from them; nothing is measured."""
    records = files.read_records(args.render)
    args.out.mkdir(parents=True, exist_ok=True)
    files.write_atomic(args.out / files.RESULTS, "".join(json.dumps(r) + "\n" for r in records))
    files.write_atomic(args.out / files.REPORT_MD, render.render(records))
    files.write_atomic(args.out / files.REPORT_JSON, json.dumps(render.summarize(records), indent=1))
    print(f"rendered {len(records)} records from {len(args.render)} file(s) into {args.out}")
    return 0


def main(argv=None) -> int:
    args = parse_args(argv)
    return rerender(args) if args.render else run(args)


if __name__ == "__main__":
    sys.exit(main())
