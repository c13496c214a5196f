"""The trainer's GPT at ZeRO stage 3 with FP8 weight gathers and FP8 matmuls
(``parallel.quantize_weights=fp8``, ``precision.autocast=fp8``), compiled for 8 x H100 by
XLA:GPU on a machine without them (``zf.target_mesh``), by the two routes the engine can gather
its layer weights:

- ``layer``: ``gather_per_layer="layers"``, the model calls ``gather_layer`` inside its
  ``nn.scan``: the gathered e4m3 weight is dequantized, then autocast casts it to e4m3 again;
- ``use``: ``gather_per_layer=None``, every weight fetched on use
  (``zeroflow.engine.grads.gather_on_use`` replays the layer scan): the FP8 matmul gathers its
  own e4m3 weight and feeds the bytes to the GEMM (``zeroflow.engine.zeropp.fp8_dot``).

Per row: XLA:GPU's peak per device (``memory_analysis``), its *estimated* step (the
latency-hiding scheduler's cost model, ``zeroflow.xla.schedule``; not a measurement), the
FP8 GEMMs per step (``experiments/gemm_steps.py``), and where the e4m3 all-gathers' results go
in the lowered program (``gathered_uses``): straight into the matmul (through layout ops only)
or through an elementwise convert (the dequantize, then autocast's cast again).

    python experiments/fp8_trainer_routes.py --config configs/gpt-1b.yaml
    python experiments/fp8_trainer_routes.py --config configs/gpt-1b.yaml --layers 4 \
        --scalings tensor      # a quick look

Each compile runs in its own process, started with the scheduler's logging on.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import re
import sys
import time
from pathlib import Path

from child_rows import child_env, run_row
from zeroflow.cli.common import start_script

start_script()

HERE = Path(__file__).resolve().parent
ROUTES = ("layer", "use")


def route_overrides(row: dict) -> list[str]:
    over = [
        "parallel.zero_stage=3",
        "parallel.quantize_weights=fp8",
        "precision.params=bf16",
        "precision.autocast=fp8",
        f"precision.fp8_scaling={row['scaling']}",
    ]
    if row.get("layers"):
        over.append(f"model.num_layers={row['layers']}")
    return over + list(row.get("extra", ()))


def compile_row(row: dict) -> dict:
    """One row, in this process (started with the logging on): lower, compile and read."""
    from unittest import mock

    from gemm_steps import step_gemms

    from zeroflow.backend import accelerators
    from zeroflow.backend.targets import compute_capability
    from zeroflow.config.io import load_config
    from zeroflow.memory.measure import analysed
    from zeroflow.memory.on_target import compile_for
    from zeroflow.models import LAYER_STACK
    from zeroflow.trainer import setup
    from zeroflow.trainer.planning import abstract_setup
    from zeroflow.util import compat
    from zeroflow.xla import schedule

    cfg = load_config(row["config"], route_overrides(row))
    stack = LAYER_STACK if row["route"] == "layer" else None
    start = time.time()
    cudnn = compat.cudnn_for_target(compute_capability("h100"))
    with mock.patch.object(setup.Run, "gather_per_layer", property(lambda self: stack)), cudnn:
        made = abstract_setup(
            cfg,
            num_devices=8,
            stage=3,
            offload=row.get("offload", "none"),
            update_on=cfg.parallel.update_on,
            remat=cfg.model.remat,
            target="h100",
        )
        if made.target is None:
            lowered = made.step.lower(made.state, made.batch)
            compile_it = lowered.compile
        else:  # offloaded: planned on CPU stand-ins, compiled for the GPUs (on_target)
            traced = made.step.jitted(made.state).trace(made.state, made.batch)
            lowered = traced.lower(lowering_platforms=("cuda",))

            def compile_it():
                return compile_for(made.step, made.state, made.batch, made.target)

        compiled, est = schedule.timed(
            compile_it, peak_flops=accelerators.required("h100").bf16_flops
        )
    text = compiled.as_text()
    if row.get("dump"):
        Path(row["dump"]).write_text(text)
    gemms = step_gemms(text)
    return {
        **row,
        "compile_s": round(time.time() - start, 1),
        "peak_bytes": analysed(compiled).total_bytes,
        "temp_bytes": analysed(compiled).temp_bytes,
        "step_ms": est.step_ms,
        "exposed_ms": {k: v / 1e3 for k, v in est.exposed_by_kind().items()},
        "fp8_gemms": gemms["fp8"]["gemms"],
        "other_gemms": gemms["other"]["gemms"],
        "gathered_uses": gathered_uses(lowered.as_text()),
    }


_LAYOUT = ("stablehlo.reshape", "stablehlo.transpose", "stablehlo.bitcast_convert")
_OP = re.compile(r'^\s*(%[\w#]+)(?::\d+)? = "?([\w.]+)"?(.*)$')


def gathered_uses(mlir: str) -> dict[str, int]:
    """In the step's lowered program (StableHLO; each function body once, a scanned layer's
    once), where each e4m3 all-gather's result goes, followed through reshapes and transposes:
    ``gemm`` (a ``dot_general`` reads it: the gathered bytes are the FP8 GEMM's operand),
    ``convert`` (dequantized elementwise, cast again to e4m3 before its matmul), ``other``;
    and ``gathers``, the e4m3 all-gathers."""
    out = {"gathers": 0, "gemm": 0, "convert": 0, "other": 0}
    for body in re.split(r"(?m)^\s*func\.func ", mlir)[1:]:  # SSA names are per function
        ops, users = {}, {}
        for line in body.splitlines():
            m = _OP.match(line)
            if not m:
                continue
            ops[m[1]] = (m[2], m[3])
            operands = m[3].split("<{")[0] if m[2] == "stablehlo.all_gather" else m[3]
            for used in set(re.findall(r"%[\w#]+", operands.split(" : ")[0])):
                users.setdefault(used, []).append(m[1])
        for var, (op, rest) in ops.items():
            if op != "stablehlo.all_gather" or "f8E4M3FN>" not in rest.rsplit("->", 1)[-1]:
                continue
            out["gathers"] += 1
            todo = list(users.get(var, []))
            while todo:
                use = todo.pop()
                uop, urest = ops[use]
                if uop in _LAYOUT and "f8E4M3FN>" in urest.rsplit("->", 1)[-1]:
                    todo += users.get(use, [])
                elif uop == "stablehlo.dot_general":
                    out["gemm"] += 1
                elif uop == "stablehlo.convert":
                    out["convert"] += 1
                else:
                    out["other"] += 1
    return out


def run_child(row: dict, timeout: float) -> dict:
    """One row's compile in a fresh process; its failure becomes the row's note."""
    env = child_env()
    env["JAX_ENABLE_COMPILATION_CACHE"] = "false"
    # an offloaded step is planned on 8 CPU devices standing in for the GPUs
    env["XLA_FLAGS"] = env.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    cmd = [sys.executable, str(Path(__file__).resolve()), "--row", json.dumps(row)]
    return run_row(cmd, env, row, timeout, note_width=300)


def table(rows: list[dict]) -> str:
    head = (
        "| config | scaling | route | peak GB/device | step ms (XLA:GPU estimate) | "
        "FP8 GEMMs / step | e4m3 gathers in the program | read by: matmul / convert / other "
        "| compile s |\n"
        "|---|---|---|---:|---:|---:|---:|---:|---:|"
    )
    out = [head]
    for r in rows:
        if "note" in r:
            out.append(f"| {r['name']} | {r['scaling']} | {r['route']} | {r['note']} |||||")
            continue
        u = r["gathered_uses"]
        out.append(
            f"| {r['name']} | {r['scaling']} | {r['route']} | {r['peak_bytes'] / 1e9:.2f} | "
            f"{r['step_ms']:.1f} | {r['fp8_gemms']:.0f} | {u['gathers']} | "
            f"{u['gemm']} / {u['convert']} / {u['other']} | {r['compile_s']:.0f} |"
        )
    return "\n".join(out)


def _bad_input(args) -> str | None:
    """What is wrong with the command line, in one line, before any row is compiled: an unknown
    route, or a config that does not load with a row's overrides."""
    from zeroflow.config.io import ConfigError, load_config

    routes = [r for r in args.routes.split(",") if r not in ROUTES]
    if routes:
        return f"unknown route(s) {routes}; choose from {list(ROUTES)}"
    for scaling in args.scalings.split(","):
        row = dict(scaling=scaling, layers=args.layers, extra=args.set)
        try:
            load_config(args.config, route_overrides(row))
        except (ConfigError, OSError) as e:
            return str(e).splitlines()[0]
    return None


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--row", help=argparse.SUPPRESS)
    p.add_argument("--config", default="configs/gpt-1b.yaml")
    p.add_argument("--layers", type=int, default=None, help="override model.num_layers")
    p.add_argument("--scalings", default="delayed,tensor")
    p.add_argument("--routes", default=",".join(ROUTES))
    p.add_argument("--set", action="append", default=[], help="more config overrides")
    p.add_argument("--offload", default="none", help="parallel.offload (update_on: the config's)")
    p.add_argument("--timeout", type=float, default=3000)
    p.add_argument("--dump", default=None, help="write each compiled module to DUMP.<row>.hlo")
    args = p.parse_args()
    if args.row:
        print(json.dumps(compile_row(json.loads(args.row))), flush=True)
        return 0
    problem = _bad_input(args)
    if problem:
        print(f"fp8_trainer_routes.py: error: {problem}", file=sys.stderr)
        return 2
    print(
        f"# {datetime.date.today()}, {platform.machine()} CPU ({platform.node()}), "
        f"XLA:GPU estimate (deviceless compile): {' '.join(sys.argv)}",
        flush=True,
    )
    rows = []
    name = Path(args.config).stem + (f" ({args.layers} layers)" if args.layers else "")
    for scaling in args.scalings.split(","):
        for route in args.routes.split(","):
            row = dict(
                config=args.config,
                name=name,
                layers=args.layers,
                scaling=scaling,
                route=route,
                extra=args.set,
                offload=args.offload,
            )
            if args.dump:
                row["dump"] = f"{args.dump}.{scaling}.{route}.hlo"
            rows.append(run_child(row, args.timeout))
            print(json.dumps(rows[-1]), flush=True)
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(HERE))
    sys.exit(main())
