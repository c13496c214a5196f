"""Offload benchmarks for one accelerator: step-time cost of offloading, and the largest GPT
that trains with and without it.

    python scripts/bench_offload.py                 # on a GPU: ~1B GPT ratio + largest-model search
    python scripts/bench_offload.py --quick         # CPU smoke test of the same code, < 1 minute
    python scripts/bench_offload.py --mode ratio --steps 20 --width 2048 --layers 18

*ratio*: median step time of each offload choice divided by the plain run's, for a GPT of
``--layers`` x ``--width`` (default ~1.0B parameters: 18 layers, width 2048, SwiGLU 5632,
vocab 32000, seq 1024, batch 8, bf16, remat full). Goal: <= 1.5x for offload="optimizer",
update_on="device".

*largest*: for offload none and optimizer(+params), binary search on ``num_layers`` at width
``--width`` for the deepest GPT whose training step fits. ``--fit-by run`` (default on GPU)
runs two real steps in a fresh subprocess per probe (an out-of-memory error means "does not
fit"); ``--fit-by compile`` compiles ahead of time and compares XLA's memory analysis with
``--device-memory`` (nothing is allocated; the CPU smoke test uses this).

Results go to ``--out`` as bench_offload.json and bench_offload.md.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pathlib
import statistics
import subprocess
import sys
import time

CHOICES = [("none", "device"), ("optimizer", "device"), ("optimizer", "host"),
           ("optimizer+params", "device"), ("optimizer+params", "host")]
OOM_EXIT = 3
FAST_CPU_COMPILE = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
"XLA:CPU flags for the smoke test: ~3x faster compiles, same buffers (memory analysis unchanged)."


def model_config(args, layers: int | None = None):
    from zeroflow.config import Config
    cfg = Config()
    heads = max(1, args.width // 128)
    cfg.model = dataclasses.replace(
        cfg.model, num_layers=layers or args.layers, embed_dim=args.width, num_heads=heads,
        mlp_dim=args.mlp_dim or (int(args.width * 8 / 3) + 127) // 128 * 128,
        vocab_size=args.vocab, seq_len=args.seq_len, remat=args.remat)
    cfg.train.batch_size = args.batch
    cfg.precision.params = "bf16"
    cfg.parallel.zero_stage = args.stage
    return cfg


def build(cfg, offload: str, update_on: str):
    """Real (allocated) state, a step and a device batch for ``cfg`` on all devices, assembled
    by the trainer's ``build_run`` (its optimizer, precision and layer-wise gathering)."""
    import jax
    import numpy as np

    from zeroflow.trainer.setup import build_run

    parallel = dataclasses.replace(cfg.parallel, offload=offload,
                                   update_on=update_on if offload != "none" else "device")
    run = build_run(dataclasses.replace(cfg, parallel=parallel), with_data=False)
    tokens = np.random.default_rng(0).integers(0, cfg.model.vocab_size,
                                               (cfg.train.batch_size, cfg.model.seq_len + 1), np.int32)
    batch = {"tokens": jax.device_put(tokens, run.plan.batch_sharding())}
    return run.init_state(), run.make_step(), batch


def time_steps(cfg, offload: str, update_on: str, steps: int, warmup: int) -> dict:
    import jax
    state, step, batch = build(cfg, offload, update_on)
    start = time.perf_counter()
    for _ in range(warmup):
        state, metrics = step(state, batch)
    jax.block_until_ready(metrics)
    compile_and_warmup = time.perf_counter() - start
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        state, metrics = step(state, batch)
        jax.block_until_ready((state, metrics))
        times.append(time.perf_counter() - start)
    return {"offload": offload, "update_on": update_on, "median_s": statistics.median(times),
            "min_s": min(times), "warmup_s": compile_and_warmup,
            "loss": float(jax.device_get(metrics["loss"]))}


def fits_by_compile(cfg, offload: str, update_on: str, device_memory: int) -> tuple[bool, float]:
    import jax

    from zeroflow import memory
    from zeroflow.memory.measure import abstract_setup
    setup = abstract_setup(cfg, num_devices=jax.device_count(), stage=cfg.parallel.zero_stage,
                           offload=offload, update_on=update_on, remat=cfg.model.remat)
    got = memory.measure(setup.step, setup.state, setup.batch)
    need = got.total_bytes
    if jax.default_backend() == "cpu":  # CPU counts pinned_host arrays as device arguments
        need -= memory.state_bytes(setup.state).get("pinned_host", 0)
    return need <= device_memory, float(need)


def probe_in_subprocess(args, layers: int, offload: str, update_on: str) -> bool:
    cmd = [sys.executable, __file__, "--probe", "--layers", str(layers), "--offload", offload,
           "--update-on", update_on, *args.model_flags]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=args.probe_timeout)
    except subprocess.TimeoutExpired:
        return False
    if done.returncode not in (0, OOM_EXIT):
        print(f"    probe failed (exit {done.returncode}): {done.stderr.strip().splitlines()[-1:]}")
    return done.returncode == 0


def largest(args, offload: str, update_on: str) -> dict:
    """Deepest num_layers that fits: double until it does not, then bisect."""
    def fits(layers: int) -> bool:
        if args.fit_by == "compile":
            ok, need = fits_by_compile(model_config(args, layers), offload, update_on,
                                       args.device_memory_bytes)
        else:
            ok, need = probe_in_subprocess(args, layers, offload, update_on), None
        print(f"  {offload}/{update_on}: {layers} layers -> {'fits' if ok else 'does not fit'}"
              + (f" ({need / 1e9:.3f} GB)" if need is not None else ""), flush=True)
        return ok

    if not fits(1):
        return {"offload": offload, "update_on": update_on, "layers": 0, "params": 0}
    lo, hi = 1, 2
    while hi <= args.max_layers and fits(hi):
        lo, hi = hi, hi * 2
    hi = min(hi, args.max_layers + 1)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    from zeroflow.memory import count_gpt_params
    return {"offload": offload, "update_on": update_on, "layers": lo,
            "params": count_gpt_params(model_config(args, lo).model)}


def run_probe(args) -> int:
    """Child process: two real steps; exit OOM_EXIT on out-of-memory."""
    try:
        time_steps(model_config(args), args.offload, args.update_on, steps=1, warmup=1)
    except Exception as e:  # jax raises XlaRuntimeError / ValueError subclasses for OOM
        text = str(e)
        if "RESOURCE_EXHAUSTED" in text or "Out of memory" in text or "out of memory" in text:
            return OOM_EXIT
        raise
    return 0


def report(results: dict, out: pathlib.Path) -> None:
    lines = [f"# Offload benchmark ({results['device']})", "", f"model: {results['model']}", ""]
    if results.get("ratio"):
        base = results["ratio"][0]["median_s"]
        lines += ["| offload | update_on | median step (s) | vs none |", "|---|---|---|---|"]
        lines += [f"| {r['offload']} | {r['update_on']} | {r['median_s']:.4f} | {r['median_s'] / base:.2f}x |"
                  for r in results["ratio"]]
        lines.append("")
    if results.get("largest"):
        lines += [f"largest GPT at width {results['width']} (fit by {results['fit_by']}):", "",
                  "| offload | update_on | layers | parameters |", "|---|---|---|---|"]
        lines += [f"| {r['offload']} | {r['update_on']} | {r['layers']} | {r['params']:,} |"
                  for r in results["largest"]]
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_offload.json").write_text(json.dumps(results, indent=2))
    (out / "bench_offload.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    print(f"\nwrote {out / 'bench_offload.json'} and {out / 'bench_offload.md'}")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="tiny CPU smoke test (< 1 minute)")
    p.add_argument("--mode", choices=("ratio", "largest", "all"), default="all")
    p.add_argument("--layers", type=int, default=18)
    p.add_argument("--width", type=int, default=2048)
    p.add_argument("--mlp-dim", type=int, default=5632)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--remat", choices=("none", "full", "save_dots"), default="full")
    p.add_argument("--stage", type=int, default=0, choices=(0, 1, 2, 3))
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--max-layers", type=int, default=256)
    p.add_argument("--fit-by", choices=("run", "compile"), default=None,
                   help="default: run on an accelerator, compile on CPU")
    p.add_argument("--device-memory", default="80GB", help="budget for --fit-by compile")
    p.add_argument("--probe-timeout", type=int, default=900)
    p.add_argument("--out", default="experiments/results")
    p.add_argument("--probe", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--offload", default="none", help=argparse.SUPPRESS)
    p.add_argument("--update-on", default="device", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.quick:
        args.layers, args.width, args.mlp_dim, args.vocab, args.remat = 1, 64, 128, 256, "none"
        args.seq_len, args.batch, args.steps, args.warmup = 32, 4, 3, 1
        args.max_layers, args.fit_by = 2, "compile"
        args.device_memory = "2MB"
    args.model_flags = ["--width", str(args.width), "--mlp-dim", str(args.mlp_dim), "--vocab",
                        str(args.vocab), "--seq-len", str(args.seq_len), "--batch", str(args.batch),
                        "--remat", args.remat, "--stage", str(args.stage)]
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.probe:
        return run_probe(args)
    if args.quick:  # read when jax starts its backend, which has not happened yet
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + FAST_CPU_COMPILE).strip()
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax

    from zeroflow.memory import count_gpt_params, parse_bytes
    args.device_memory_bytes = parse_bytes(args.device_memory)
    if args.fit_by is None:
        args.fit_by = "compile" if jax.default_backend() == "cpu" else "run"
    cfg = model_config(args)
    params = count_gpt_params(cfg.model)
    device = f"{jax.device_count()} x {jax.devices()[0].device_kind} ({jax.default_backend()})"
    print(f"{device}; GPT {params:,} parameters ({args.layers} layers, width {args.width})", flush=True)
    results = {"device": device, "width": args.width, "fit_by": args.fit_by,
               "model": f"{params:,} parameters, {args.layers} layers, width {args.width}, mlp "
                        f"{cfg.model.mlp_dim}, vocab {args.vocab}, seq {args.seq_len}, batch "
                        f"{args.batch}, remat {args.remat}, bf16, stage {args.stage}"}
    if args.mode in ("ratio", "all"):
        choices = CHOICES[:2] if args.quick else CHOICES
        results["ratio"] = []
        for offload, update_on in choices:
            r = time_steps(cfg, offload, update_on, args.steps, args.warmup)
            print(f"  {offload}/{update_on}: median {r['median_s']:.4f}s (loss {r['loss']:.4f})", flush=True)
            results["ratio"].append(r)
    if args.mode in ("largest", "all"):
        searches = [("none", "device"), ("optimizer", "host")]
        if not args.quick:
            searches[1:1] = [("optimizer", "device")]
            searches.append(("optimizer+params", "host"))
        results["largest"] = [largest(args, offload, update_on) for offload, update_on in searches]
    report(results, pathlib.Path(args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
