"""``python -m zeroflow.export --run RUN_DIR --out weights.safetensors`` (or ``.npz``): the
consolidated fp32 weights of a run's latest checkpoint, for use outside zeroflow.

Keys are the '/'-joined parameter paths (``layers/attn/query/kernel``); stacked block
parameters keep their leading layer axis.

``--format hf --out DIR`` writes a Hugging Face checkpoint folder instead (config.json,
safetensors, and the run's tokenizer.json when it used one) that transformers'
``AutoModelForCausalLM.from_pretrained(DIR)`` loads: the architecture of ``model.init_from``
for a fine-tuned model, else Llama (or GPT-2) chosen to fit the run's model.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

from zeroflow.cli import run_cli
from zeroflow.precision import DTYPES

PROG = "zeroflow.export"
FORMATS = (".safetensors", ".npz")
HF_FORMAT = "hf"


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
    p.add_argument("--out", required=True,
                   help="output file (.safetensors or .npz), or folder with --format hf")
    p.add_argument("--format", choices=("file", HF_FORMAT), default="file",
                   help="'file' (default: one file of '/'-keyed arrays, by --out's suffix) or "
                        "'hf' (a Hugging Face checkpoint folder)")
    p.add_argument("--dtype", choices=tuple(DTYPES), default="fp32",
                   help="weight dtype of --format hf (default fp32)")
    return p


def export_hf(run_dir: Path, out: Path, dtype: str = "fp32") -> str:
    """Write the run's latest weights as a Hugging Face folder; returns a summary line."""
    import dataclasses

    from zeroflow import hf
    from zeroflow.data.tokenizers import copy_tokenizer
    from zeroflow.models import GPT
    from zeroflow.sample import load_params

    model_cfg, tokenizer, params, step = load_params(run_dir)
    cfg = model_cfg
    if model_cfg.init_from:
        cfg = dataclasses.replace(hf.read_config(model_cfg.init_from), model=model_cfg)
    hf.save_pretrained(GPT(model_cfg), params, cfg, out, dtype=dtype)
    written = copy_tokenizer(tokenizer, out) if isinstance(tokenizer, hf.HFTokenizer) else None
    architecture = getattr(cfg, "architecture", None) or hf.converter_for_model(cfg).architecture
    return (f"wrote {architecture} ({dtype}) from step {step} to {out}"
            + (f" with {written}" if written else " (no tokenizer.json: the run's tokenizer is "
               f"{tokenizer.name!r})"))


def main_args(args) -> int:
    out = Path(args.out)
    if args.format == HF_FORMAT:
        print(export_hf(Path(args.run), out, args.dtype), file=sys.stderr)
        return 0
    if out.suffix not in FORMATS:
        raise ValueError(f"--out must end in {' or '.join(FORMATS)}, got {out.name!r} "
                         "(or use --format hf for a Hugging Face folder)")
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
