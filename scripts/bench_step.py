"""Benchmark zeroflow's train step against plain jax+optax, and ZeRO-3 against ZeRO-0.

    python scripts/bench_step.py   # both comparisons; 1-2.5 min on a shared 2-core CPU, mostly compiling
    python scripts/bench_step.py --machine "2-core CPU container, 8 emulated devices" --out /tmp/bench.md
    python scripts/bench_step.py --comparison one_device --layers 4 --width 256 --dump-hlo /tmp/hlo

(a) ``one_device``: zeroflow stage 0 on one device vs a plain ``jax.jit(value_and_grad)`` + optax
    step with state donation. Goal: ratio <= 1.05.
(b) ``stages``: zeroflow stage ``--stage`` (default 3) vs stage 0 over ``--devices`` devices (emulated CPU devices when
    jax runs on CPU; on an accelerator the first ``--devices`` real ones).

Each comparison runs in its own subprocess because the emulated device count is read once,
when jax starts. Inside that process both steps are compiled, warmed up, then run alternately
(A, B, A, B, ...) so that load from other processes hits both alike; the table reports the
median step time of each and the ratio of the medians. This is a benchmark, not a test: it
asserts nothing.
"""
from __future__ import annotations

import argparse
import datetime
import functools
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any, NamedTuple

COMPARISONS = ("one_device", "stages")
_DEVICE_FLAG = "--xla_force_host_platform_device_count"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--comparison", choices=("all",) + COMPARISONS, default="all",
                   help="which comparison to run; 'all' runs each in a subprocess")
    p.add_argument("--devices", type=int, default=8, help="devices of the 'stages' comparison")
    p.add_argument("--stage", type=int, choices=(1, 2, 3), default=3,
                   help="the ZeRO stage the 'stages' comparison sets against stage 0")
    p.add_argument("--layers", type=int, default=2, help="decoder blocks")
    p.add_argument("--width", type=int, default=128, help="embedding width")
    p.add_argument("--heads", type=int, default=4, help="attention heads")
    p.add_argument("--seq", type=int, default=64, help="tokens per sequence")
    p.add_argument("--vocab", type=int, default=256, help="vocabulary size")
    p.add_argument("--batch", type=int, default=16, help="global batch (sequences per step)")
    p.add_argument("--params", choices=("fp32", "bf16"), default="fp32",
                   help="compute dtype of the weights (master weights are always fp32)")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps of each side after compiling")
    p.add_argument("--pairs", type=int, default=20, help="timed (baseline, zeroflow) pairs")
    p.add_argument("--no-control", dest="control", action="store_false",
                   help="skip the control row (the plain step against a twin of itself)")
    p.add_argument("--machine", default=None, help="free-text machine description for the header")
    p.add_argument("--out", type=Path, default=None, help="also write the markdown table here")
    p.add_argument("--dump-hlo", type=Path, default=None,
                   help="write the compiled HLO of both steps of each comparison to this folder")
    p.add_argument("--json", action="store_true", help=argparse.SUPPRESS)  # child -> parent
    return p


def _force_host_device_count(n: int) -> None:
    """Emulate ``n`` CPU devices; only has an effect if jax has not been imported yet."""
    flags = re.sub(rf"{_DEVICE_FLAG}=\d+", "", os.environ.get("XLA_FLAGS", ""))
    os.environ["XLA_FLAGS"] = f"{flags} {_DEVICE_FLAG}={n}".strip()


if __name__ == "__main__":
    _early, _ = build_parser().parse_known_args()
    if _early.comparison in COMPARISONS:
        _force_host_device_count(1 if _early.comparison == "one_device" else _early.devices)

from zeroflow.cli.common import start_script  # noqa: E402

start_script()  # before jax: where the CUDA plugin has no driver, a CPU jax without its noise

import flax.linen as nn  # noqa: E402  (after the device count is fixed)
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

try:
    import zeroflow as zf  # noqa: E402
except ImportError:  # run from a checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import zeroflow as zf  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchlib.timing import StepRunner, compare_to_baseline, interleaved_seconds  # noqa: E402


# ----------------------------------------------------------------------------- model
class Block(nn.Module):
    """Pre-norm decoder block: causal self-attention, then a 4x GELU MLP."""
    width: int
    heads: int

    @nn.compact
    def __call__(self, x):
        b, t, _ = x.shape
        qkv = nn.Dense(3 * self.width)(nn.LayerNorm()(x)).reshape(b, t, 3, self.heads, -1)
        q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k).astype(jnp.float32) / np.sqrt(q.shape[-1])
        scores = jnp.where(jnp.tril(jnp.ones((t, t), bool)), scores, -1e9)
        attn = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(scores).astype(v.dtype), v)
        x = x + nn.Dense(self.width)(attn.reshape(b, t, self.width))
        h = nn.gelu(nn.Dense(4 * self.width)(nn.LayerNorm()(x)))
        return x + nn.Dense(self.width)(h)


class TinyGPT(nn.Module):
    """A small GPT-like decoder; computes in the dtype of the parameters it is given."""
    vocab: int
    width: int
    heads: int
    layers: int
    seq: int

    @nn.compact
    def __call__(self, tokens):
        x = nn.Embed(self.vocab, self.width)(tokens)
        pos = self.param("pos", nn.initializers.normal(0.02), (self.seq, self.width))
        x = x + pos[: tokens.shape[1]]
        for _ in range(self.layers):
            x = Block(self.width, self.heads)(x)
        return nn.Dense(self.vocab)(nn.LayerNorm()(x))


def next_token_loss(params, batch, *, model: TinyGPT):
    logits = model.apply({"params": params}, batch["tokens"][:, :-1]).astype(jnp.float32)
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["tokens"][:, 1:]).mean()


def make_tx() -> optax.GradientTransformation:
    return optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(3e-4, weight_decay=0.01))


# ----------------------------------------------------------------------------- the plain step
class PlainState(NamedTuple):
    params: Any
    opt_state: Any


def plain_train_step(state: PlainState, batch, *, loss_fn, tx, compute_dtype):
    """What one writes without zeroflow: value_and_grad, optax update, fp32 params."""
    loss, grads = jax.value_and_grad(
        lambda p: loss_fn(jax.tree.map(lambda x: x.astype(compute_dtype), p), batch))(state.params)
    updates, opt_state = tx.update(grads, state.opt_state, state.params)
    return PlainState(optax.apply_updates(state.params, updates), opt_state), {"loss": loss}


# ----------------------------------------------------------------------------- timing
class Runner(StepRunner):
    """A step runner whose compiled HLO can be written out (``--dump-hlo``)."""

    def compiled_hlo(self) -> str:
        return self.step.lower(self.state, self.batch).compile().as_text()


def summarize(label: str, baseline: Runner, candidate: Runner, times) -> dict:
    compared = compare_to_baseline(*times)
    return {"comparison": label, "baseline": baseline.name, "candidate": candidate.name,
            "baseline_ms": 1e3 * compared.baseline_s, "candidate_ms": 1e3 * compared.candidate_s,
            "ratio": compared.ratio, "pair_ratio_iqr": compared.round_ratio_iqr}


def synthetic_batch(args, seed: int = 0):
    rng = np.random.default_rng(seed)
    return {"tokens": rng.integers(0, args.vocab, size=(args.batch, args.seq + 1), dtype=np.int32)}


def zeroflow_runner(name, args, stage, devices, params, loss_fn, batch) -> Runner:
    mesh = zf.make_mesh(data=len(devices), model=1, devices=devices)
    prec = zf.Precision(params=args.params, master="fp32", loss_scale="none")
    plan = zf.ZeroPlan(mesh, stage=stage)
    tx = make_tx()
    state = zf.init_train_state(params, tx, plan, prec)
    step = zf.make_train_step(loss_fn, tx, plan, prec, grad_accum=1)
    return Runner(name, step, state, jax.device_put(batch, plan.batch_sharding()))


def plain_step_fn(args, loss_fn):
    compute_dtype = zf.Precision(params=args.params).compute_dtype
    return jax.jit(functools.partial(plain_train_step, loss_fn=loss_fn, tx=make_tx(),
                                     compute_dtype=compute_dtype), donate_argnums=(0,))


def plain_runner(name, step, device, params, batch) -> Runner:
    # Fresh buffers: the step donates them, and ``params`` may be shared with other runners.
    params = jax.device_put(jax.tree.map(np.asarray, params), device)
    # Committed like the step's outputs, else the second call compiles again for new shardings.
    state = PlainState(params, jax.device_put(jax.jit(make_tx().init)(params), device))
    return Runner(name, step, state, jax.device_put(batch, device))


def build_runners(args, params, loss_fn, batch):
    """``[(label, baseline, candidate), ...]`` for ``args.comparison``."""
    if args.comparison == "one_device":
        device = jax.devices()[0]
        plain = plain_step_fn(args, loss_fn)
        baseline = plain_runner("plain jit+optax", plain, device, params, batch)
        candidate = zeroflow_runner("zeroflow stage 0", args, 0, [device], params, loss_fn, batch)
        pairs = [("(a) zeroflow stage 0 vs plain jit+optax, 1 device", baseline, candidate)]
        if args.control:
            # Same compiled step, second state: how far apart two identical steps measure here.
            twin = plain_runner("plain jit+optax (twin)", plain, device, params, batch)
            pairs.append(("(control) plain jit+optax vs itself, 1 device", baseline, twin))
        return pairs
    devices = jax.devices()[: args.devices]
    if len(devices) < args.devices:
        raise SystemExit(f"--devices {args.devices}: only {len(devices)} devices available")
    baseline = zeroflow_runner("zeroflow stage 0", args, 0, devices, params, loss_fn, batch)
    candidate = zeroflow_runner(f"zeroflow stage {args.stage}", args, args.stage, devices, params,
                                loss_fn, batch)
    return [(f"(b) zeroflow stage {args.stage} vs stage 0 (baseline), {len(devices)} devices",
             baseline, candidate)]


def run_comparison(args) -> list[dict]:
    model = TinyGPT(args.vocab, args.width, args.heads, args.layers, args.seq)
    loss_fn = functools.partial(next_token_loss, model=model)
    batch = synthetic_batch(args)
    params = jax.jit(model.init)(jax.random.PRNGKey(0), batch["tokens"][:1, :-1])["params"]
    rows = []
    for label, baseline, candidate in build_runners(args, params, loss_fn, batch):
        if args.dump_hlo and not label.startswith("(control)"):
            args.dump_hlo.mkdir(parents=True, exist_ok=True)
            for run in (baseline, candidate):
                name = re.sub(r"\W+", "_", f"{args.comparison}_{run.name}").strip("_")
                (args.dump_hlo / f"{name}.hlo.txt").write_text(run.compiled_hlo())
        times = interleaved_seconds([baseline, candidate], warmup=args.warmup, rounds=args.pairs)
        row = summarize(label, baseline, candidate, times)
        row.update(platform=jax.default_backend(), device_kind=jax.devices()[0].device_kind,
                   jax=jax.__version__, params=int(sum(np.size(x) for x in jax.tree.leaves(params))))
        rows.append(row)
    return rows


# ----------------------------------------------------------------------------- report
def child_command(args, comparison: str) -> list[str]:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--comparison", comparison, "--json"]
    for flag in ("devices", "stage", "layers", "width", "heads", "seq", "vocab", "batch", "params",
                 "warmup", "pairs", "dump_hlo"):
        value = getattr(args, flag)
        if value is not None:
            cmd += [f"--{flag.replace('_', '-')}", str(value)]
    return cmd + ([] if args.control else ["--no-control"])


def run_child(args, comparison: str) -> list[dict]:
    done = subprocess.run(child_command(args, comparison), capture_output=True, text=True)
    if done.returncode:
        sys.stderr.write(done.stderr)
        raise SystemExit(f"{comparison} comparison failed (exit {done.returncode})")
    return json.loads(done.stdout.strip().splitlines()[-1])


def markdown(rows: list[dict], args, command: str) -> str:
    first = rows[0]
    machine = args.machine or f"{os.cpu_count()}-core host"
    header = [
        f"- machine: {machine}; jax platform `{first['platform']}`, device kind "
        f"`{first['device_kind']}`",
        f"- jax {first['jax']}, date {datetime.date.today().isoformat()}",
        f"- command: `{command}`",
        f"- model: GPT-like, layers={args.layers} width={args.width} heads={args.heads} "
        f"seq={args.seq} vocab={args.vocab} ({first['params']:,} params), global batch "
        f"{args.batch}; compute {args.params}, master fp32; adamw + clip_by_global_norm(1.0)",
        f"- timing: {args.warmup} warmup steps each, then {args.pairs} alternating pairs "
        "(baseline, zeroflow); ratio = median zeroflow / median baseline; the last column is "
        "the spread of the per-pair ratios",
    ]
    table = [
        "| comparison | median ms baseline | median ms zeroflow | ratio | pair ratios p25-p75 |",
        "|---|---:|---:|---:|---:|",
    ]
    for r in rows:
        lo, hi = r["pair_ratio_iqr"]
        table.append(f"| {r['comparison']} | {r['baseline_ms']:.2f} | {r['candidate_ms']:.2f} "
                     f"| {r['ratio']:.3f}x | {lo:.2f}-{hi:.2f} |")
    return "\n".join(header) + "\n\n" + "\n".join(table) + "\n"


def main(argv=None) -> None:
    args = build_parser().parse_args(argv)
    if args.comparison == "all":
        rows = [row for comparison in COMPARISONS for row in run_child(args, comparison)]
    else:
        rows = run_comparison(args)
        if args.json:
            print(json.dumps(rows))
            return
    table = markdown(rows, args, shlex.join(["python", "scripts/bench_step.py", *sys.argv[1:]]))
    print(table)
    if args.out:
        args.out.write_text(table)


if __name__ == "__main__":
    main()
