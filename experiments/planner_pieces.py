"""Could compiled pieces stand in for the whole compile? The trainer's GPT step compiled by
XLA:GPU for 8 abstract H100s with 2 and 4 layers, its peak extrapolated linearly in the layer
count to the config's, against the whole step compiled with every layer; and what each compile
costs in CPU time (a fresh process per layer count, so no kernel is cached).

    python experiments/planner_pieces.py --config configs/gpt-1b.yaml [key=value ...]

Prints one JSON line per layer count, then the extrapolation. Run with JAX_PLATFORMS=cpu.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys

CHILD = "ZEROFLOW_PIECES_LAYERS"


def compile_once(config: str, overrides: list[str], layers: int) -> dict:
    from zeroflow.backend import targets
    from zeroflow.config.io import load_config
    from zeroflow.memory.measure import analysed, device_peak
    from zeroflow.trainer.planning import compile_config

    targets.use_cpu_for_targets()
    cfg = load_config(config, overrides)
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, num_layers=layers))
    before = os.times()
    compiled, setup = compile_config(
        cfg,
        num_devices=8,
        stage=cfg.parallel.zero_stage,
        offload=cfg.parallel.offload,
        update_on=cfg.parallel.update_on,
        remat=cfg.model.remat,
        target="h100",
    )
    after = os.times()
    cpu = sum(after[:4]) - sum(before[:4])
    return {
        "layers": layers,
        "peak_bytes": device_peak(analysed(compiled), setup.state),
        "cpu_s": round(cpu, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", required=True)
    parser.add_argument("--layers", default="2,4")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    if os.environ.get(CHILD):
        print(json.dumps(compile_once(args.config, args.overrides, int(os.environ[CHILD]))))
        return
    from zeroflow.config.io import load_config

    full = load_config(args.config, args.overrides).model.num_layers
    got = {}
    for layers in [int(x) for x in args.layers.split(",")] + [full]:
        env = dict(os.environ, **{CHILD: str(layers)})
        done = subprocess.run(
            [sys.executable, __file__, *sys.argv[1:]], env=env, capture_output=True, text=True
        )
        line = done.stdout.strip().splitlines()[-1]
        print(line, flush=True)
        got[layers] = json.loads(line)
    (a, b), whole = [got[n] for n in sorted(got)[:2]], got[full]
    per_layer = (b["peak_bytes"] - a["peak_bytes"]) / (b["layers"] - a["layers"])
    guess = a["peak_bytes"] + per_layer * (full - a["layers"])
    print(
        json.dumps(
            {
                "extrapolated_bytes": round(guess),
                "whole_bytes": whole["peak_bytes"],
                "error": round(guess / whole["peak_bytes"] - 1, 4),
            }
        )
    )


if __name__ == "__main__":
    main()
