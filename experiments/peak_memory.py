"""The ZeRO paper's Figure 1, measured: per-device peak of the compiled train step against the
number of devices, for stages 0-3, the ZeRO formula vs XLA's number.

    python experiments/peak_memory.py [--out experiments/results]

Two models on N = 1, 2, 4, 8 emulated CPU devices: a Flax model zeroflow never saw (16 Dense
layers 512 wide + a head, bf16 compute, Adam, batch 16) and the trainer's GPT
(configs/tiny.yaml widened to 8 layers x 512, 33.7M parameters, fp32, remat full, batch 16).
Writes ``peak_memory.md`` and ``peak_memory.png`` to ``--out``; a few minutes on 2 CPU cores.
"""
from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_force_host_platform_device_count=8"
                           + " --xla_backend_optimization_level=0"
                           + " --xla_llvm_disable_expensive_passes=true").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse  # noqa: E402
import datetime  # noqa: E402
import pathlib  # noqa: E402
import time  # noqa: E402

from zeroflow.cli.common import start_script  # noqa: E402

start_script()  # before jax: where the CUDA plugin has no driver, a CPU jax without its noise

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402

import zeroflow as zf  # noqa: E402
from zeroflow.config.io import load_config  # noqa: E402
from zeroflow.memory.measure import state_bytes  # noqa: E402
from zeroflow.trainer.planning import abstract_setup  # noqa: E402

MB = 1e6
DEVICE_COUNTS = (1, 2, 4, 8)
GPT_OVERRIDES = ["model.num_layers=8", "model.embed_dim=512", "model.mlp_dim=2048",
                 "model.num_heads=8"]


class _Block(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.relu(nn.Dense(512)(x))


class DenseStack(nn.Module):
    remat: bool = False

    @nn.compact
    def __call__(self, x):
        block = nn.remat(_Block) if self.remat else _Block
        for _ in range(16):
            x = block()(x)
        return nn.Dense(10)(x)


def foreign_row(stage: int, devices: int, offload: str = "none", remat: bool = False) -> dict:
    """XLA's peak of the foreign Flax model's step."""
    model = DenseStack(remat=remat)
    params = jax.eval_shape(lambda: model.init(jax.random.key(0), jnp.zeros((1, 512)))["params"])

    def loss_fn(p, b):
        logits = model.apply({"params": p}, b["x"].astype(jax.tree.leaves(p)[0].dtype))
        return optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32),
                                                               b["y"]).mean()

    tx, prec = optax.adam(1e-3), zf.Precision(params="bf16")
    plan = zf.ZeroPlan(zf.make_mesh(data=devices, devices=jax.devices()[:devices]), stage=stage,
                       offload=offload)
    batch = {"x": jax.ShapeDtypeStruct((16, 512), jnp.float32),
             "y": jax.ShapeDtypeStruct((16,), jnp.int32)}
    _, measured = zf.memory.measure_step(loss_fn, params, batch, tx, plan, prec)
    return {"measured": measured, "psi": sum(x.size for x in jax.tree.leaves(params))}


def gpt_row(stage: int, devices: int, offload: str = "none", remat: str = "full") -> dict:
    cfg = load_config("configs/tiny.yaml", GPT_OVERRIDES)
    setup = abstract_setup(cfg, num_devices=devices, stage=stage, offload=offload,
                           update_on="device", remat=remat)
    measured = zf.memory.measure(setup.step, setup.state, setup.batch)
    host = state_bytes(setup.state).get("pinned_host", 0)
    return {"measured": measured.total_bytes - host, "psi": setup.num_params}


def zero_formula(stage: int, psi: float, n: int, precision: str) -> float:
    """The ZeRO paper's model states per device (``zf.memory.estimate``: K = 12 for mixed
    precision; fp32 keeps one fp32 copy that is both weights and master)."""
    return zf.memory.estimate(num_params=psi, num_devices=n, stage=stage,
                              precision=precision).device_bytes


def scaling(name: str, row_fn, precision: str, log) -> list[dict]:
    rows = []
    for n in DEVICE_COUNTS:
        for stage in ((0,) if n == 1 else (0, 1, 2, 3)):
            got = row_fn(stage, n)
            got.update(model=name, stage=stage, devices=n,
                       formula=zero_formula(stage, got["psi"], n, precision))
            rows.append(got)
            log(f"{name} N={n} stage {stage}: measured {got['measured'] / MB:.1f} MB, "
                f"formula {got['formula'] / MB:.1f} MB")
    return rows


def plot(rows: list[dict], path: pathlib.Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = sorted({r["model"] for r in rows})
    fig, axes = plt.subplots(1, len(models), figsize=(6 * len(models), 4.5))
    colors = {0: "tab:gray", 1: "tab:blue", 2: "tab:orange", 3: "tab:green"}
    for ax, model in zip(axes, models):
        for stage in (0, 1, 2, 3):
            pts = sorted((r["devices"], r) for r in rows if r["model"] == model
                         and (r["stage"] == stage or r["devices"] == 1))
            xs = [n for n, _ in pts]
            ax.plot(xs, [r["measured"] / MB for _, r in pts], "o-", color=colors[stage],
                    label=f"stage {stage} compiled")
            ax.plot(xs, [r["formula"] / MB for _, r in pts], ":", color=colors[stage],
                    label=f"stage {stage} ZeRO formula")
        ax.set_xscale("log", base=2)
        ax.set_xticks(DEVICE_COUNTS, [str(n) for n in DEVICE_COUNTS])
        ax.set_xlabel("data-parallel devices N")
        ax.set_ylabel("peak per device (MB)")
        ax.set_title(model)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7, ncol=2)
    fig.suptitle("Per-device peak of the compiled train step (XLA memory_analysis, emulated CPU)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def markdown(scaled: list[dict], command: str, seconds: float) -> str:
    lines = ["# Peak memory per device: ZeRO formula and compiled step", "",
             f"Made by `{command}` on the 2-core CPU development container "
             f"(8 emulated devices, jax {jax.__version__}), {datetime.date.today()}, in "
             f"{seconds / 60:.0f} min. Peak = XLA's `memory_analysis()` of the compiled step "
             "(arguments + outputs + temporaries - aliased; pinned-host state excluded); "
             "formula = the ZeRO paper's model states "
             "(no activations, no transients).", "",
             "## Peak against devices (the paper's Figure 1, measured)", "",
             "| model | N | stage | ZeRO formula (MB) | compiled (MB) | "
             "compiled / formula |", "|---|---:|---:|---:|---:|---:|"]
    for r in scaled:
        lines.append(f"| {r['model']} | {r['devices']} | {r['stage']} | {r['formula'] / MB:.1f} | "
                     f"{r['measured'] / MB:.1f} | {r['measured'] / r['formula']:.2f} |")
    lines += ["", "![peak memory](peak_memory.png)"]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="experiments/results", type=pathlib.Path)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    start = time.time()
    log = lambda m: print(f"[{time.time() - start:5.0f}s] {m}", flush=True)  # noqa: E731
    foreign = "foreign Flax model (16x512 Dense, bf16)"
    gpt = "trainer GPT (33.7M, fp32, remat full)"
    scaled = (scaling(foreign, foreign_row, "bf16", log)
              + scaling(gpt, lambda s, n: gpt_row(s, n), "fp32", log))
    plot(scaled, args.out / "peak_memory.png")
    text = markdown(scaled, "python experiments/peak_memory.py", time.time() - start)
    (args.out / "peak_memory.md").write_text(text)
    log(f"wrote {args.out / 'peak_memory.md'} and {args.out / 'peak_memory.png'}")


if __name__ == "__main__":
    main()
