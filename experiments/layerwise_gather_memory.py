"""Compiled memory of a ZeRO-3 step that gathers the GPT one layer at a time, against gathering
every weight up front and against stage 0 (XLA's own accounting, ``memory_analysis``).

    python experiments/layerwise_gather_memory.py [--devices 8] [--layers 4]

On a CPU the devices are emulated. Prints one markdown table and the losses of two steps of
each variant (they must agree).
"""
import argparse
import os

args_parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
args_parser.add_argument("--devices", type=int, default=8, help="emulated CPU devices (CPU only)")
args_parser.add_argument("--layers", type=int, default=4)
args = args_parser.parse_args()
os.environ.setdefault("XLA_FLAGS", f"--xla_force_host_platform_device_count={args.devices}")

from zeroflow.cli.common import start_script  # noqa: E402

start_script()  # before jax: where the CUDA plugin has no driver, a CPU jax without its noise

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import zeroflow as zf  # noqa: E402
from zeroflow.config.schema import ModelConfig  # noqa: E402
from zeroflow.models import init_params, make_layerwise_loss_fn, make_loss_fn  # noqa: E402

cfg = ModelConfig(vocab_size=256, seq_len=32, num_layers=args.layers, embed_dim=64, num_heads=4,
                  mlp_dim=256, remat="full")
params, _ = init_params(cfg, jax.random.key(0))
batches = [{"tokens": np.random.default_rng(s).integers(0, 256, size=(16, 33), dtype=np.int32)} for s in range(2)]
print(f"{jax.device_count()} {jax.default_backend()} devices, jax {jax.__version__}, {args.layers}-layer GPT\n")
print("| variant | temp MB (memory_analysis) | losses |\n|---|---:|---|")
for name, stage, per_layer in [("stage 0", 0, False), ("stage 3, gather all up front", 3, False),
                               ("stage 3, one layer at a time", 3, True)]:
    plan, prec, tx = zf.ZeroPlan(zf.make_mesh(), stage=stage), zf.Precision(), optax.adam(1e-3)
    state = zf.init_train_state(params, tx, plan, prec)
    step = zf.make_train_step(make_layerwise_loss_fn(cfg) if per_layer else make_loss_fn(cfg), tx, plan, prec,
                              gather_per_layer="layers" if per_layer else None)
    temp = step.lower(state, batches[0]).compile().memory_analysis().temp_size_in_bytes
    losses = []
    for b in batches:
        state, m = step(state, b)
        losses.append(round(float(m["loss"]), 6))
    print(f"| {name} | {temp / 1e6:.2f} | {losses} |")
