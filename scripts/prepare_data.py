"""Tokenize a text file or folder once into DIR/train.bin, DIR/val.bin and DIR/meta.json.

    python scripts/prepare_data.py --input ~/my_text --out data/my_text
    python scripts/prepare_data.py --input stdlib --out data/stdlib_sp --tokenizer sentencepiece
    python scripts/prepare_data.py --input ~/my_text --out data/my_llama --tokenizer HF_MODEL_DIR

Then train with ``data.source=data/my_text``. Which files of a folder are used, and how the
split by file works, is described in zeroflow/data/corpus.py. With ``--tokenizer sentencepiece``
a BPE model is trained on a sample of the training lines (seconds) and saved as
DIR/tokenizer.model; ``--tokenizer PATH.model`` reuses an existing model instead, and
``--tokenizer`` a Hugging Face model folder (or its tokenizer.json) tokenizes with that
model's tokenizer, copied to DIR/tokenizer.json (each document ends with its eos token).
"""
from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np

try:
    import zeroflow.data  # noqa: F401
except ImportError:  # run from a checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rich.console import Console
from rich.progress import (BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn,
                           TransferSpeedColumn)

from zeroflow.data import (ByteTokenizer, TokenDirWriter, encode_document, iter_documents,
                           list_source_files, load_tokenizer, train_sentencepiece)
from zeroflow.data.tokenizers import copy_tokenizer
from zeroflow.data.corpus import STDLIB, cap_files, split_files

TOKENIZER_FILE = "tokenizer.model"
_BYTES_PER_LINE = 40  # rough, to turn a byte count into a line-sampling rate


def _progress(quiet: bool) -> Progress:
    return Progress(TextColumn("{task.description}"), BarColumn(), DownloadColumn(),
                    TransferSpeedColumn(), TimeRemainingColumn(),
                    console=Console(stderr=True), disable=quiet, transient=False)


def _sample_lines(documents: Iterable, train_bytes: int, max_sentences: int,
                  on_document) -> list[str]:
    """A deterministic sample of up to ``max_sentences`` non-blank training lines."""
    keep = min(1.0, max_sentences * _BYTES_PER_LINE / max(train_bytes, 1))
    rng = np.random.default_rng(0)
    lines: list[str] = []
    for doc in documents:
        on_document(doc)
        if doc.split != "train":
            continue
        doc_lines = [line for line in doc.text.splitlines() if line.strip()]
        chosen = rng.random(len(doc_lines)) < keep
        lines += [line for line, take in zip(doc_lines, chosen) if take]
        if len(lines) >= max_sentences:
            return lines[:max_sentences]
    return lines


def prepare(input_path: str, out_dir: str, *, tokenizer: str = "byte", vocab_size: int = 4096,
            val_fraction: float = 0.05, max_bytes: int = 0, max_sentences: int = 200_000,
            quiet: bool = False) -> dict:
    """Write the token dataset and return its metadata (see zeroflow/data/token_files.py)."""
    if not 0 <= val_fraction < 1:
        raise ValueError(f"--val-fraction must be in [0, 1), got {val_fraction}")
    files = cap_files(list_source_files(input_path), max_bytes)
    if not files:
        raise ValueError(f"no text files found in {input_path}")
    total_bytes = sum(f.limit or f.size for f in files)
    train_bytes = sum(f.limit or f.size for f in split_files(files, val_fraction)[0])
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)

    def documents():
        return iter_documents(input_path, val_fraction=val_fraction, files=files)

    with _progress(quiet) as progress:
        if tokenizer == "byte":
            tok, spec = ByteTokenizer(), "byte"
        elif tokenizer == "sentencepiece":
            task = progress.add_task("sampling lines", total=total_bytes)
            lines = _sample_lines(documents(), train_bytes, max_sentences,
                                  lambda d: progress.advance(task, len(d.text.encode())))
            progress.update(task, description=f"training sentencepiece on {len(lines):,} lines")
            tok, spec = train_sentencepiece(lines, out / TOKENIZER_FILE,
                                            vocab_size=vocab_size), TOKENIZER_FILE
        else:  # an existing SentencePiece model or Hugging Face tokenizer, copied beside the data
            spec = copy_tokenizer(load_tokenizer(tokenizer), out, TOKENIZER_FILE)
            tok = load_tokenizer(out / spec)

        task = progress.add_task("tokenizing", total=total_bytes)
        source = STDLIB if input_path == STDLIB else os.path.abspath(input_path)
        with TokenDirWriter(out, vocab_size=tok.vocab_size, tokenizer=spec, source=source,
                            val_fraction=val_fraction, max_bytes=max_bytes) as writer:
            for doc in documents():
                tokens, num_bytes = encode_document(tok, doc.text)
                writer.write(doc.split, tokens, num_bytes)
                progress.advance(task, num_bytes)
        return writer.meta


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--input", required=True,
                        help="a text file, a folder of text files, or 'stdlib'")
    parser.add_argument("--out", required=True, help="output folder")
    parser.add_argument("--tokenizer", default="byte",
                        help="'byte' (default), 'sentencepiece' (train one here), a .model path, "
                             "or a Hugging Face model folder / tokenizer.json")
    parser.add_argument("--vocab-size", type=int, default=4096,
                        help="vocabulary of a newly trained SentencePiece model (default 4096)")
    parser.add_argument("--val-fraction", type=float, default=0.05,
                        help="share of files held out for validation (default 0.05)")
    parser.add_argument("--max-bytes", type=int, default=0, help="read at most this many bytes")
    parser.add_argument("--max-sentences", type=int, default=200_000,
                        help="lines sampled to train SentencePiece (default 200000)")
    parser.add_argument("--quiet", action="store_true", help="no progress bars")
    args = parser.parse_args(argv)
    if args.input != STDLIB and not os.path.exists(args.input):
        print(f"prepare_data: error: input path not found: {args.input}", file=sys.stderr)
        return 2
    try:
        meta = prepare(args.input, args.out, tokenizer=args.tokenizer, vocab_size=args.vocab_size,
                       val_fraction=args.val_fraction, max_bytes=args.max_bytes,
                       max_sentences=args.max_sentences, quiet=args.quiet)
    except (OSError, ValueError) as e:
        print(f"prepare_data: error: {e}", file=sys.stderr)
        return 2
    splits = meta["splits"]
    print(f"wrote {args.out}: train {splits['train']['tokens']:,} tokens "
          f"({splits['train']['documents']} docs), val {splits['val']['tokens']:,} tokens "
          f"({splits['val']['documents']} docs), vocab {meta['vocab_size']}, {meta['dtype']}, "
          f"{meta['tokens_per_byte']:.3f} tokens/byte; train with data.source={args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
