"""The estimator against XLA:GPU on one abstract H100 for a small model, where activations are
a large part of the peak (the fit table's 8B rows are dominated by weights and state).

    python experiments/one_gpu_estimates.py    # writes experiments/results/one_gpu_estimates.md

The model is ``tests/test_fit_estimates.py``'s: an embedding, four scanned stacks of 8 layers
(512 x 2048 and back, twice per layer) and a head, 34M parameters, bf16 weights, one sequence
of 512 tokens. Each row compiles the step for the target (offloaded plans through CPU stand-ins,
``zeroflow.memory.on_target``) and compares ``memory_analysis()`` with ``estimate_step``.
Nothing runs; about a minute on 2 CPU cores.
"""
from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # the CUDA plugin describes targets only then
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_force_host_platform_device_count=1").strip()

import argparse  # noqa: E402
import datetime  # noqa: E402
import platform  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402

sys.path.insert(0, str(Path(__file__).parents[1] / "tests"))
import test_fit_estimates as model  # noqa: E402

import zeroflow as zf  # noqa: E402

RESULTS = Path(__file__).parent / "results" / "one_gpu_estimates.md"
TOKENS = 512
OPTIMIZERS = {"adamw": lambda: optax.adamw(1e-3), "adamw_8bit": lambda: zf.optim.adamw_8bit(1e-3)}
ROWS = [("adamw", "none", "device"), ("adamw", "optimizer", "device"),
        ("adamw", "optimizer", "host"), ("adamw_8bit", "none", "device"),
        ("adamw_8bit", "optimizer", "device")]


def measure(optimizer, offload, update_on):
    params, prec = model._params(), zf.Precision(params="bf16")
    batch = {"tokens": jax.ShapeDtypeStruct((1, TOKENS + 1), jnp.int32)}
    plan = zf.ZeroPlan(zf.target_mesh("h100", data=1), stage=3, offload=offload,
                       update_on=update_on)
    tx = OPTIMIZERS[optimizer]()
    _, measured = zf.memory.measure_step(model.loss_fn, params, batch, tx, plan, prec)
    est = zf.memory.estimate_step(model.loss_fn, params, batch, tx, plan, prec)
    line = (f"| {optimizer} | {offload} | {update_on} | {measured / 1e6:,.1f} | "
            f"{est.peak_bytes / 1e6:,.1f} | {est.peak_bytes / measured - 1:+.1%} | {est.phase} |")
    print(line, file=sys.stderr, flush=True)
    return line


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    lines = [measure(*row) for row in ROWS]
    head = (f"# The estimator against XLA:GPU, one H100, a 34M-parameter model\n\n"
            f"`python experiments/one_gpu_estimates.py` on a {os.cpu_count()}-core CPU machine "
            f"without a GPU ({platform.machine()}), {datetime.date.today()}, jax "
            f"{jax.__version__}: stage 3, bf16 weights, one sequence of {TOKENS} tokens.\n\n"
            "| optimizer | offload | update_on | XLA:GPU peak MB | estimate MB | error | phase |\n"
            "|---|---|---|---|---|---|---|\n")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(head + "\n".join(lines) + "\n")
    print(f"wrote {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
