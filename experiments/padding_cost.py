"""What ZeRO padding costs: one train step of a tied 50257 x 100 embedding (GPT-2's vocabulary,
which no device count divides) against the same step on a 50264-row table (divisible by 8),
at stages 1-3 on 8 emulated CPU devices. Reads XLA's own accounting of the compiled step
(temporary bytes per device) and counts the collectives in its HLO; nothing is run.

    python experiments/padding_cost.py
"""
from __future__ import annotations

import os
import re

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
                           " --xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

from zeroflow.cli.common import start_script  # noqa: E402

start_script()  # before jax: where the CUDA plugin has no driver, a CPU jax without its noise

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import zeroflow as zf  # noqa: E402

WIDTH, BATCH = 100, 16
COLLECTIVES = ("all-gather", "reduce-scatter", "all-reduce", "collective-permute", "all-to-all")


def loss_fn(params, batch):
    h = params["embedding"][batch["tokens"]]
    logits = h @ params["embedding"].T + params["out_bias"]
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"]).mean()


def compiled(vocab: int, stage: int):
    params = {"embedding": jax.ShapeDtypeStruct((vocab, WIDTH), jnp.float32),
              "out_bias": jax.ShapeDtypeStruct((vocab,), jnp.float32)}
    plan, prec, tx = zf.ZeroPlan(zf.make_mesh(), stage=stage), zf.Precision(), optax.adamw(1e-2)
    state = jax.eval_shape(lambda: zf.init_train_state(
        lambda: jax.tree.map(lambda s: jnp.zeros(s.shape), params), tx, plan, prec))
    shardings = zf.state_shardings(params, tx, plan, prec)
    state = jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), state, shardings)
    batch = {k: jax.ShapeDtypeStruct((BATCH,), np.int32, sharding=plan.batch_sharding())
             for k in ("tokens", "targets")}
    return zf.make_train_step(loss_fn, tx, plan, prec).lower(state, batch).compile()


def main() -> None:
    print(f"{jax.device_count()} x {jax.devices()[0].device_kind}, jax {jax.__version__}")
    print("| stage | table rows | temporaries per device (MB) | collectives in the step |")
    print("|---|---|---|---|")
    for stage in (1, 2, 3):
        for vocab in (50264, 50257):
            c = compiled(vocab, stage)
            hlo = c.as_text()
            counts = {op: len(re.findall(rf"\b{op}(-start)?\(", hlo)) for op in COLLECTIVES}
            ops = ", ".join(f"{op} {n}" for op, n in counts.items() if n)
            label = f"{vocab} ({'padded to 50264' if vocab % 8 else 'divisible'})"
            print(f"| {stage} | {label} | {c.memory_analysis().temp_size_in_bytes / 1e6:.1f} | {ops} |")


if __name__ == "__main__":
    main()
