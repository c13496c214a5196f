"""The train step as XLA:GPU compiles it, measured on a machine without a GPU.

Compiles zeroflow's step for abstract GPUs (``zf.target_mesh``) and reports, per model, stage
and target: XLA:GPU's peak per device (``memory_analysis``), its ratio to the ZeRO paper's
model-state formula (activations are outside it), and how many all-gathers and reduce-scatters
overlap compute in the scheduled program (``zf.memory.collectives``). The scan model is also
compiled for XLA:CPU (8 emulated devices).

    python experiments/gpu_compile.py            # writes experiments/results/gpu_compile.md

Nothing is autotuned and nothing runs: memory and schedule are XLA:GPU's, step time is not
known (see docs/gpu_compile.md).
"""
from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # the CUDA plugin describes targets only then
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_force_host_platform_device_count=8").strip()

import argparse  # noqa: E402
import datetime  # noqa: E402
import platform  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

from zeroflow.cli.common import start_script  # noqa: E402

start_script()  # before jax: where the CUDA plugin has no driver, a CPU jax without its noise

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402

import zeroflow as zf  # noqa: E402
from zeroflow.memory.measure import analysed, device_peak  # noqa: E402

RESULTS = Path(__file__).parent / "results" / "gpu_compile.md"
MiB = 2 ** 20


def plain_model(width, hidden, layers, vocab=4096):
    """Plain JAX: dicts of arrays, unrolled layers, an embedding and a head; no hints."""
    def init():
        k = jax.random.key(0)
        p = {"embed": jax.random.normal(k, (vocab, width)), "head": jax.random.normal(k, (width, vocab))}
        for i in range(layers):
            p[f"up{i}"] = jax.random.normal(k, (width, hidden))
            p[f"down{i}"] = jax.random.normal(k, (hidden, width))
        return p

    def loss(p, b):
        x = p["embed"][b["tokens"][:, :-1]]
        for i in range(layers):
            x = x + jax.nn.gelu(x @ p[f"up{i}"]) @ p[f"down{i}"]
        logits = (x @ p["head"]).astype(jnp.float32)
        return optax.softmax_cross_entropy_with_integer_labels(logits, b["tokens"][:, 1:]).mean()
    return loss, jax.eval_shape(init)


def scan_model(width=512, layers=16):
    """Plain JAX written with lax.scan over stacked weights, no hints."""
    def init():
        k = jax.random.key(0)
        return {"w": jax.random.normal(k, (layers, width, width)),
                "b": jnp.zeros((layers, width)), "head": jax.random.normal(k, (width, 10))}

    def loss(p, b):
        def body(x, wb):
            w, bias = wb
            return jax.nn.relu(x @ w.astype(x.dtype) + bias.astype(x.dtype)), None
        x, _ = jax.lax.scan(body, b["x"].astype(p["w"].dtype), (p["w"], p["b"]))
        return optax.softmax_cross_entropy_with_integer_labels(
            (x @ p["head"]).astype(jnp.float32), b["y"]).mean()
    return loss, jax.eval_shape(init)


def tokens(rows, seq):
    return {"tokens": jax.ShapeDtypeStruct((rows, seq + 1), jnp.int32)}


def formula(stage, psi, n):
    """The ZeRO paper's model states per device: bf16 weights and gradients, K = 12."""
    return {0: 16 * psi, 1: 4 * psi + 12 * psi / n, 2: 2 * psi + 14 * psi / n, 3: 16 * psi / n}[stage]


def measure_row(name, loss, params, batch, mesh, stage, where):
    plan = zf.ZeroPlan(mesh, stage=stage)
    prec, tx = zf.Precision(params="bf16"), optax.adamw(1e-3)
    start = time.perf_counter()
    compiled, state = zf.memory.compile_step(loss, params, batch, tx, plan, prec)
    peak = device_peak(analysed(compiled), state)
    summary = zf.memory.overlap(zf.memory.collectives(compiled))
    psi = sum(x.size for x in jax.tree.leaves(params))
    n = plan.data_size
    row = {"model": name, "where": where, "stage": stage, "psi": psi, "peak": peak,
           "ratio": peak / formula(stage, psi, n), "overlap": summary,
           "seconds": time.perf_counter() - start}
    print(_line(row), file=sys.stderr, flush=True)
    return row


def config_row(config, target, devices, stage, remat, overrides=(), label=""):
    from zeroflow.config.io import load_config
    from zeroflow.planner import memory_table
    cfg = load_config(config, ["model.attention=xla", *overrides])
    if cfg.model.init_from:
        import dataclasses

        from zeroflow.trainer.setup import run_model_config
        cfg = dataclasses.replace(cfg, model=run_model_config(cfg))
    start = time.perf_counter()
    (r,) = memory_table.build(cfg, devices=devices, stages=[stage], offloads=["none"],
                              remats=[remat], measure="always", target=target, instant=False).rows
    if r.measured is None:
        raise RuntimeError(f"{config}: {r.reason}")
    psi = zf.memory.count_gpt_params(cfg.model)
    row = {"model": f"{Path(config).stem} (remat {remat}{', ' + label if label else ''})",
           "where": f"{devices} x {target}",
           "stage": stage, "psi": psi, "peak": r.measured.peak_bytes,
           "ratio": r.measured.peak_bytes / formula(stage, psi, devices), "overlap": r.measured.overlap,
           "seconds": time.perf_counter() - start}
    print(_line(row), file=sys.stderr, flush=True)
    return row


def _fraction(summary, kind):
    s = summary[kind]
    return "-" if not s["count"] else f"{s['overlapped']}/{s['count']}"


def _line(r):
    return (f"| {r['model']} | {r['where']} | {r['stage']} | {r['psi'] / 1e6:.1f}M | "
            f"{r['peak'] / MiB:,.1f} | {r['ratio']:.2f} | "
            f"{_fraction(r['overlap'], 'all-gather')} | {_fraction(r['overlap'], 'reduce-scatter')} |")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="the plain and scan models only")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    h100 = zf.target_mesh("h100", data=8)
    rows = []
    for name, (loss, params), batch in [
            ("plain 6 x 1024/4096", plain_model(1024, 4096, 6), tokens(16, 128)),
            # the same model with activations made small: model states alone
            ("plain 6 x 1024/4096, 8 x 16 tokens", plain_model(1024, 4096, 6), tokens(8, 16)),
            ("plain 16 x 512/2048", plain_model(512, 2048, 16), tokens(8, 64))]:
        for stage in (2, 3):
            rows.append(measure_row(name, loss, params, batch, h100, stage, "8 x h100"))
    loss, params = scan_model()
    batch = {"x": jax.ShapeDtypeStruct((16, 512), jnp.float32),
             "y": jax.ShapeDtypeStruct((16,), jnp.int32)}
    for mesh, where in [(h100, "8 x h100"), (zf.make_mesh(data=8), "8 x cpu"),
                        (zf.make_mesh(data=2, devices=jax.devices()[:2]), "2 x cpu")]:
        for stage in (1, 2, 3):
            rows.append(measure_row("scan 16 x 512", loss, params, batch, mesh, stage, where))
    loss, params = plain_model(512, 2048, 16)
    for gpu in ("a100", "l4"):
        rows.append(measure_row("plain 16 x 512/2048", loss, params, tokens(8, 64),
                                zf.target_mesh(gpu, data=8), 3, f"8 x {gpu}"))
    if not args.quick:
        for config, overrides in (("configs/gpt2-small.yaml", ()), ("configs/gpt-1b.yaml", ()),
                                  ("configs/finetune-llama3-8b.yaml",
                                   ("parallel.grad_accum=1", "train.batch_size=8"))):
            rows.append(config_row(config, "h100", 8, 3, "full", overrides))
        # The trainer's GPT with activations made small (one sequence of 128 tokens per
        # device): model states alone, against the formula.
        small = ("train.batch_size=8", "model.seq_len=128", "parallel.grad_accum=1")
        for config in ("configs/gpt2-small.yaml", "configs/gpt-1b.yaml"):
            for stage in (2, 3):
                rows.append(config_row(config, "h100", 8, stage, "full", small,
                                       label="8 x 128 tokens"))
    write(rows, args.out)


def write(rows, out: Path):
    today = datetime.date.today().isoformat()
    lines = [
        "# The train step compiled for GPUs that are not there",
        "",
        f"`python experiments/gpu_compile.py` on a {os.cpu_count()}-core CPU machine without a GPU "
        f"({platform.processor() or platform.machine()}), {today}, jax {jax.__version__} with "
        "jax-cuda12-plugin of the same version: each row is one real XLA:GPU (or XLA:CPU) "
        "compile of zeroflow's step, AdamW, bf16 weights, fp32 master and moments. Peak = "
        "`memory_analysis()` per device (arguments + outputs + temporaries - aliased). "
        "Formula = the ZeRO paper's model states (stage 2: 2Psi + 14Psi/N, stage 3: 16Psi/N); "
        "activations are outside it. Overlap = collectives with at least one kernel scheduled between start "
        "and done / all of that kind (XLA:CPU runs collectives in line: none overlap there).",
        "",
        "| model | devices | stage | Psi | peak MiB | / formula | all-gathers overlapped | "
        "reduce-scatters overlapped |",
        "|---|---|---|---|---|---|---|---|"]
    lines += [_line(r) for r in rows]
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(lines) + "\n")
    print(f"wrote {out}", file=sys.stderr)


if __name__ == "__main__":
    main()
