"""What fits on one GPU, or eight, for fine-tuning: XLA:GPU's own peak per device.

Each row compiles the trainer's step for abstract GPUs (``zf.target_mesh``; no GPU needed) and
reports XLA:GPU's peak per device (``memory_analysis``), the host memory the step keeps per
device (offloaded state), and whether the peak fits the card.

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

from zeroflow.cli.common import start_script  # noqa: E402

start_script()  # before jax: where the CUDA plugin has no driver, a CPU jax without its noise

import jax  # noqa: E402

from zeroflow.backend import targets  # noqa: E402
from zeroflow.config.io import load_config  # noqa: E402
from zeroflow.planner import memory_table  # noqa: E402
from zeroflow.trainer.setup import run_model_config  # noqa: E402

RESULTS = Path(__file__).parent / "results" / "fit_table.md"
GB = 1e9

LLAMA_8B = "configs/finetune-llama3-8b.yaml"
LLAMA_70B = "model.init_from=configs/hf/llama-3.1-70b"  # Meta's published config.json
ONE_SEQUENCE = ("train.batch_size=1", "parallel.grad_accum=1", "model.attention=xla")
NO_OFFLOAD = ("parallel.offload=none", "parallel.update_on=device")

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

# LoRA rank 16 (alpha 32) on every linear layer of the blocks (the trainer's model.lora keys):
# the base frozen in bf16, AdamW on the adapters.
LORA = ("model.lora.rank=16", "model.lora.alpha=32",
        r"model.lora.targets=layers/(attn/(query|key|value|out)|mlp/(gate|up|down))/kernel")
ROWS += [
    ("Llama 3.1 8B, LoRA r=16 on all linear layers, AdamW",
     LLAMA_8B, ONE_SEQUENCE + NO_OFFLOAD + LORA, "l4", 1, 3, "none", "full"),
    ("Llama 3.1 70B, LoRA r=16 on all linear layers, AdamW",
     LLAMA_8B, ("train.batch_size=8", "parallel.grad_accum=1", "model.attention=xla", LLAMA_70B)
     + NO_OFFLOAD + LORA, "h100", 8, 3, "none", "full"),
]


NOTES = """\
Notes:
- The 8B full fine-tune on one 80 GB H100: bf16 weights (16.1 GB), fp32 master (32.1 GB) and
  8-bit moments (16.3 GB) are 64.5 GB between steps; on one device nothing sums the
  gradients, so they stay in bf16 (16.1 GB) until the update reads them. All on the GPU, the
  backward pass peaks just over the card. With the master and the moments in host memory
  (48.5 GB there) it fits, updated on the GPU one parameter's state at a time (each
  parameter's state is copied in once the previous parameter's results are back on the
  host) or on the host (ZeRO-Offload: the bf16 gradients cross to the host and are widened
  there; the host holds the state and the host update's temporaries, whole fp32 stacks).
- 8-bit AdamW updates each stack of layers one layer at a time, in place
  (`zeroflow.optim.adam`'s `_slice_by_slice`: each layer's direction and moments are written
  over the slice it read), and finds codes by comparing with all 255 midpoints of the map (a
  fused reduction); with the layers mapped into fresh zero-filled outputs the all-GPU row
  peaked at 110.3 GB, with every moment dequantized and binary-searched at once at 171.6 GB.
- Offloaded rows are compiled on CPU devices standing in for the GPUs
  (`zeroflow.memory.on_target`): the abstract GPUs of `zf.target_mesh` expose no memories,
  so jax drops a sharding's `pinned_host` memory kind on them; planned and traced on CPU
  devices with the GPU's traits, lowered for CUDA and compiled by the target's compile-only
  client, the step keeps its state in host memory as a GPU runs it.
- 70B LoRA row: the adapted loss reads whole weights, so at stage 3 each stack of layers is
  fetched on use, one layer per scan iteration. The gate, up and query stacks are split along
  a dimension after the layer's first; gathered along it, XLA:GPU kept a relaid-out copy of
  those stacks' local shards for the whole step (10.0 GB per device: 36.0 GB). Each slice is now gathered on a new leading axis and moved into place
  (`zeroflow.engine.grads.collectives.all_gather(sliced=True)`).
- Llama 3.1 70B's architecture is `configs/hf/llama-3.1-70b/config.json`, Meta's published
  config.json for meta-llama/Llama-3.1-70B (hidden 8192, intermediate 28672, 80 layers, 64
  heads, 8 KV heads, vocabulary 128256, rope theta 500000 with llama3 rope scaling).
- LoRA rows: the trainer's `model.lora.rank=16`, `model.lora.alpha=32` and
  `model.lora.targets` on the query, key, value, output, gate, up and down kernels of every
  block: the base frozen in bf16, AdamW on the adapters.
"""


def measure(label, config, overrides, gpu, devices, stage, offload, remat):
    cfg = load_config(config, list(overrides))
    if cfg.model.init_from:  # the architecture is the checkpoint's config.json
        cfg = dataclasses.replace(cfg, model=run_model_config(cfg))
    start = time.perf_counter()
    update_on = cfg.parallel.update_on if offload != "none" else "device"
    cfg = dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, update_on=update_on))
    (r,) = memory_table.build(cfg, devices=devices, stages=[stage], offloads=[offload],
                              remats=[remat], measure="always", target=gpu, instant=False).rows
    if r.measured is None:
        raise RuntimeError(f"{label}: {r.reason}")
    memory = _card_memory(gpu)
    row = {"label": label, "where": f"{devices} x {gpu}", "stage": stage, "offload": offload,
           "remat": remat, "peak": r.measured.peak_bytes, "host": r.measured.host_bytes, "memory": memory,
           "seconds": time.perf_counter() - start}
    print(_line(row), file=sys.stderr, flush=True)
    return row


def _card_memory(gpu: str) -> int:
    return int(targets.spec_field(targets.spec_text(gpu), "device_memory_size"))


def _line(r):
    host = "-" if not r["host"] else f"{r['host'] / GB:,.1f}"
    fits = "yes" if r["peak"] <= r["memory"] else "no"
    return (f"| {r['label']} | {r['where']} | {r['offload']} | {r['remat']} | "
            f"{r['peak'] / GB:,.1f} | {host} | {fits} ({r['memory'] / GB:,.0f} GB) |")


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
            "host = XLA:GPU's host memory per device "
            "(offloaded state and the host update's temporaries). Fits = peak <= the card's "
            "memory.\n\n"
            "| setup | devices | offload | remat | XLA:GPU peak GB | host GB | fits |\n"
            "|---|---|---|---|---|---|---|\n")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(head + "\n".join(_line(r) for r in rows) + "\n\n" + NOTES)
    print(f"wrote {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
