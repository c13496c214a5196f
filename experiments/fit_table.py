"""What fits on one GPU, or eight, for fine-tuning: XLA:GPU's own peak per device.

Each row compiles the trainer's step for abstract GPUs (``zf.target_mesh``; no GPU needed) and
reports XLA:GPU's peak per device (``memory_analysis``), zeroflow's estimate of it
(``estimate_config_step``), the host memory the step keeps per device (offloaded state), and
whether the peak fits the card.

    python experiments/fit_table.py      # writes experiments/results/fit_table.md

Nothing is allocated or run: the weights are abstract (only the checkpoint's config.json is
read), so an 8B or 70B model is planned on a laptop.
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

import jax  # noqa: E402

from zeroflow.backend import targets  # noqa: E402
from zeroflow.config_io import load_config  # noqa: E402
from zeroflow.trainer.memory_cli import plan_rows  # noqa: E402
from zeroflow.trainer.setup import run_model_config  # noqa: E402

RESULTS = Path(__file__).parent / "results" / "fit_table.md"
GB = 1e9

LLAMA_8B = "configs/finetune-llama3-8b.yaml"
ONE_SEQUENCE = ("train.batch_size=1", "parallel.grad_accum=1", "model.attention=xla")

# (label, config, overrides, GPU, devices, stage, offload, remat)
ROWS = [
    ("Llama 3.1 8B full fine-tune, AdamW, master + moments on the host (ZeRO-Offload)",
     LLAMA_8B, ONE_SEQUENCE, "h100", 1, 3, "optimizer", "save_dots"),
    ("Llama 3.1 8B full fine-tune, 8-bit AdamW, all on the GPU",
     LLAMA_8B, ONE_SEQUENCE + ("train.optimizer=adamw_8bit", "parallel.update_on=device"), "h100",
     1, 3, "none", "full"),
    ("Llama 3.1 8B full fine-tune, 8-bit AdamW, master + moments on the host, updated on the GPU",
     LLAMA_8B, ONE_SEQUENCE + ("train.optimizer=adamw_8bit", "parallel.update_on=device"), "h100",
     1, 3, "optimizer", "save_dots"),
    ("Llama 3.1 8B, frozen backbone, trained head (train.freeze), AdamW",
     LLAMA_8B, ONE_SEQUENCE + ("train.freeze=^(embedding|final_norm|layers/)",),
     "h100", 1, 3, "none", "full"),
]


def measure(label, config, overrides, gpu, devices, stage, offload, remat):
    cfg = load_config(config, list(overrides))
    if cfg.model.init_from:  # the architecture is the checkpoint's config.json
        cfg = dataclasses.replace(cfg, model=run_model_config(cfg))
    start = time.perf_counter()
    update_on = cfg.parallel.update_on if offload != "none" else "device"
    cfg = dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, update_on=update_on))
    (r,) = plan_rows(cfg, devices=devices, stages=[stage], offloads=[offload], remats=[remat],
                     measure="always", backend="gpu", target=gpu)
    if r.measured_bytes is None:
        raise RuntimeError(f"{label}: {r.note}")
    memory = int(targets.spec_field(targets.spec_text(gpu), "device_memory_size"))
    row = {"label": label, "where": f"{devices} x {gpu}", "stage": stage, "offload": offload,
           "remat": remat, "peak": r.measured_bytes, "estimate": r.estimate.peak_bytes,
           "host": r.measured_host_bytes, "memory": memory,
           "seconds": time.perf_counter() - start}
    print(_line(row), file=sys.stderr, flush=True)
    return row


def _line(r):
    host = "-" if not r["host"] else f"{r['host'] / GB:,.1f}"
    return (f"| {r['label']} | {r['where']} | {r['offload']} | {r['remat']} | "
            f"{r['peak'] / GB:,.1f} | {r['estimate'] / GB:,.1f} | "
            f"{r['estimate'] / r['peak'] - 1:+.1%} | {host} | "
            f"{'yes' if r['peak'] <= r['memory'] else 'no'} ({r['memory'] / GB:,.0f} GB) |")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--only", type=int, nargs="*", help="row numbers (from 0) to compile")
    args = parser.parse_args(argv)
    rows = [measure(*spec) for i, spec in enumerate(ROWS) if not args.only or i in args.only]
    head = (f"# What fits for fine-tuning, compiled by XLA:GPU\n\n"
            f"`python experiments/fit_table.py` on a {os.cpu_count()}-core CPU machine without a "
            f"GPU ({platform.machine()}), {datetime.date.today()}, jax {jax.__version__}: each row "
            "is one XLA:GPU compile of the trainer's step for abstract GPUs, one sequence of "
            "2048 tokens per device, bf16 weights. Peak = `memory_analysis()` per device; "
            "estimate = `estimate_config_step`; host = pinned host memory per device "
            "(offloaded state). Fits = peak <= the card's memory.\n\n"
            "| setup | devices | offload | remat | XLA:GPU peak GB | estimate GB | estimate error "
            "| host GB | fits |\n|---|---|---|---|---|---|---|---|---|\n")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(head + "\n".join(_line(r) for r in rows) + "\n")
    print(f"wrote {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
