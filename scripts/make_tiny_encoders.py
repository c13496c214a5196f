"""Create two tiny local Hugging Face encoder folders for the FuseMix demo: no download.

    python scripts/make_tiny_encoders.py --out runs/fusemix-encoders

Writes ``vision/`` (a randomly initialised ``CLIPVisionModel``: 32x32 images, 8x8 patches)
and ``text/`` (a randomly initialised ``BertModel`` with a word-level ``tokenizer.json`` over
the digits captions' words, built with the ``tokenizers`` library), each as transformers saves
a published checkpoint. Needs torch and transformers: ``pip install -e ".[hf]"``.
configs/fusemix.yaml aligns them on scikit-learn's digits.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from zeroflow.fusemix.digits import CLS, PAD, SEP, UNK, vocabulary


def make_tokenizer(folder: Path) -> int:
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    vocab = {word: i for i, word in enumerate(vocabulary())}
    tok = Tokenizer(models.WordLevel(vocab, unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(
        single=f"{CLS} $A {SEP}", special_tokens=[(CLS, vocab[CLS]), (SEP, vocab[SEP])])
    tok.save(str(folder / "tokenizer.json"))
    return len(vocab)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="runs/fusemix-encoders")
    p.add_argument("--width", type=int, default=64, help="hidden size of both encoders")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    import torch
    import transformers
    out = Path(args.out)
    torch.manual_seed(args.seed)
    w = args.width
    vision = transformers.CLIPVisionModel(transformers.CLIPVisionConfig(
        hidden_size=w, intermediate_size=4 * w, num_hidden_layers=2, num_attention_heads=4,
        image_size=32, patch_size=8))
    vision.eval().save_pretrained(out / "vision")
    (out / "text").mkdir(parents=True, exist_ok=True)
    vocab_size = make_tokenizer(out / "text")
    text = transformers.BertModel(transformers.BertConfig(
        vocab_size=vocab_size, hidden_size=w, intermediate_size=4 * w, num_hidden_layers=2,
        num_attention_heads=4, max_position_embeddings=32, pad_token_id=vocabulary().index(PAD)))
    text.eval().save_pretrained(out / "text")
    print(f"wrote {out}/vision (CLIPVisionModel) and {out}/text (BertModel, {vocab_size} words)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
