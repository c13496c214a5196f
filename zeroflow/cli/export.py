"""``python -m zeroflow.export --run RUN_DIR --out weights.safetensors`` (or ``.npz``): the
consolidated fp32 weights of a run's latest checkpoint (or ``--step N``), for use outside
zeroflow. It says which step it wrote, and refuses an unreadable latest checkpoint unless
``--step`` names the one to use. Written files get the usual permissions (0644 under the
common umask 022), whatever the library writing them chose.

Keys are the '/'-joined parameter paths (``layers/attn/query/kernel``); stacked block
parameters keep their leading layer axis.

``--format hf --out DIR`` writes a Hugging Face checkpoint folder instead (config.json,
safetensors, and a tokenizer.json: the run's own, or for byte-level runs one that gives the
same byte ids in transformers) that transformers'
``AutoModelForCausalLM.from_pretrained(DIR)`` loads: the architecture of ``model.init_from``
for a fine-tuned model, else Llama (or GPT-2) chosen to fit the run's model.

A LoRA run (``model.lora.rank > 0``) exports its adapters folded into the base weights
(``W + alpha / r * A B``) in every format but ``--format peft --out DIR``, which writes the
adapters alone as a Hugging Face peft folder (``adapter_config.json`` and
``adapter_model.safetensors``) for the base model: ``model.init_from``, or for a run that
started from random weights its frozen base, written to ``DIR/base`` as a Hugging Face folder.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import numpy as np

from zeroflow.cli.common import ArgumentParser, run_cli
from zeroflow.cli.inputs import STEP_MAX, check_new_output, check_path, int_between, non_empty
from zeroflow.cli.sample import check_run_folder
from zeroflow.util.settings import DTYPE_NAMES

PROG = "zeroflow.export"
FORMATS = (".safetensors", ".npz")
HF_FORMAT = "hf"
PEFT_FORMAT = "peft"


def flat_weights(params) -> dict[str, np.ndarray]:
    import jax

    from zeroflow.util.tree import path_str

    return {
        path_str(p): np.asarray(jax.device_get(x), dtype=np.float32)
        for p, x in jax.tree_util.tree_leaves_with_path(params)
    }


def write_weights(weights: dict[str, np.ndarray], out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    if out.suffix == ".safetensors":
        from safetensors.numpy import save_file

        save_file({k: np.ascontiguousarray(v) for k, v in weights.items()}, str(out))
    else:
        # numpy's stub reads the keywords as possibly its allow_pickle flag; keys are tree paths
        np.savez(out, **weights)  # type: ignore[arg-type]
    readable_by_all(out)


def readable_by_all(*paths: Path) -> None:
    """Give written files the mode a plain ``open()`` would (0666 less the umask): safetensors
    writes 0600."""
    umask = os.umask(0)
    os.umask(umask)
    for path in paths:
        for file in [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]:
            os.chmod(file, 0o666 & ~umask)


def parser() -> argparse.ArgumentParser:
    p = ArgumentParser(prog=f"python -m {PROG}", description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--run",
        required=True,
        type=non_empty,
        help="run folder (holds config.yaml and checkpoints/)",
    )
    p.add_argument(
        "--out",
        required=True,
        type=non_empty,
        help="output file (.safetensors or .npz), or folder with --format hf or peft",
    )
    p.add_argument(
        "--format",
        choices=("file", HF_FORMAT, PEFT_FORMAT),
        default="file",
        help="'file' (default: one file of '/'-keyed arrays, by --out's suffix), "
        "'hf' (a Hugging Face checkpoint folder) or 'peft' (a LoRA run's "
        "adapters as a peft folder)",
    )
    p.add_argument(
        "--dtype",
        choices=DTYPE_NAMES,
        default="fp32",
        help="weight dtype of --format hf (default fp32)",
    )
    p.add_argument(
        "--step",
        type=int_between(0, STEP_MAX, "the step counter is a 32-bit integer"),
        default=None,
        help="checkpoint step to export (default: the newest readable one; an unreadable newest "
        "checkpoint is reported and the one before it used)",
    )
    return p


def _hf_config(model_cfg):
    """What ``hf.save_pretrained`` and ``save_peft`` take: the ``model.init_from`` checkpoint's
    config with the run's model, or the model config (an architecture is chosen to fit)."""
    import dataclasses

    from zeroflow import hf

    if not model_cfg.init_from:
        return model_cfg
    return dataclasses.replace(hf.read_config(model_cfg.init_from), model=model_cfg)


def export_hf(run_dir: Path, out: Path, dtype: str = "fp32", step: int | None = None) -> str:
    """Write the run's latest weights as a Hugging Face folder; returns a summary line."""
    from zeroflow import hf
    from zeroflow.cli.sample import load_params
    from zeroflow.data.tokenizers import ByteTokenizer, copy_tokenizer
    from zeroflow.models import GPT

    model_cfg, tokenizer, params, step = load_params(run_dir, step)
    cfg = _hf_config(model_cfg)
    hf.save_pretrained(GPT(model_cfg), params, cfg, out, dtype=dtype)
    written = None
    if isinstance(tokenizer, hf.HFTokenizer):
        written = copy_tokenizer(tokenizer, out)
    elif isinstance(tokenizer, ByteTokenizer):
        written = tokenizer.write_hf(out) + " (byte ids)"
    readable_by_all(out)
    architecture = getattr(cfg, "architecture", None) or hf.converter_for_model(cfg).architecture
    return f"wrote {architecture} ({dtype}) from step {step} to {out}" + (
        f" with {written}"
        if written
        else f" (no tokenizer.json: the run's tokenizer is {tokenizer.name!r})"
    )


def export_peft(run_dir: Path, out: Path, step: int | None = None) -> str:
    """Write a LoRA run's adapters as a peft folder (and, without ``model.init_from``, its
    base model in ``out/base``); returns a summary line."""
    from zeroflow.config.io import load_config
    from zeroflow.lora.peft import save_peft
    from zeroflow.trainer.adapters import ADAPTERS, BASE

    config = run_dir / "config.yaml"
    if config.exists() and load_config(config).model.lora.rank == 0:
        raise ValueError(
            f"--format peft writes LoRA adapters, and {run_dir} trained every "
            "weight (model.lora.rank is 0): use --format hf for its weights"
        )
    from zeroflow.cli.sample import load_run_params

    run, params, step = load_run_params(run_dir, step, with_data=False)
    model_cfg, lora = run.model_cfg, run.cfg.model.lora
    cfg = _hf_config(model_cfg)
    base = model_cfg.init_from
    if not base:  # the frozen base is the run's own random initialisation: written beside
        from zeroflow import hf
        from zeroflow.engine.quantized import dequantized
        from zeroflow.models import GPT

        base = str((out / "base").absolute())
        # A quantized base is written as the weights the run trained against.
        hf.save_pretrained(GPT(model_cfg), dequantized(params[BASE]), cfg, out / "base")
    save_peft(params[ADAPTERS], cfg, out, alpha=lora.alpha, base_model=base, dropout=lora.dropout)
    readable_by_all(out)
    return (
        f"wrote peft LoRA adapters (r={lora.rank}) from step {step} to {out}, for the base {base}"
    )


def _check_out(out: Path, folder: bool) -> None:
    """One line before any work when ``--out`` is of the wrong kind."""
    if folder and out.exists() and not out.is_dir():
        raise ValueError(f"--out {out} is a file; this --format writes a folder")
    if not folder and out.is_dir():
        raise ValueError(f"--out {out} is a folder; --format file writes one file")


def main_args(args) -> int:
    out = Path(args.out)
    check_path("--run", Path(args.run))
    check_path("--out", out)
    _check_out(out, folder=args.format in (HF_FORMAT, PEFT_FORMAT))
    if args.format == "file" and out.suffix not in FORMATS:
        raise ValueError(
            f"--out must end in {' or '.join(FORMATS)}, got {out.name!r} "
            "(or use --format hf for a Hugging Face folder)"
        )
    check_run_folder(Path(args.run))  # the flags and --run checked, before jax is imported
    check_new_output("--out", out)
    if args.format == HF_FORMAT:
        print(export_hf(Path(args.run), out, args.dtype, args.step))
        return 0
    if args.format == PEFT_FORMAT:
        print(export_peft(Path(args.run), out, args.step))
        return 0
    from zeroflow.cli.sample import load_params

    _, _, params, step = load_params(Path(args.run), args.step)
    weights = flat_weights(params)
    write_weights(weights, out)
    total = sum(v.size for v in weights.values())
    print(f"wrote {len(weights)} arrays, {total:,} fp32 parameters from step {step} to {out}")
    return 0


def main(argv=None) -> int:
    return run_cli(PROG, main_args, parser(), argv)


if __name__ == "__main__":
    sys.exit(main())
