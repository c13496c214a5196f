"""XLA:GPU's compiled peak of a LoRA step whose frozen base is stored in bf16, NF4 or int8
(``model.lora.quantize``), on one abstract GPU, compiled on a machine without one.

    python experiments/nf4_memory.py [--config configs/gpt-1b.yaml] [--target h100]
        [--seq-len 512] [--batch 4] [--rank 16] [--kinds none,nf4,int8]

Each row is one real XLA:GPU compile of the trainer's LoRA step (``build_run`` on
``zf.target_mesh(target, data=1)``), ZeRO stage 0, bf16 compute: ``memory_analysis()``'s
arguments + outputs + temporaries - aliased, and XLA's own peak; the stored base is the
state's frozen bytes. Nothing runs.
"""
from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # the CUDA plugin describes targets only then

import argparse  # noqa: E402
import time  # noqa: E402

from zeroflow.cli.common import start_script  # noqa: E402

start_script()  # before jax: where the CUDA plugin has no driver, a CPU jax without its noise

import jax  # noqa: E402
import numpy as np  # noqa: E402

import zeroflow as zf  # noqa: E402
from zeroflow import backend  # noqa: E402
from zeroflow.config.io import load_config  # noqa: E402
from zeroflow.memory.measure import analysed  # noqa: E402
from zeroflow.trainer.setup import abstract_batch, build_run  # noqa: E402

MiB = 2**20


def frozen_bytes(state) -> int:
    """Bytes of the stored frozen weights (the whole state on one device)."""
    return sum(int(np.prod(x.shape)) * x.dtype.itemsize for x in jax.tree.leaves(state.frozen))


def compiled_row(config: str, target: str, overrides: list[str]) -> dict:
    cfg = load_config(config, overrides)
    mesh = zf.target_mesh(target, data=1)
    with backend.tracing_for(backend.of(mesh)):  # the adapters' sites: traced for the GPU
        run = build_run(cfg, with_data=False, mesh=mesh)
    state = run.abstract_state()
    batch = abstract_batch(cfg, sharding=run.plan.batch_sharding())
    start = time.perf_counter()
    compiled = run.make_step().lower(state, batch).compile()
    got = analysed(compiled)
    return {
        "frozen": frozen_bytes(state),
        "total": got.total_bytes,
        "peak": got.peak_bytes,
        "temp": got.temp_bytes,
        "seconds": time.perf_counter() - start,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="configs/gpt-1b.yaml")
    parser.add_argument("--target", default="h100")
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--kinds", default="none,nf4,int8")
    args = parser.parse_args()
    common = [
        f"model.seq_len={args.seq_len}",
        f"train.batch_size={args.batch}",
        "parallel.grad_accum=1",
        "parallel.zero_stage=0",
        "precision.params=bf16",
        # XLA's attention: the rows compare the stored base, whatever the attention
        # (experiments/qlora_fit.py compiles the fit rows with cuDNN's).
        "model.attention=xla",
        f"model.lora.rank={args.rank}",
    ]
    print(
        f"{args.config} + LoRA r={args.rank}, {args.batch} x {args.seq_len} tokens, 1 x "
        f"{args.target} (XLA:GPU deviceless compile), jax {jax.__version__}\n"
    )
    print("| frozen base | stored base MiB | args + outs + temps - aliased MiB | XLA peak MiB "
          "| temporaries MiB | compile s |")
    print("|---|---:|---:|---:|---:|---:|")
    for kind in args.kinds.split(","):
        row = compiled_row(args.config, args.target, common + [f"model.lora.quantize={kind}"])
        name = "bf16" if kind == "none" else kind
        print(
            f"| {name} | {row['frozen'] / MiB:,.1f} | {row['total'] / MiB:,.1f} | "
            f"{row['peak'] / MiB:,.1f} | "
            f"{row['temp'] / MiB:,.1f} | {row['seconds']:.0f} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
