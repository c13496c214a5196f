"""The largest FuseMix batch one GPU holds, by XLA:GPU compile: the trainer's step (ZeRO engine,
AdamW, latent mixup, symmetric InfoNCE) with the paper's adapters on 1024-d image and 768-d text
latents, compiled for one abstract V100 32 GB and one H100 80 GB (``zf.target_mesh``; no GPU
needed), the batch found by bisection on XLA:GPU's peak (``memory_analysis()``).

    python experiments/fusemix_max_batch.py      # writes experiments/results/fusemix_max_batch.md

The adapters are those of the FuseMix paper's released code (``MLPContrastiveFusion``): per
modality 4 pre-norm residual blocks at the latent's width widened 4x, a LayerNorm and a
projection into a 512-d shared space (``zeroflow.fusemix.model.ResidualAdapter``). The V100
(sm_70) needs CUDA 12's ptxas (CUDA 13 dropped Volta): ``pip install --target DIR
nvidia-cuda-nvcc-cu12`` and ``--cuda-root DIR/nvidia/cuda_nvcc`` (or ``CUDA_ROOT``); without
one the V100 rows say why and the H100 rows are still measured.
"""
from __future__ import annotations

import argparse
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--targets", default="v100,h100", help="GPUs, comma-separated")
    p.add_argument("--precisions", default="fp32,half",
                   help="fp32 (the paper's code: no AMP) and/or half (bf16 weights; fp16 with "
                        "dynamic loss scaling on the V100, which has no bf16)")
    p.add_argument("--granularity", type=int, default=256, help="batch sizes searched: multiples")
    p.add_argument("--cuda-root", default=os.environ.get("CUDA_ROOT", ""),
                   help="CUDA 12's nvcc folder (bin/ptxas), for the V100")
    p.add_argument("--out", default=os.path.join(ROOT, "experiments", "results",
                                                 "fusemix_max_batch.md"))
    return p.parse_args(argv)


ARGS = _args() if __name__ == "__main__" else None
os.environ.setdefault("JAX_PLATFORMS", "cpu")  # the CUDA plugin describes targets only then
sys.path.insert(0, ROOT)  # this checkout's zeroflow, not an installed one
sys.path.insert(0, os.path.join(ROOT, "experiments"))  # machine.py, also when imported
if ARGS is not None and ARGS.cuda_root:
    os.environ["CUDA_ROOT"] = ARGS.cuda_root  # read when jax starts: its ptxas for XLA:GPU

import datetime  # noqa: E402
import functools  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

from zeroflow.cli.common import start_script  # noqa: E402

start_script()  # before jax: where the CUDA plugin has no driver, a CPU jax without its noise

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from machine import cpu_name  # noqa: E402
import zeroflow as zf  # noqa: E402
from zeroflow.backend import targets  # noqa: E402
from zeroflow.config.io import load_config  # noqa: E402
from zeroflow.fusemix.model import IMAGE, TEXT, make_loss  # noqa: E402
from zeroflow.trainer.optim import make_optimizer  # noqa: E402

IMAGE_DIM, TEXT_DIM = 1024, 768
"The issue's latents (a ViT-L image encoder's 1024, a BERT-base-sized text encoder's 768)."
PAPER = {"adapter": "residual", "layers": 4, "expansion": 4, "shared_dim": 512}
"The paper's released pretraining config: num_layers_vis/text 4, expansion_factor 4, proj 512."
PAPER_BATCH = 20480
"The paper's batch: its code mixes the two halves of 40,960 latents into 20,480 pairs."
GB = 1e9


def precision(name: str, gpu: str) -> zf.Precision:
    if name == "fp32":
        return zf.Precision(params="fp32")
    if gpu == "v100":  # no bf16 on Volta: XLA:GPU widens it to fp32 there
        return zf.Precision(params="fp16", loss_scale="dynamic")
    return zf.Precision(params="bf16")


def setup():
    """The trainer's loss and optimizer from configs/fusemix.yaml with the paper's adapters."""
    cfg = load_config(Path(ROOT) / "configs" / "fusemix.yaml", [])
    module, loss_fn = make_loss(0, PAPER["layers"], PAPER["shared_dim"], cfg.fusemix.temperature,
                                cfg.fusemix.mixup_alpha, PAPER["adapter"], PAPER["expansion"])
    params = jax.eval_shape(module.init, jax.random.key(0), jnp.zeros((1, IMAGE_DIM)),
                            jnp.zeros((1, TEXT_DIM)))["params"]
    decay = jax.tree.map(lambda x: x.ndim > 1, params)
    return cfg, loss_fn, params, make_optimizer(cfg.train, lambda _: decay)


def batch_of(n: int) -> dict:
    return {IMAGE: jax.ShapeDtypeStruct((n, IMAGE_DIM), jnp.float32),
            TEXT: jax.ShapeDtypeStruct((n, TEXT_DIM), jnp.float32)}


@functools.cache
def plan_for(gpu: str):
    return zf.ZeroPlan(zf.target_mesh(gpu, data=1), stage=2)


NO_RECOMPUTE = {"xla_gpu_memory_limit_slop_factor": 100_000}
"XLA:GPU's rematerialization aims at about 75% of the card (slop factor 95%, the default);"
" a limit far above any peak keeps it from recomputing anything: the plain program's peak."


@functools.cache
def peak(gpu: str, prec_name: str, n: int, recompute: bool = True) -> int:
    """XLA:GPU's bytes for one step at batch ``n`` (arguments + outputs + temporaries - aliased);
    ``recompute=False``: with XLA's rematerialization kept from recomputing activations."""
    _, loss_fn, params, tx = SETUP
    options = {} if recompute else {"compiler_options": NO_RECOMPUTE}
    got, device = zf.memory.measure_step(loss_fn, params, batch_of(n), tx, plan_for(gpu),
                                         precision(prec_name, gpu), rng=jax.random.key(0),
                                         **options)
    return int(device)


def largest(fits, step: int, start: int) -> tuple[int, int]:
    """``(largest multiple of step n with fits(n), calls)`` for a ``fits`` that holds up to some
    size and not beyond: doubling from ``start``, then bisection. 0 if not even ``step`` fits."""
    calls = 0
    lo, hi = 0, start
    while True:
        calls += 1
        if not fits(hi):
            break
        lo, hi = hi, hi * 2
    while hi - lo > step:
        mid = (lo + hi) // 2 // step * step
        calls += 1
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo, calls


BUDGETS = (("the whole card", 1.0), ("75% (JAX's default preallocation)", 0.75))
"Fractions of the card's memory a step's peak must stay within."


def search(args, gpu: str, prec_name: str, recompute: bool, budget: float) -> dict:
    t0 = time.perf_counter()
    at = lambda n: peak(gpu, prec_name, n, recompute)  # noqa: E731
    most, compiles = largest(lambda n: at(n) <= budget, args.granularity, 16 * args.granularity)
    return {"budget_bytes": budget, "largest": most, "peak": at(most),
            "next": at(most + args.granularity), "paper": at(PAPER_BATCH),
            "seconds": time.perf_counter() - t0, "compiles": compiles}


def main(args) -> int:
    global SETUP
    SETUP = setup()
    _, _, params, _ = SETUP
    n_params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params))
    rows, skipped = [], []
    for gpu in args.targets.split(","):
        try:
            plan = plan_for(gpu)
        except targets.TargetUnavailable as e:
            skipped.append(f"{gpu}: {e}")
            print(f"{gpu}: skipped: {e}", file=sys.stderr)
            continue
        memory = plan.traits.memory_bytes
        for prec_name in args.precisions.split(","):
            prec = precision(prec_name, gpu)
            label = prec.params + (", dynamic loss scale" if prec.loss_scale != "none" else "")
            # Without recompute only for fp32: the plain program, the paper's precision.
            for recompute in (True, False) if prec_name == "fp32" else (True,):
                for budget_name, fraction in BUDGETS:
                    row = search(args, gpu, prec_name, recompute, fraction * memory)
                    row.update(kind=plan.mesh.devices.flat[0].device_kind, memory=memory,
                               precision=label, budget=budget_name, recompute=recompute)
                    rows.append(row)
                    print(f"{gpu} {label}, {'XLA recomputes' if recompute else 'no recompute'}, "
                          f"within {budget_name} ({row['budget_bytes'] / GB:.2f} GB): largest "
                          f"batch {row['largest']:,} ({row['peak'] / GB:.2f} GB; +"
                          f"{args.granularity}: {row['next'] / GB:.2f} GB); at {PAPER_BATCH:,}: "
                          f"{row['paper'] / GB:.2f} GB [{row['seconds']:.0f} s]", flush=True)
    write(args, rows, skipped, n_params)
    return 0


def write(args, rows, skipped, n_params) -> None:
    today = datetime.date.today().isoformat()
    ptxas = targets.ptxas_path()
    release = targets.ptxas_release(ptxas) if ptxas else None
    lines = [
        "# The largest FuseMix batch on one GPU, by XLA:GPU compile", "",
        f"`python experiments/fusemix_max_batch.py --cuda-root DIR/nvidia/cuda_nvcc` (DIR: "
        f"`pip install --target DIR nvidia-cuda-nvcc-cu12`, for the V100) on a "
        f"{os.cpu_count()}-core CPU machine without a GPU "
        f"({cpu_name()}), {today}, jax {jax.__version__}, ptxas "
        f"{'.'.join(map(str, release)) if release else 'unknown'}. Nothing runs: each batch "
        "size is one compile of the trainer's step for one abstract GPU, and its peak is "
        "XLA:GPU's `memory_analysis()` (arguments + outputs + temporaries - aliased); the CUDA "
        "context and library workspaces are not in it.", "",
        f"The step: `zf.make_train_step` at ZeRO stage 2 on one device, AdamW from "
        f"`configs/fusemix.yaml`, latent mixup (alpha 1) and symmetric InfoNCE over the whole "
        f"batch; the adapters of the FuseMix paper's released code: per modality "
        f"{PAPER['layers']} pre-norm residual blocks widened {PAPER['expansion']}x, a LayerNorm "
        f"and a projection into {PAPER['shared_dim']} dimensions ({n_params / 1e6:.1f}M "
        f"parameters in all), on float32 latents of {IMAGE_DIM} (image) and {TEXT_DIM} (text) "
        f"dimensions. Batch = pairs in the loss (its B x B similarity matrix). Largest: the "
        f"largest multiple of {args.granularity} whose peak stays within the budget (the card's "
        "memory as nvidia-smi reports it, or JAX's default share of it), found by doubling from "
        f"{16 * args.granularity:,}, then bisection.", "",
        "XLA:GPU's rematerialization pass aims at about 75% of the card by default "
        "(`xla_gpu_memory_limit_slop_factor` 95): a program larger than that has activations "
        "recomputed in the backward pass, as far as it can. *XLA recomputes*: the step as it "
        "compiles by default; *no recompute*: the same step with that limit set far above any "
        "peak (the plain program, every activation kept).", "",
        "| GPU | weights | activations | budget | largest batch | its peak | +"
        + f"{args.granularity} | peak at 20,480 |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['kind']} ({r['memory'] / GB:.2f} GB) | {r['precision']} | "
            f"{'XLA recomputes' if r['recompute'] else 'no recompute'} | {r['budget']} "
            f"({r['budget_bytes'] / GB:.2f} GB) | **{r['largest']:,}** | {r['peak'] / GB:.3f} GB | "
            f"{r['next'] / GB:.3f} GB | {r['paper'] / GB:.2f} GB |")
    for s in skipped:
        lines += ["", f"Not measured: {s}."]
    Path(args.out).write_text("\n".join(lines) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    sys.exit(main(ARGS))
