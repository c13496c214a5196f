"""Benchmark zf.autocast: tokens/s and XLA's peak memory of the same GPT trained in fp32, under
autocast bf16, hand-written bf16 (zeroflow's GPT given bf16 weights) and, if it imports, grampax.

    python scripts/bench_autocast.py                  # small CPU config, ~1-2 min on 2 cores
    python scripts/bench_autocast.py --layers 12 --width 768 --heads 12 --seq 1024 --batch 8 \\
        --vocab 50304 --machine "1x H100"             # a GPT-2-small-sized run on a GPU
    python scripts/bench_autocast.py --highest        # also fp32 at 'highest' matmul precision

Every variant is zeroflow's GPT (``zeroflow.models``) through ``zf.make_train_step`` at stage 0
on one device, with the same AdamW, batch and step; only ``zf.Precision`` differs:

- fp32 (default precision): ``Precision(params="fp32")``. XLA's default precision for fp32
  matmuls: on Ampere and later GPUs that is TF32; on CPU true fp32.
- fp32 (highest): the same under ``jax.default_matmul_precision("highest")`` (``--highest``).
- autocast bf16: ``Precision(params="fp32", autocast="bf16")``: weights fp32 at rest, cast at use.
- autocast bf16, bf16 weights: ``Precision(params="bf16", autocast="bf16")``.
- hand-written bf16: ``Precision(params="bf16")``: the GPT casts by hand (the goal to match).
- grampax bf16: ``grampax.autocast(loss, dtype=bf16)`` with fp32 weights (skipped with the
  reason when grampax does not import).

All variants are compiled and warmed up, then run round-robin (one step of each per round) so
that load from other processes hits them alike; the table reports each one's median step
time, tokens/s and the ratios of medians. Memory is XLA's accounting of the compiled step
(``memory_analysis``): total = arguments + outputs + temporaries - aliased (the usual peak
estimate), the temporaries alone (activations kept for the backward pass and scratch), and
XLA's own peak on accelerators.
This is a benchmark, not a test: it asserts nothing.
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import io
import os
import shlex
import sys
from pathlib import Path

from zeroflow.cli.common import start_script

start_script()  # before jax: where the CUDA plugin has no driver, a CPU jax without its noise

import jax
import jax.numpy as jnp
import numpy as np
import optax

try:
    import zeroflow as zf
except ImportError:  # run from a checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import zeroflow as zf
from zeroflow.config.schema import ModelConfig
from zeroflow.memory.measure import measure
from zeroflow.models import make_loss_fn, param_init_fn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchlib.timing import compare_to_baseline, interleaved_seconds  # noqa: E402


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--mlp", type=int, default=0, help="MLP width (default 4 x width)")
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--batch", type=int, default=8, help="sequences per step")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps of each variant")
    p.add_argument("--rounds", type=int, default=15, help="timed round-robin rounds")
    p.add_argument("--highest", action="store_true", help="add fp32 at 'highest' matmul precision")
    p.add_argument("--no-grampax", dest="grampax", action="store_false", help="skip grampax")
    p.add_argument("--machine", default=None, help="free-text machine description for the header")
    p.add_argument("--out", type=Path, default=None, help="also write the markdown table here")
    return p


class Variant:
    """One precision setting: a compiled, state-donating step and the state it threads."""

    def __init__(self, name, loss_fn, prec, cfg, batch, *, matmul_precision=None):
        self.name, self.matmul_precision = name, matmul_precision
        plan = zf.ZeroPlan(zf.make_mesh(data=1, model=1, devices=jax.devices()[:1]), stage=0)
        tx = optax.adamw(3e-4, weight_decay=0.01)
        init = param_init_fn(cfg)
        self.state = zf.init_train_state(lambda: init(jax.random.key(0)), tx, plan, prec)
        self.step = zf.make_train_step(loss_fn, tx, plan, prec)
        self.batch = jax.device_put(batch, plan.batch_sharding())
        self.times: list[float] = []

    def context(self):
        if self.matmul_precision is None:
            return contextlib.nullcontext()
        return jax.default_matmul_precision(self.matmul_precision)

    def run(self):
        with self.context():
            self.state, metrics = self.step(self.state, self.batch)
        return metrics

    def memory(self):
        with self.context():
            return measure(self.step, self.state, self.batch)


def grampax_loss(loss_fn):
    """``loss_fn`` under grampax's autocast, or the reason it is not available."""
    try:
        import grampax
    except Exception as err:
        return None, f"grampax not importable: {type(err).__name__}: {err}"
    return grampax.autocast(loss_fn, dtype=jnp.bfloat16), ""


def variants(args, cfg, batch):
    loss_fn = make_loss_fn(cfg)
    out = [Variant("fp32 (default matmul precision)", loss_fn, zf.Precision(), cfg, batch)]
    if args.highest:
        out.append(Variant("fp32 (highest matmul precision)", loss_fn, zf.Precision(), cfg, batch,
                           matmul_precision="highest"))
    out += [
        Variant("autocast bf16 (fp32 weights)", loss_fn, zf.Precision(autocast="bf16"), cfg, batch),
        Variant("autocast bf16 (bf16 weights)", loss_fn, zf.Precision(params="bf16", autocast="bf16"),
                cfg, batch),
        Variant("hand-written bf16 (zeroflow GPT)", loss_fn, zf.Precision(params="bf16"), cfg, batch),
    ]
    notes = []
    if args.grampax:
        loss, why = grampax_loss(loss_fn)
        if loss is None:
            notes.append(why)
        else:
            out.append(Variant("grampax bf16 (fp32 weights)", loss, zf.Precision(), cfg, batch))
    return out, notes


def drop_failing(runs: list[Variant], notes: list[str]) -> list[Variant]:
    """Compile and run each variant once; one that fails (grampax on a jax it does not
    support) is reported in the notes instead of stopping the benchmark."""
    kept = []
    for v in runs:
        try:
            with contextlib.redirect_stdout(io.StringIO()):  # grampax prints while it fails
                jax.block_until_ready(v.run())
            kept.append(v)
        except Exception as err:
            if v.name.startswith("fp32 (default") or v.name.startswith("hand-written"):
                raise
            first = str(err).strip().splitlines()[0] if str(err).strip() else ""
            notes.append(f"{v.name} failed: {type(err).__name__}: {first}")
    return kept


def time_interleaved(runs: list[Variant], warmup: int, rounds: int) -> None:
    for v, times in zip(runs, interleaved_seconds([v.run for v in runs], warmup=warmup,
                                                  rounds=rounds)):
        v.times = times


def markdown(runs, notes, args, cfg, command: str) -> str:
    tokens = args.batch * args.seq
    hand = next(v for v in runs if v.name.startswith("hand-written"))
    device = jax.devices()[0]
    n_params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(runs[0].state.master))
    lines = [
        f"- machine: {args.machine or f'{os.cpu_count()}-core host'}; jax platform "
        f"`{jax.default_backend()}`, device `{device.device_kind}`",
        f"- jax {jax.__version__}, date {datetime.date.today().isoformat()}",
        f"- command: `{command}`",
        f"- model: zeroflow GPT, layers={cfg.num_layers} width={cfg.embed_dim} heads={cfg.num_heads} "
        f"mlp={cfg.mlp_dim} seq={cfg.seq_len} vocab={cfg.vocab_size} ({n_params:,} params, tied "
        f"embeddings), batch {args.batch} x {args.seq} = {tokens} tokens/step; AdamW; stage 0, one device",
        f"- timing: {args.warmup} warmup steps each, then {args.rounds} round-robin rounds; medians",
        "",
        "| variant | median ms | tokens/s | vs fp32 default | vs hand-written bf16 | XLA total MiB "
        "| temporaries MiB | XLA peak MiB |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for v in runs:
        vs_fp32 = compare_to_baseline(runs[0].times, v.times)
        vs_hand = compare_to_baseline(hand.times, v.times)
        t = vs_fp32.candidate_s
        mem = v.memory()
        # XLA:CPU's own "peak" leaves out temporaries; it is shown only for accelerators
        peak = f"{mem.peak_bytes / 2**20:.1f}" if jax.default_backend() != "cpu" and mem.peak_bytes else "-"
        lines.append(f"| {v.name} | {1e3 * t:.2f} | {tokens / t:,.0f} | {1 / vs_fp32.ratio:.2f}x | "
                     f"{1 / vs_hand.ratio:.2f}x | {mem.total_bytes / 2**20:.1f} | {mem.temp_bytes / 2**20:.1f} "
                     f"| {peak} |")
    lines += [f"\n- {n}" for n in notes]
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    args = build_parser().parse_args(argv)
    cfg = ModelConfig(vocab_size=args.vocab, seq_len=args.seq, num_layers=args.layers,
                      embed_dim=args.width, num_heads=args.heads, mlp_dim=args.mlp or 4 * args.width,
                      attention="xla", remat="none")
    rng = np.random.default_rng(0)
    batch = {"tokens": rng.integers(0, args.vocab, (args.batch, args.seq + 1), dtype=np.int32)}
    runs, notes = variants(args, cfg, batch)
    runs = drop_failing(runs, notes)
    time_interleaved(runs, args.warmup, args.rounds)
    table = markdown(runs, notes, args, cfg, shlex.join(["python", "scripts/bench_autocast.py", *sys.argv[1:]]))
    print(table)
    if args.out:
        args.out.write_text(table)


if __name__ == "__main__":
    main()
