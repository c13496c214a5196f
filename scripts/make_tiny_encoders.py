"""Create two tiny local Hugging Face encoder folders for the FuseMix demo: no download.

    python scripts/make_tiny_encoders.py --out runs/fusemix-encoders

Writes ``vision/`` (a randomly initialised ``CLIPVisionModel``: 32x32 images, 8x8 patches)
and ``text/`` (a randomly initialised ``BertModel`` with a word-level ``tokenizer.json`` over
the digits captions' words), each as transformers saves a published checkpoint
(``zeroflow.fusemix.tiny_encoders``). Needs torch and transformers: ``pip install -e ".[hf]"``.
configs/fusemix.yaml makes the same two itself where they are missing
(``fusemix.tiny_encoders: true``); this script writes them elsewhere or at another width.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from zeroflow.cli.common import start_script

start_script()  # before jax (zeroflow.fusemix imports it): no CUDA plugin noise without a driver

from zeroflow.fusemix import tiny_encoders  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="runs/fusemix-encoders")
    p.add_argument("--width", type=int, default=64, help="hidden size of both encoders")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    out = Path(args.out)
    try:  # a folder holding a model (an earlier run's) is replaced, one holding other files not
        tiny_encoders.make(out / "vision", out / "text", width=args.width, seed=args.seed)
    except (tiny_encoders.MissingLibraries, FileExistsError) as e:
        sys.exit(f"make_tiny_encoders.py: {e}")
    print(f"wrote {out}/vision (CLIPVisionModel) and {out}/text (BertModel, "
          f"{len(tiny_encoders.vocabulary())} words)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
