"""``zf.memory.estimate_step`` (the traced step, no compile) against XLA's compiled peak.

    python experiments/estimate_vs_compile.py [--out experiments/results] [--quick]

Cases: the trainer's GPT at configs/tiny.yaml's shape widened as below, at every ZeRO stage x
remat policy on 8 emulated CPU devices (XLA:CPU); GPT-2 small (configs/gpt2-small.yaml) on 8
abstract H100s (XLA:GPU, needs the CUDA plugin; skipped with a note without it); a plain-JAX
scanned residual MLP; the model corpus's Equinox transformer (tests/model_corpus.py); host
offload of state and activations on abstract H100s (configs/tiny.yaml, and the 8B long-context
config at 884,736 tokens). Each
row: the estimate, its parts, XLA's peak per device (``measure``'s, less offloaded state) and
the ratio. Writes ``estimate_vs_compile.md`` to ``--out``; about 4 minutes on 2 idle cores
(2026-12-06), longer on busy ones.
"""

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse
import datetime
import itertools
import pathlib
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from zeroflow.cli.common import start_script  # noqa: E402

start_script()  # before jax: where the CUDA plugin has no driver, a CPU jax without its noise

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402
from jax.sharding import AxisType  # noqa: E402

from experiments.machine import cpu_name
from zeroflow.autocast.precision import Precision
from zeroflow.config.io import load_config
from zeroflow.engine.plan import ZeroPlan
from zeroflow.memory.instant import estimate_step
from zeroflow.memory.measure import device_peak, measure_step
from zeroflow.trainer.planning import compile_config, trace_config

MB = 1e6
TINY = [
    "precision.params=fp32",
    "model.embed_dim=256",
    "model.mlp_dim=1024",
    "model.num_layers=4",
    "train.batch_size=8",
]
REMATS = ("none", "full", "save_dots", "offload_dots")


def config_row(name, cfg, **choice) -> dict:
    """Estimate and compiled peak of the trainer's step for one choice."""
    from zeroflow.memory.measure import analysed

    t0 = time.time()
    est = trace_config(cfg, **choice)
    est_s = time.time() - t0
    t0 = time.time()
    compiled, setup = compile_config(cfg, **choice)
    compile_s = time.time() - t0
    return _row(name, est, device_peak(analysed(compiled), setup.state), est_s, compile_s)


def _row(name, est, xla, est_s, compile_s) -> dict:
    return {
        "case": name,
        "estimate": est.peak_bytes,
        "state": est.state_bytes,
        "saved": est.saved_bytes,
        "temporary": est.temporary_bytes,
        "xla": xla,
        "est_s": est_s,
        "compile_s": compile_s,
        "at": est.at,
    }


def library_row(name, loss_fn, params, batch, plan, prec, **kw) -> dict:
    tx = optax.adamw(1e-3)
    t0 = time.time()
    est = estimate_step(loss_fn, params, batch, tx, plan, prec, **kw)
    est_s = time.time() - t0
    t0 = time.time()
    _, peak = measure_step(loss_fn, params, batch, tx, plan, prec, **kw)
    return _row(name, est, peak, est_s, time.time() - t0)


def scanned_mlp(layers=8, width=512, rows=64):
    """A residual MLP whose layers are one ``lax.scan`` over stacked weights, each under
    ``jax.checkpoint``: params and a global batch, abstract."""

    def loss_fn(params, batch):
        def layer(x, w):
            return x + jnp.tanh(x @ w["up"]) @ w["down"], None

        x, _ = jax.lax.scan(jax.checkpoint(layer), batch["x"], params["layers"])
        return jnp.mean((x @ params["head"] - batch["y"]) ** 2)

    f32 = jnp.float32
    params = {
        "layers": {
            "up": jax.ShapeDtypeStruct((layers, width, 4 * width), f32),
            "down": jax.ShapeDtypeStruct((layers, 4 * width, width), f32),
        },
        "head": jax.ShapeDtypeStruct((width, 16), f32),
    }
    batch = {
        "x": jax.ShapeDtypeStruct((rows, width), f32),
        "y": jax.ShapeDtypeStruct((rows, 16), f32),
    }
    return loss_fn, params, batch


def equinox_transformer():
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "tests"))
    from model_corpus import LARGER, engine_loss, eqx_transformer

    corpus = eqx_transformer(dims=LARGER, layers=4)
    batch = corpus.batches(1, size=32)[0]
    return engine_loss(corpus.forward, stateful=False), corpus.params, batch


def cases(quick: bool):
    cfg = load_config("configs/tiny.yaml", TINY)
    stages = (1, 3) if quick else (0, 1, 2, 3)
    remats = ("none", "full") if quick else REMATS
    for stage in stages:
        for remat in remats:
            yield (
                f"tiny GPT, stage {stage}, remat {remat}",
                lambda n, s=stage, r=remat: config_row(
                    n,
                    cfg,
                    num_devices=8,
                    stage=s,
                    offload="none",
                    update_on="device",
                    remat=r,
                ),
            )
    mesh = jax.make_mesh((8, 1), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
    for stage in (1, 3):
        plan = ZeroPlan(mesh, stage=stage)
        yield (
            f"scanned MLP (jax.lax.scan), stage {stage}",
            lambda n, p=plan: library_row(n, *scanned_mlp(), p, Precision("bf16")),
        )
        yield (
            f"Equinox transformer, stage {stage}",
            lambda n, p=plan: library_row(
                n,
                *equinox_transformer(),
                p,
                Precision("fp32"),
                rng=jax.random.key(0),
            ),
        )
    if not quick:
        gpt2 = load_config("configs/gpt2-small.yaml", ["train.batch_size=64"])
        for stage, remat in ((2, "save_dots"), (3, "full")):
            name = f"GPT-2 small on 8 x H100, stage {stage}, remat {remat}"
            yield (
                name,
                lambda n, s=stage, r=remat: config_row(
                    n,
                    gpt2,
                    num_devices=8,
                    stage=s,
                    offload="none",
                    update_on="device",
                    remat=r,
                    target="h100",
                ),
            )
        yield from offload_cases()


def offload_cases():
    """Host offload on abstract H100s (XLA:GPU keeps host memory apart): the small GPT's state
    and activations, and the 8B long-context run of docs/long_context.md."""
    tiny = load_config("configs/tiny.yaml", [])
    for stage, offload, remat in itertools.product(
        (0, 3), ("none", "optimizer", "optimizer+params"), ("full", "offload_dots", "offload_input")
    ):
        choice = dict(num_devices=8, stage=stage, offload=offload, remat=remat)
        yield (
            f"tiny GPT (bf16) on 8 x H100, stage {stage}, offload {offload}, remat {remat}",
            lambda n, c=choice: config_row(n, tiny, update_on="device", target="h100", **c),
        )
    llama = load_config("configs/long-context-llama3-8b.yaml", ["model.seq_len=884736"])
    for offload, remat in itertools.product(
        ("none", "optimizer", "optimizer+params"), ("full", "offload_input")
    ):
        choice = dict(num_devices=1, stage=0, offload=offload, remat=remat)
        yield (
            f"Llama 3.1 8B, 884,736 tokens, 1 x H100, offload {offload}, remat {remat}",
            lambda n, c=choice: config_row(n, llama, update_on="device", target="h100", **c),
        )


def table(rows) -> str:
    lines = [
        "| case | estimate MB | state | saved | temporary | XLA peak MB | est / XLA | "
        "estimate s | compile s | peak at |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['case']} | - | - | - | - | - | - | - | - | {r['error']} |")
            continue
        lines.append(
            f"| {r['case']} | {r['estimate'] / MB:.2f} | {r['state'] / MB:.2f} | "
            f"{r['saved'] / MB:.2f} | {r['temporary'] / MB:.2f} | {r['xla'] / MB:.2f} | "
            f"{r['estimate'] / r['xla']:.3f} | {r['est_s']:.1f} | {r['compile_s']:.1f} | "
            f"`{r['at']}` |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="experiments/results")
    parser.add_argument("--quick", action="store_true", help="fewer tiny rows, no XLA:GPU rows")
    parser.add_argument("--only", default="", help="only the cases whose name holds this text")
    parser.add_argument("--name", default="estimate_vs_compile.md", help="the table's file name")
    args = parser.parse_args()
    rows = []
    for name, make in cases(args.quick):
        if args.only not in name:
            continue
        try:
            row = make(name)
        except Exception as error:
            row = {"case": name, "error": (str(error).splitlines() or [repr(error)])[0]}
        rows.append(row)
        print(table(rows[-1:]).splitlines()[-1], flush=True)
    command = "python experiments/estimate_vs_compile.py" + (" --quick" if args.quick else "")
    command += f' --only "{args.only}"' if args.only else ""
    text = (
        "# `zf.memory.estimate_step` vs XLA's compiled peak\n\n"
        f"Measured {datetime.date.today()} on {cpu_name()} ({os.cpu_count()} cores), "
        f"jax {jax.__version__}; command: `{command}`.\n\n"
        "Per device. estimate = state + batch + saved + temporary, from the traced step (no "
        "compile); XLA peak = the compiled step's memory_analysis (arguments + outputs + "
        "temporaries - aliased), less offloaded state. tiny GPT: configs/tiny.yaml with "
        f"{' '.join(TINY)}.\n\n" + table(rows) + "\n"
    )
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / args.name).write_text(text)
    print(f"wrote {out / args.name}")


if __name__ == "__main__":
    main()
