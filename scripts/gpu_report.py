"""Every GPU measurement zeroflow reports, in one command that no single measurement can bring
down: kernel correctness, kernel speed, training MFU, FP8 speed, memory, offload, autocast.

    PYTHONPATH=. python scripts/gpu_report.py --out $OUT                       # on a GPU, < 9 min
    PYTHONPATH=. python scripts/gpu_report.py --out $OUT --stages offload,autocast   # what a run left
    PYTHONPATH=. python scripts/gpu_report.py --quick --out /tmp/gpu_report    # CPU smoke test
    python scripts/gpu_report.py --render run1/results.jsonl run2/results.jsonl --out merged/ \
        --measured-doc docs/measured.md                   # merged, and into the docs

Every item runs in its own process (an OOM, a compiler crash or a hang costs that item), within
its stage's time budget and the run's time limit; each record is written to ``--out`` as soon
as it exists: report.md, report.json, results.jsonl, errors.log, progress.log, nvidia-smi.txt.
``--quick`` runs every stage on tiny shapes on the CPU (the Pallas kernels interpreted). How to
run it on the GPU machine and what each stage measures: docs/gpu_report.md.
"""
from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parent
REPO = SCRIPTS.parent
for _path in (str(REPO), str(SCRIPTS)):  # zeroflow and benchlib, however this file is started
    if _path not in sys.path:
        sys.path.insert(0, _path)

from zeroflow.cli.common import start_script  # noqa: E402

start_script()  # before jax: where the CUDA plugin has no driver, a CPU jax without its noise

from gpureport import files, render  # noqa: E402
from gpureport.profiles import PROFILES, STAGE_ORDER  # noqa: E402
from gpureport.session import RunOptions, run_report  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog=__doc__.split("\n\n", 1)[1])
    parser.add_argument("--out", type=Path, required=True, help="folder for the report files")
    parser.add_argument("--quick", action="store_true", help="tiny shapes on the CPU (smoke test)")
    parser.add_argument("--stages", default="all",
                        help="comma-separated stages to run (env always runs first); any of "
                             + ", ".join(STAGE_ORDER))
    parser.add_argument("--items", default=None, help="only items whose name matches this regex")
    parser.add_argument("--time-limit", type=float, default=None,
                        help="seconds for the whole run (default: the profile's, 540 on the GPU)")
    parser.add_argument("--budget", action="append", default=[], metavar="STAGE=SECONDS",
                        help="override one stage's time budget (repeatable)")
    parser.add_argument("--timeout-scale", type=float, default=1.0, metavar="FACTOR",
                        help="multiply every item's and case's time limit (e.g. 100 on a busy "
                             "machine, so that load never turns an item into a timeout)")
    parser.add_argument("--allow-cpu", action="store_true", help="run the full profile without a GPU")
    parser.add_argument("--measured-doc", default=None, metavar="PATH",
                        help="rewrite this markdown file's '## GPU' section with the device, the "
                             "command, the targets and the kernel tables (default: docs/measured.md "
                             "after a full run on a GPU, else nothing; 'none': never)")
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
        raise ValueError(f"unknown stage(s) {', '.join(unknown)}; "
                         f"choose from all, {', '.join(STAGE_ORDER)}")
    return [s for s in STAGE_ORDER if s == "env" or s in wanted]


def _budgets(pairs: list[str]) -> dict[str, float]:
    out = {}
    for pair in pairs:
        stage, _, seconds = pair.partition("=")
        if stage not in STAGE_ORDER:
            raise ValueError(f"--budget {pair!r}: unknown stage {stage!r}; "
                             f"choose from {', '.join(STAGE_ORDER)}")
        try:
            out[stage] = float(seconds)
        except ValueError:
            raise ValueError(f"--budget {pair!r}: seconds must be a number, e.g. offload=300") from None
    return out


def run(args) -> int:
    profile = PROFILES["quick" if args.quick else "full"]
    command = shlex.join(["python", "scripts/gpu_report.py", *sys.argv[1:]])
    options = RunOptions(out=args.out, command=command, stages=tuple(args.stage_list),
                         time_limit_s=args.time_limit, items=args.items, budgets=args.budgets,
                         require_gpu=not (args.quick or args.allow_cpu),
                         timeout_scale=args.timeout_scale)
    records = run_report(profile, options)
    update_measured_doc(args, records)
    return 0


def measured_doc(args, records: list[dict]) -> Path | None:
    """Where the GPU section goes: the path given, else docs/measured.md when these records are
    a full measuring run on a GPU (a smoke test or a merge never touches the docs unasked)."""
    if args.measured_doc == "none":
        return None
    if args.measured_doc:
        return Path(args.measured_doc)
    env = render.env_result(records) or {}
    if args.render or render.is_smoke_test(records) or env.get("backend") != "gpu":
        return None
    return REPO / "docs" / "measured.md"


def update_measured_doc(args, records: list[dict]) -> None:
    path = measured_doc(args, records)
    if path is None:
        return
    old = path.read_text() if path.exists() else "# Measured\n"
    files.write_atomic(path, files.replace_section(old, render.MEASURED_HEADING,
                                                   render.measured_section(records)))
    print(f"updated the {render.MEASURED_HEADING!r} section of {path}")


def rerender(args) -> int:
    """Merge results.jsonl files (e.g. of a first call and of a second one for the stages it
    left) and write the report files from them; nothing is measured."""
    records = files.read_records(args.render)
    args.out.mkdir(parents=True, exist_ok=True)
    files.write_atomic(args.out / files.RESULTS, "".join(json.dumps(r) + "\n" for r in records))
    files.write_atomic(args.out / files.REPORT_MD, render.render(records))
    files.write_atomic(args.out / files.REPORT_JSON, json.dumps(render.summarize(records), indent=1))
    print(f"rendered {len(records)} records from {len(args.render)} file(s) into {args.out}")
    update_measured_doc(args, records)
    return 0


def main(argv=None) -> int:
    args = parse_args(argv)
    return rerender(args) if args.render else run(args)


if __name__ == "__main__":
    sys.exit(main())
