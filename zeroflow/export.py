"""``python -m zeroflow.export --run RUN_DIR --out weights.safetensors`` (or ``.npz``): the
consolidated fp32 weights of a run's latest checkpoint, for use outside zeroflow.

Keys are the '/'-joined parameter paths (``layers/attn/query/kernel``); stacked block
parameters keep their leading layer axis.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

from zeroflow.cli import run_cli

PROG = "zeroflow.export"
FORMATS = (".safetensors", ".npz")


def flat_weights(params) -> dict[str, np.ndarray]:
    import jax

    from zeroflow.plan import path_str
    return {path_str(p): np.asarray(jax.device_get(x), dtype=np.float32)
            for p, x in jax.tree_util.tree_leaves_with_path(params)}


def write_weights(weights: dict[str, np.ndarray], out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    if out.suffix == ".safetensors":
        from safetensors.numpy import save_file
        save_file({k: np.ascontiguousarray(v) for k, v in weights.items()}, str(out))
    else:
        np.savez(out, **weights)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=f"python -m {PROG}", description=__doc__.split("\n\n")[0])
    p.add_argument("--run", required=True, help="run folder (holds config.yaml and checkpoints/)")
    p.add_argument("--out", required=True, help="output file: .safetensors or .npz")
    return p


def main_args(args) -> int:
    out = Path(args.out)
    if out.suffix not in FORMATS:
        raise ValueError(f"--out must end in {' or '.join(FORMATS)}, got {out.name!r}")
    from zeroflow.sample import load_params
    _, _, params, step = load_params(Path(args.run))
    weights = flat_weights(params)
    write_weights(weights, out)
    total = sum(v.size for v in weights.values())
    print(f"wrote {len(weights)} arrays, {total:,} fp32 parameters from step {step} to {out}", file=sys.stderr)
    return 0


def main(argv=None) -> int:
    return run_cli(PROG, main_args, parser(), argv)


if __name__ == "__main__":
    sys.exit(main())
