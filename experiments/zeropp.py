"""ZeRO++ bytes per step, read from XLA:GPU programs compiled for two hosts of eight H100s.

Compiles the trainer's GPT step (``build_run``: AdamW, bf16 weights, fp32 master, one layer
gathered at a time) for ``zf.target_mesh("h100", data=16, hosts=2)`` at ZeRO stage 3, plain
with each ZeRO++ option alone (hpZ, qwZ, qgZ) and with all three, and reports per device and step the bytes its
collectives move inside its host and across hosts (``zf.memory.traffic``: every collective of
the scheduled program, loop bodies times their trip counts) and how many gathers and
reduce-scatters overlap compute. Activations are kept small (one 512-token sequence per
device): the bytes of weight gathers and gradient reductions do not depend on them.

    python experiments/zeropp.py            # writes experiments/results/zeropp.md

Nothing runs: the bytes are those of XLA's program, not timings.
"""
from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # the CUDA plugin describes targets only then

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import datetime  # noqa: E402
import platform  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

from zeroflow.cli.common import start_script  # noqa: E402

start_script()  # before jax: where the CUDA plugin has no driver, a CPU jax without its noise

import jax  # noqa: E402

import zeroflow as zf  # noqa: E402

RESULTS = Path(__file__).parent / "results" / "zeropp.md"
MiB = 2 ** 20
SMALL = ("model.attention=xla", "model.remat=full", "model.seq_len=512", "train.batch_size=16",
         "parallel.grad_accum=1", "parallel.zero_stage=3", "parallel.offload=none",
         "parallel.update_on=device")
HPZ, QWZ, QGZ = ("parallel.hierarchical=true",), ("parallel.quantize_weights=int8",), (
    "parallel.quantize_grads=int8",)
OPTIONS = {"stage 3": (), "+ hpZ": HPZ, "+ qwZ (int8, block 256)": QWZ,
           "+ qgZ (int8, block 256)": QGZ, "+ hpZ + qwZ + qgZ": HPZ + QWZ + QGZ}
"Rows per model: plain stage 3, each ZeRO++ option alone, all three."


def compile_row(config: str, label: str, overrides) -> dict:
    from zeroflow.config.io import load_config
    from zeroflow.trainer.setup import abstract_batch, build_run, run_model_config
    cfg = load_config(config, [*SMALL, *overrides])
    if cfg.model.init_from:  # only its config.json is read
        cfg = dataclasses.replace(cfg, model=run_model_config(cfg))
    start = time.perf_counter()
    run = build_run(cfg, with_data=False, mesh=zf.target_mesh("h100", data=16, hosts=2))
    state = run.abstract_state()
    compiled = run.make_step().lower(state, abstract_batch(cfg, run.plan.batch_sharding())).compile()
    colls = zf.memory.collectives(compiled)
    row = {"model": Path(config).stem, "option": label, "psi": zf.memory.count_gpt_params(cfg.model),
           "traffic": zf.memory.traffic(colls),
           "overlap": zf.memory.overlap(colls, ("all-gather", "reduce-scatter", "all-to-all")),
           "seconds": time.perf_counter() - start}
    print(_line(row, None), file=sys.stderr, flush=True)
    return row


def _line(r, base) -> str:
    t, o = r["traffic"], r["overlap"]
    cross = t["total"]["cross_host"]
    ratio = f"{cross / base:.2f}" if base else "1.00" if base is None else "-"
    mib = lambda kind, where: f"{t[kind][where] / MiB:,.0f}"  # noqa: E731
    grads = {w: (t["reduce-scatter"][w] + t["all-to-all"][w]) / MiB for w in ("within_host", "cross_host")}
    over = lambda k: f"{o[k]['overlapped']}/{o[k]['count']}"  # noqa: E731
    return (f"| {r['model']} | {r['option']} | {r['psi'] / 1e9:.2f}B | "
            f"{mib('all-gather', 'within_host')} | {mib('all-gather', 'cross_host')} | "
            f"{grads['within_host']:,.0f} | {grads['cross_host']:,.0f} | "
            f"{mib('collective-permute', 'cross_host')} | {t['total']['within_host'] / MiB:,.0f} | "
            f"{cross / MiB:,.0f} | {ratio} | {over('all-gather')} | {over('reduce-scatter')} | "
            f"{over('all-to-all')} |")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--configs", nargs="+",
                        default=["configs/gpt-1b.yaml", "configs/finetune-llama3-8b.yaml"])
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    rows = [compile_row(config, label, overrides) for config in args.configs
            for label, overrides in OPTIONS.items()]
    write(rows, args.out, " ".join(sys.argv[1:]))


def write(rows, out: Path, argv: str):
    today = datetime.date.today().isoformat()
    lines = [
        "# ZeRO++: bytes per step inside and across hosts, 2 hosts x 8 H100 (XLA:GPU programs)",
        "",
        f"`python experiments/zeropp.py {argv}`".replace(" `", "`") + f" on a {os.cpu_count()}-core "
        f"CPU machine without a GPU ({platform.processor() or platform.machine()}), {today}, jax "
        f"{jax.__version__} with jax-cuda12-plugin of the same version. The trainer's GPT step "
        "(AdamW, bf16 weights, fp32 master and moments, remat full, one 512-token sequence per "
        "device) compiled for `zf.target_mesh(\"h100\", data=16, hosts=2)`. MiB per device and "
        "step, read from the scheduled program by `zf.memory.traffic` (direct-exchange count, "
        "see docs/engine.md); gradient reduction = reduce-scatters plus qgZ's all-to-alls; "
        "permutes = hpZ's refresh of its copy; across / stage 3 = cross-host bytes of all "
        "collectives over plain stage 3's. Overlapped = collectives with a kernel scheduled "
        "between start and done.",
        "",
        "| model | option | Psi | gathers in host | gathers across | gradient reduction in host | "
        "gradient reduction across | permutes across | all in host | all across | "
        "across / stage 3 | all-gathers overlapped | reduce-scatters overlapped | "
        "all-to-alls overlapped |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    base = {}
    for r in rows:
        base.setdefault(r["model"], r["traffic"]["total"]["cross_host"])
        lines.append(_line(r, base[r["model"]]))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(lines) + "\n" + _analysis_after_table(out))
    print(f"wrote {out}", file=sys.stderr)


def _analysis_after_table(out: Path) -> str:
    """What the results file says below its table (the written analysis and the convergence
    runs), kept when the table is measured again."""
    if not out.exists():
        return ""
    lines = out.read_text().splitlines(keepends=True)
    start = next((i for i, line in enumerate(lines) if line.startswith("| model")), len(lines))
    end = start
    while end < len(lines) and lines[end].startswith("|"):
        end += 1
    return "".join(lines[end:])


if __name__ == "__main__":
    main()
