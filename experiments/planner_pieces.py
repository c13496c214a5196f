"""Could compiled pieces stand in for the whole compile? A train step compiled with few layers
(two layer counts, ``--layers``), its peak extrapolated to the model's layer count, against the
step compiled with every layer; and what each compile costs in CPU time (a fresh process per
compile, so no kernel is cached).

The estimate is ``state(L) + t(a) + (t(b) - t(a)) / (b - a) * (L - a)``: the plan's exact
state bytes for all ``L`` layers (from the abstract state's shapes and shardings, nothing
compiled) plus what the step holds beyond its state (``t``: XLA's peak less the state), which
grows by one layer's forward and backward pass per layer.

    # the trainer's GPT of a config (a Hugging Face architecture read from model.init_from)
    python experiments/planner_pieces.py --config configs/finetune-llama3-8b.yaml --target h100
    python experiments/planner_pieces.py --config configs/gpt-1b.yaml --target cpu --devices 8
    # a model of tests/model_corpus.py (only the Equinox transformer has a layer count)
    python experiments/planner_pieces.py --corpus eqx_transformer --target cpu --layers 1,2 --full 6

``--target``: a GPU name (XLA:GPU for abstract GPUs) or ``cpu`` (XLA:CPU, emulated devices).
Prints one JSON line per compile, then the comparison. Run with JAX_PLATFORMS=cpu.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys

from zeroflow.cli.common import start_script

start_script()  # before jax: where the CUDA plugin has no driver, a CPU jax without its noise

CHILD = "ZEROFLOW_PIECES_LAYERS"
HERE = os.path.dirname(os.path.abspath(__file__))


def _config_step(args, layers: int):
    """(compiled, abstract state) of the trainer's GPT step with ``layers`` layers."""
    from zeroflow.config.io import load_config
    from zeroflow.trainer.planning import compile_config
    from zeroflow.trainer.setup import run_model_config

    cfg = load_config(args.config, args.overrides)
    model = dataclasses.replace(run_model_config(cfg), init_from="", num_layers=layers)
    if args.target == "cpu" and model.attention == "cudnn":  # (no cuDNN on XLA:CPU)
        model = dataclasses.replace(model, attention="xla")
    cfg = dataclasses.replace(cfg, model=model)
    compiled, setup = compile_config(
        cfg,
        num_devices=args.devices or max(cfg.parallel.data, 1),
        stage=cfg.parallel.zero_stage,
        offload=cfg.parallel.offload,
        update_on=cfg.parallel.update_on,
        remat=cfg.model.remat,
        target=None if args.target == "cpu" else args.target,
    )
    return compiled, setup.state


def _corpus_step(args, layers: int):
    """(compiled, abstract state) of a corpus model's step, zeroflow stage ``--stage``."""
    import equinox as eqx
    import jax
    import optax

    import zeroflow as zf
    from zeroflow.memory.measure import compile_step

    sys.path.insert(0, os.path.join(HERE, "..", "tests"))
    import model_corpus as mc

    if args.corpus not in mc.CORPUS:
        raise SystemExit(f"unknown corpus model {args.corpus!r}; choose from {sorted(mc.CORPUS)}")
    if args.corpus != "eqx_transformer":  # (its other models are one block deep)
        raise SystemExit(f"{args.corpus} has no layer count to scale")
    model = mc.EqxTransformer(jax.random.key(0), layers=layers, dims=mc.LARGER)
    params, static = eqx.partition(model, eqx.is_inexact_array)

    def with_layers(p, batch, *, rng):  # the corpus's forward, for this many layers
        tokens = batch["tokens"]
        keys = jax.random.split(rng, tokens.shape[0])
        logits = jax.vmap(eqx.combine(p, static))(tokens[:, :-1], keys)
        return mc._next_token_loss(logits, tokens)

    devices = args.devices or 8
    mesh = (
        zf.make_mesh(data=devices, devices=jax.devices()[:devices])
        if args.target == "cpu"
        else zf.target_mesh(args.target, data=devices)
    )
    plan, prec = zf.ZeroPlan(mesh, stage=args.stage), zf.Precision(params="bf16")
    batch = mc.token_batches(1, 8 * devices, dims=mc.LARGER)[0]
    return compile_step(
        with_layers, params, batch, optax.adamw(1e-3), plan, prec, rng=jax.random.key(0)
    )


def compile_once(args, layers: int) -> dict:
    from zeroflow.backend import targets
    from zeroflow.memory.measure import analysed, device_peak, state_bytes

    if args.target != "cpu":
        targets.use_cpu_for_targets()
    before = os.times()
    compiled, state = (_corpus_step if args.corpus else _config_step)(args, layers)
    after = os.times()
    return {
        "layers": layers,
        "peak_bytes": device_peak(analysed(compiled), state),
        "state_bytes": state_bytes(state).get("device", 0),
        "cpu_s": round(sum(after[:4]) - sum(before[:4]), 1),
    }


def _full_layers(args) -> int:
    if args.full:
        return args.full
    from zeroflow.config.io import load_config
    from zeroflow.trainer.setup import run_model_config

    return run_model_config(load_config(args.config, args.overrides)).num_layers


def compare(got: dict, pieces: tuple[int, int], full: int) -> dict:
    """The extrapolation of ``pieces`` to ``full`` layers against the whole compile."""
    a, b = (got[n] for n in pieces)
    held = [x["peak_bytes"] - x["state_bytes"] for x in (a, b)]
    per_layer = (held[1] - held[0]) / (b["layers"] - a["layers"])
    whole = got[full]
    guess = whole["state_bytes"] + held[0] + per_layer * (full - a["layers"])
    return {
        "extrapolated_bytes": round(guess),
        "whole_bytes": whole["peak_bytes"],
        "error": round(guess / whole["peak_bytes"] - 1, 4),
        "pieces_cpu_s": round(a["cpu_s"] + b["cpu_s"], 1),
        "whole_cpu_s": whole["cpu_s"],
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", default=None)
    parser.add_argument("--corpus", default=None)
    parser.add_argument("--target", default="h100", help="a GPU name, or cpu")
    parser.add_argument("--devices", type=int, default=None, help="default: the config's")
    parser.add_argument("--stage", type=int, default=3, help="corpus models only")
    parser.add_argument("--layers", default="2,4", help="the two piece sizes")
    parser.add_argument("--full", type=int, default=None, help="layers of the whole model")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    if os.environ.get(CHILD):
        print(json.dumps(compile_once(args, int(os.environ[CHILD]))))
        return
    pieces = tuple(int(x) for x in args.layers.split(","))
    full = _full_layers(args)
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags:
        flags += f" --xla_force_host_platform_device_count={max(args.devices or 8, 8)}"
    got = {}
    for layers in (*pieces, full):
        env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=flags.strip(), **{CHILD: str(layers)})
        done = subprocess.run(
            [sys.executable, __file__, *sys.argv[1:]], env=env, capture_output=True, text=True
        )
        if done.returncode:
            raise SystemExit(done.stderr[-3000:])
        line = done.stdout.strip().splitlines()[-1]
        print(line, flush=True)
        got[layers] = json.loads(line)
    print(json.dumps(compare(got, pieces, full)))


if __name__ == "__main__":
    main()
