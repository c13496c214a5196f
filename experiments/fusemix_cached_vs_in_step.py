"""FuseMix training on cached latents against the same training with the frozen encoders run
inside every step: steps per second at the same batch, one process, runs alternating.

    python experiments/fusemix_cached_vs_in_step.py
    # writes experiments/results/fusemix_cached_vs_in_step.md

Both variants are ``configs/fusemix.yaml``'s step through the ZeRO engine (the same adapters,
AdamW, latent mixup, symmetric InfoNCE, batch, precision): **cached** reads each batch's latents
from the cache the trainer builds (``zeroflow.fusemix.latents``); **in step** reads the batch's
pixels and token ids and runs the frozen CLIP vision tower and BERT (bf16, mean-pooled, as the
cache was made) inside the step, their weights frozen in the state (``trainable=``). Each timed
run is ``--steps`` steps including the host-to-device copy of every batch; the runs alternate
(cached, in step, cached, ...) so both see the same machine load, and each pair gives a ratio.

The encoders are the tiny random ones of ``scripts/make_tiny_encoders.py`` (2 layers, width 64,
32x32 images): the ratio here is a floor for real encoders, whose forward pass dwarfs the
adapters' step far more.
"""
from __future__ import annotations

import argparse
import datetime
import functools
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # this checkout's zeroflow, not an installed one

from zeroflow.cli.common import start_script  # noqa: E402

start_script()  # before jax: where the CUDA plugin has no driver, a CPU jax without its noise

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from machine import cpu_name  # noqa: E402
import zeroflow as zf  # noqa: E402
from zeroflow import hf  # noqa: E402
from zeroflow.config.io import load_config  # noqa: E402
from zeroflow.fusemix import digits, stream  # noqa: E402
from zeroflow.fusemix.model import IMAGE, TEXT  # noqa: E402
from zeroflow.fusemix.trainer import build_fusemix  # noqa: E402
from zeroflow.models.encoders import mean_pool  # noqa: E402

RESULTS = ROOT / "experiments" / "results" / "fusemix_cached_vs_in_step.md"


def in_step_loss(params, batch, *, rng=None, vision, text, adapter_loss):
    """Encode the batch with the frozen encoders (mean pooling, as the cache), then the
    trainer's FuseMix loss on those latents."""
    image = vision.apply({"params": params["vision"]}, batch["pixel_values"])["hidden"].mean(1)
    hidden = text.apply({"params": params["text"]}, batch["input_ids"],
                        batch["attention_mask"])["hidden"]
    latents = {IMAGE: image.astype(jnp.float32),
               TEXT: mean_pool(hidden, batch["attention_mask"]).astype(jnp.float32)}
    return adapter_loss(params["adapters"], latents, rng=rng)


def adapters_only(path, leaf):
    return path.startswith("adapters/")


def encoder_inputs(cfg, pairs, vision_enc, text_enc) -> dict[str, np.ndarray]:
    """What the encoders read, for every pair (as ``zeroflow.fusemix.latents`` makes it)."""
    pre = vision_enc.preprocessing
    pixels = digits.image_inputs(pairs.images, pre["image_size"], pre["mean"], pre["std"],
                                 pre["channels"])
    ids, mask = digits.text_inputs(pairs.captions, hf.load_tokenizer(cfg.fusemix.text_encoder),
                                   cfg.fusemix.max_text_len,
                                   int(text_enc.raw.get("pad_token_id") or 0))
    return {"pixel_values": pixels, "input_ids": ids, "attention_mask": mask}


class Variant:
    """One way to train: a step, its state, the arrays its batches are gathered from."""

    def __init__(self, name, step, state, arrays, run, sharding):
        self.name, self.step, self.state, self.arrays = name, step, state, arrays
        self.run, self.sharding, self.next = run, sharding, 0

    def timed(self, steps: int) -> float:
        """Steps per second over ``steps`` steps (batch copies included)."""
        tcfg = self.run.cfg.train
        t0 = time.perf_counter()
        metrics = None
        for _ in range(steps):
            rows = stream.batch_rows(self.run.train_rows, tcfg.batch_size, tcfg.seed, self.next)
            batch = jax.device_put({k: v[rows] for k, v in self.arrays.items()}, self.sharding)
            self.state, metrics = self.step(self.state, batch)
            self.next += 1
        jax.block_until_ready(metrics)
        return steps / (time.perf_counter() - t0)


def build(cfg):
    run = build_fusemix(cfg, progress=False)
    sharding = run.plan.batch_sharding()
    cached = Variant("cached", zf.make_train_step(run.loss_fn, run.tx, run.plan, run.prec),
                     run.init_state(), {k: np.asarray(v) for k, v in run.latents.items()}, run,
                     sharding)

    fm = cfg.fusemix
    vision, vision_params, vision_enc = hf.load_encoder(fm.image_encoder, fm.encode_dtype)
    text, text_params, text_enc = hf.load_encoder(fm.text_encoder, fm.encode_dtype)
    adapters = jax.device_get(run.init_state().params)
    params = {"adapters": jax.tree.map(lambda x: np.asarray(x, np.float32), adapters),
              "vision": vision_params, "text": text_params}
    loss_fn = functools.partial(in_step_loss, vision=vision, text=text, adapter_loss=run.loss_fn)
    state = zf.init_train_state(params, run.tx, run.plan, run.prec, rng=run.init_state().rng,
                                trainable=adapters_only)
    inputs = encoder_inputs(cfg, digits.digits_pairs(cfg.train.seed), vision_enc, text_enc)
    in_step = Variant("in step", zf.make_train_step(loss_fn, run.tx, run.plan, run.prec), state,
                      inputs, run, sharding)
    return run, cached, in_step


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--encoders", default="", help="folder of make_tiny_encoders.py's output "
                   "(default: made now in a temporary folder)")
    p.add_argument("--steps", type=int, default=200, help="steps per timed run")
    p.add_argument("--repeats", type=int, default=7, help="timed runs of each variant")
    p.add_argument("--out", default=str(RESULTS))
    args = p.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="fusemix-speed-"))
    encoders = Path(args.encoders) if args.encoders else work / "encoders"
    if not args.encoders:
        sys.path.insert(0, str(ROOT / "scripts"))
        import make_tiny_encoders
        make_tiny_encoders.main(["--out", str(encoders)])
    cfg = load_config(ROOT / "configs" / "fusemix.yaml", [
        f"fusemix.image_encoder={encoders / 'vision'}", f"fusemix.text_encoder={encoders / 'text'}",
        f"run.dir={work / 'run'}", "run.progress=false"])
    run, cached, in_step = build(cfg)
    for v in (cached, in_step):  # compile, and one step each outside the timing
        v.timed(2)
    rates: dict[str, list[float]] = {"cached": [], "in step": []}
    for i in range(args.repeats):
        for v in (cached, in_step) if i % 2 == 0 else (in_step, cached):
            rates[v.name].append(v.timed(args.steps))
        print(f"run {i + 1}: cached {rates['cached'][-1]:.1f} steps/s, in step "
              f"{rates['in step'][-1]:.1f} steps/s", flush=True)
    write(args, cfg, run, rates)
    return 0


def write(args, cfg, run, rates) -> None:
    ratios = [c / s for c, s in zip(rates["cached"], rates["in step"])]
    med = {k: statistics.median(v) for k, v in rates.items()}
    enc = {k: v.shape[1] for k, v in run.latents.items()}
    command = "python experiments/fusemix_cached_vs_in_step.py" + "".join(
        f" {a}" for a in sys.argv[1:])
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    lines = [
        "# FuseMix: training on cached latents vs the encoders inside the step", "",
        f"`{command}` on a {os.cpu_count()}-core CPU machine "
        f"({cpu_name()}, load average {load:.1f} at the end), "
        f"{datetime.date.today().isoformat()}, jax {jax.__version__}, "
        f"{jax.devices()[0].platform.upper()} backend, one device. **CPU, tiny random "
        "encoders** (scripts/make_tiny_encoders.py: CLIP vision and BERT, 2 layers, width 64, "
        "32x32 images in 8x8 patches, 16-token captions): not a GPU figure.", "",
        f"`configs/fusemix.yaml`'s step at batch {cfg.train.batch_size} (adapters "
        f"{cfg.fusemix.adapter_layers} x {cfg.fusemix.adapter_hidden} into "
        f"{cfg.fusemix.shared_dim}, {enc[IMAGE]}-d image and {enc[TEXT]}-d text latents, "
        f"ZeRO stage {cfg.parallel.zero_stage}, "
        f"params {cfg.precision.params}); each timed run {args.steps} steps with every batch's "
        f"host-to-device copy, {args.repeats} runs of each variant alternating, medians.", "",
        "| variant | steps/s (median) | runs |", "|---|---|---|",
        f"| cached latents | **{med['cached']:.1f}** | "
        f"{', '.join(f'{r:.1f}' for r in rates['cached'])} |",
        f"| encoders in the step | **{med['in step']:.1f}** | "
        f"{', '.join(f'{r:.1f}' for r in rates['in step'])} |", "",
        f"Cached / in step: **{statistics.median(ratios):.2f}x** (median of the {len(ratios)} "
        f"pairs' ratios: {', '.join(f'{r:.2f}' for r in ratios)}).",
    ]
    Path(args.out).write_text("\n".join(lines) + "\n")
    print("\n".join(lines[-1:]))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    sys.exit(main())
