"""Before a GPU runs the GPU report's fp8 stage: its configurations (the full profile's, from
scripts/gpureport/profiles.py) compiled for one abstract H100 on the CPU platform. Per step
variant: XLA's memory analysis, the train state's bytes and the FP8 / other GEMMs; for the
stage's one process holding all three variants, the states it keeps (the variants of one state
layout share theirs) plus the largest step's temporaries; per saved-activation run: XLA's total.

    python experiments/gpu_report_fp8_preflight.py [--out experiments/results]

XLA:GPU estimates (deviceless compiles), not measurements. A few minutes on 2 CPU cores.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "scripts")]

from zeroflow.cli.common import start_script  # noqa: E402

start_script()  # before jax: where the CUDA plugin has no driver, a CPU jax without its noise

import argparse  # noqa: E402
import datetime  # noqa: E402

import jax  # noqa: E402
from benchlib import fp8 as bench_fp8  # noqa: E402
from benchlib import gpt  # noqa: E402
from gpureport.profiles import FULL  # noqa: E402
from gpureport.stages.fp8 import saved_spec  # noqa: E402

from experiments.machine import cpu_name  # noqa: E402
from zeroflow.autocast.fp8_hlo import count_gemms  # noqa: E402
from zeroflow.memory.measure import analysed, state_bytes  # noqa: E402
from zeroflow.trainer.planning import compile_config  # noqa: E402

GB = 1e9


def compiled_for_h100(spec: dict, precision: dict | None = None):
    """(memory analysis, state bytes, GEMM count) of the spec's step for one abstract H100."""
    cfg = gpt.config_for(spec)
    for key, value in {"autocast": spec["autocast"] or "none", **(precision or {})}.items():
        setattr(cfg.precision, key, value)
    compiled, setup = compile_config(cfg, num_devices=1, stage=0, offload="none", update_on="device",
                                     remat=cfg.model.remat, target="h100")
    return analysed(compiled), state_bytes(setup.state)["device"], count_gemms(compiled.as_text())


def step_rows() -> tuple[list[str], float]:
    """The step item's variants, and the bytes its process holds at its peak."""
    step = FULL.fp8["step"]
    rows, states, temps = [], {}, []
    for label, autocast, precision in step["variants"]:
        spec = bench_fp8.variant_spec(step["base"], autocast, precision)
        got, held, gemms = compiled_for_h100(spec, precision)
        states[precision.get("fp8_scaling") == "delayed"] = held  # the state layouts of the stage
        temps.append(got.total_bytes - held)
        rows.append(f"| {label} | {got.total_bytes / GB:.2f} | {held / GB:.2f} | {gemms.fp8} / "
                    f"{gemms.other} |")
    return rows, sum(states.values()) + max(temps)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=REPO / "experiments" / "results")
    args = parser.parse_args(argv)
    rows, process = step_rows()
    step = FULL.fp8["step"]
    lines = [
        "# The GPU report's fp8 stage compiled for one H100 (XLA:GPU estimate, deviceless compile)",
        "",
        f"`python experiments/gpu_report_fp8_preflight.py`, {datetime.date.today()}, jax "
        f"{jax.__version__}, on a CPU ({cpu_name()}, {os.cpu_count()} cores) compiling for an "
        "abstract H100 (`zf.target_mesh`): estimates, not measurements.",
        "",
        f"**Step** ({gpt.num_params(step['base']) / GB:.2f}B GPT, batch {step['base']['batch']}, "
        f"remat {step['base']['model']['remat']}, {step['base']['model']['attention']} attention, "
        "bf16 weights):",
        "",
        "| precision | XLA total (GB) | train state (GB) | GEMMs fp8 / other |",
        "|---|---|---|---|",
        *rows,
        "",
        f"The stage's process holds the states of both layouts and one step's temporaries at a "
        f"time: {process / GB:.2f} GB, against the {0.92 * 80:.1f} GB its allocator may take "
        "(92% of 80 GB).",
        "",
        "**Saved activations** (`model.remat=save_dots`):",
        "",
        "| saved dtype | XLA total (GB) | vs compute |",
        "|---|---|---|",
    ]
    totals = {}
    for remat_dtype in FULL.fp8["saved"]["remat_dtypes"]:
        got, _, _ = compiled_for_h100(saved_spec(FULL.fp8["saved"]["base"], remat_dtype))
        totals[remat_dtype] = got.total_bytes
        lines.append(f"| {remat_dtype} | {got.total_bytes / GB:.2f} | "
                     f"{got.total_bytes / totals['compute']:.3f}x |")
    text = "\n".join(lines) + "\n"
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "gpu_report_fp8_preflight.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
