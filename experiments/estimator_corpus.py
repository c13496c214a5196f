"""``zf.memory.estimate_step`` on models it was not written for, against XLA:CPU's compiled peak.

The models are the test corpus (``tests/model_corpus.py``: an Equinox transformer, a Flax NNX
network with attention, BatchNorm and Dropout, an Equinox CNN) at its ``LARGER`` size, 8
emulated CPU devices, 64 examples per step, AdamW, fp32, stages 1-3. Per row: the estimate, XLA's
peak (``zf.memory.measure_step``), their ratio, and the estimate's largest terms; then the same
against XLA:GPU compiled for 8 abstract H100s (where a CUDA plugin is installed). A last
table checks the activation term alone: ``zeroflow.memory.liveness.peak_bytes`` of one device's
gradient (8 examples) against the temporaries XLA allocates for that gradient compiled for one
device (XLA:CPU, and XLA:GPU for one abstract H100 with the walk's GPU rules).

    python experiments/estimator_corpus.py    # writes experiments/results/estimator_corpus.md
"""
from __future__ import annotations

import datetime
import os
import platform
import sys
from pathlib import Path

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))

import jax  # noqa: E402
import optax  # noqa: E402

from jax.sharding import NamedSharding, PartitionSpec  # noqa: E402

import zeroflow as zf  # noqa: E402
from zeroflow import backend  # noqa: E402
from zeroflow.backend.traits import for_platform  # noqa: E402
from zeroflow.memory import liveness  # noqa: E402
from zeroflow.util.compat import cuda_plugin_module  # noqa: E402
from model_corpus import CORPUS, LARGER, engine_loss  # noqa: E402

RESULTS = HERE / "results" / "estimator_corpus.md"
BATCH = 64


def rows(mesh=None, backend=None):
    """Estimate and compiled peak per corpus model and stage, on ``mesh`` (default: the 8 CPU
    devices; a ``zf.target_mesh`` compiles for GPUs that are not here)."""
    tx = optax.adamw(1e-3)
    for name, make in CORPUS.items():
        corpus = make(0, LARGER)
        batch = corpus.batches(1, BATCH)[0]
        loss = engine_loss(corpus.forward, corpus.model_state is not None)
        extras = dict(model_state=corpus.model_state, rng=jax.random.key(0))
        for stage in (1, 2, 3):
            plan, prec = zf.ZeroPlan(mesh or zf.make_mesh(), stage=stage), zf.Precision()
            est = zf.memory.estimate_step(loss, corpus.params, batch, tx, plan, prec,
                                          backend=backend, **extras)
            _, peak = zf.memory.measure_step(loss, corpus.params, batch, tx, plan, prec, **extras)
            terms = sorted(est.terms().items(), key=lambda kv: -kv[1])[:3]
            yield name, stage, est.peak_bytes, peak, terms


def gradient_rows(gpu: bool = False):
    """Per corpus model: the walk of one device's gradient and the temporaries XLA allocates
    for it, compiled for this CPU or (``gpu``) for one abstract H100."""
    for name, make in CORPUS.items():
        corpus = make(0, LARGER)
        batch = corpus.batches(1, BATCH // 8)[0]

        def loss(params, batch, model_state):
            # (fresh model-state values inside the trace: NNX mutates only its own)
            here = jax.tree.map(lambda x: x, model_state)
            return corpus.forward(params, here, batch, jax.random.key(0))[0]
        grad = jax.grad(loss)
        args = (corpus.params, batch, corpus.model_state)
        closed = jax.make_jaxpr(grad)(*args)
        if gpu:
            on_h100 = NamedSharding(zf.target_mesh("h100", data=1), PartitionSpec())
            args = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=on_h100),
                                args)
            with backend.tracing_for(for_platform("gpu")):
                walked = liveness.peak_bytes(closed)
        else:
            walked = liveness.peak_bytes(closed)
        temp = jax.jit(grad).trace(*args).lower().compile().memory_analysis().temp_size_in_bytes
        yield name, walked, temp


def _table(found) -> list[str]:
    lines = []
    for name, stage, est, peak, terms in found:
        shown = ", ".join(f"{k} {v / 1e6:.2f}" for k, v in terms)
        line = (f"| {name} | {stage} | {est / 1e6:.2f} MB | {peak / 1e6:.2f} MB | "
                f"{est / peak:.2f} | {shown} |")
        print(line, flush=True)
        lines.append(line)
    return lines


def main() -> None:
    lines = ["# estimate_step on models it was not written for\n",
             f"{datetime.date.today()}, {platform.node() or 'this machine'}: "
             f"{os.cpu_count()} CPU cores, jax {jax.__version__}, 8 emulated CPU devices. "
             f"Command: `python experiments/estimator_corpus.py`.\n",
             "| model | stage | estimate | XLA:CPU peak | estimate / XLA | largest terms |",
             "|---|---|---|---|---|---|"]
    lines += _table(rows())
    if cuda_plugin_module() is None:
        print("no CUDA plugin installed: the XLA:GPU table is left out", flush=True)
    else:
        lines += ["", "The same steps compiled by XLA:GPU for 8 abstract H100s "
                  "(`zf.target_mesh('h100', data=8)`, no GPU; the estimate with "
                  "`backend='gpu'`).", "",
                  "| model | stage | estimate | XLA:GPU peak | estimate / XLA | largest terms |",
                  "|---|---|---|---|---|---|"]
        lines += _table(rows(zf.target_mesh("h100", data=8), backend="gpu"))
    lines += ["", "One device's gradient (8 examples): the walk against the temporaries XLA allocates "
              "for it (XLA:GPU: one abstract H100, the walk with `backend='gpu'`'s rules).", "",
              "| model | liveness.peak_bytes | XLA temp | walk / XLA |", "|---|---|---|---|"]
    for gpu in ((False, True) if cuda_plugin_module() is not None else (False,)):
        for name, walked, temp in gradient_rows(gpu):
            label = f"{name} ({'XLA:GPU' if gpu else 'XLA:CPU'})"
            line = f"| {label} | {walked / 1e6:.2f} MB | {temp / 1e6:.2f} MB | {walked / temp:.2f} |"
            print(line, flush=True)
            lines.append(line)
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text("\n".join(lines) + "\n")
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
