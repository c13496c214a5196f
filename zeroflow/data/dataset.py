"""``load_data``: a ``DataConfig`` -> train and validation token arrays plus their tokenizer."""

from __future__ import annotations

import dataclasses
import math
import os
from pathlib import Path

import numpy as np

from zeroflow.config.schema import DataConfig
from zeroflow.data.corpus import STDLIB, iter_documents
from zeroflow.data.record_data import RecordData, load_record_data
from zeroflow.data.records import RECORD_SUFFIXES, is_saved_dataset
from zeroflow.data.token_files import find_meta, read_token_dir
from zeroflow.data.tokenizers import Tokenizer, load_tokenizer, same_tokenizer, token_dtype

SEPARATOR = "\n"
"Text after every document when the tokenizer has no end-of-document token (bytes have none)."


@dataclasses.dataclass(frozen=True, eq=False)
class TokenData:
    train: np.ndarray
    "Training tokens, 1-D (a read-only memmap for .bin sources)."
    val: np.ndarray
    "Held-out tokens, 1-D; empty when data.val_fraction is 0."
    tokenizer: Tokenizer
    tokens_per_byte: float
    "Tokens per UTF-8 byte of text (1.0 for bytes), to report eval loss as bits per byte."
    source: str
    train_files: tuple[str, ...] = ()
    "Names of the documents in each split (text sources only)."
    val_files: tuple[str, ...] = ()

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.vocab_size

    def summary(self) -> str:
        files = f", {len(self.train_files)}+{len(self.val_files)} files" if self.train_files else ""
        return (
            f"data {self.source}{files}: train {len(self.train):,} tokens, "
            f"val {len(self.val):,} tokens, vocab {self.vocab_size}, "
            f"{self.tokens_per_byte:.3f} tokens/byte"
        )


def bits_per_byte(loss_nats, tokens_per_byte: float):
    """Mean cross-entropy per token (nats) -> bits per byte of the underlying text."""
    return loss_nats * tokens_per_byte / math.log(2)


def encode_document(tokenizer: Tokenizer, text: str) -> tuple[np.ndarray, int]:
    """Tokens of ``text`` followed by the tokenizer's end-of-document token (``eos_id``, a
    Hugging Face tokenizer's) or else the separator, and the UTF-8 bytes they stand for."""
    tokens = tokenizer.encode_array(text)
    num_bytes = len(text.encode("utf-8"))
    eos = getattr(tokenizer, "eos_id", None)
    if eos is not None:
        return np.append(tokens, np.asarray(eos, tokens.dtype)), num_bytes
    tokens = np.concatenate([tokens, tokenizer.encode_array(SEPARATOR)])
    return tokens, num_bytes + len(SEPARATOR.encode("utf-8"))


def _from_text(cfg: DataConfig) -> TokenData:
    tokenizer = load_tokenizer(cfg.tokenizer)
    parts: dict[str, list[np.ndarray]] = {"train": [], "val": []}
    names: dict[str, list[str]] = {"train": [], "val": []}
    num_bytes = {"train": 0, "val": 0}
    for doc in iter_documents(cfg.source, val_fraction=cfg.val_fraction, max_bytes=cfg.max_bytes):
        tokens, doc_bytes = encode_document(tokenizer, doc.text)
        parts[doc.split].append(tokens)
        names[doc.split].append(doc.name)
        num_bytes[doc.split] += doc_bytes
    dtype = token_dtype(tokenizer.vocab_size)
    train, val = (
        np.concatenate(parts[s]).astype(dtype, copy=False) if parts[s] else np.zeros(0, dtype)
        for s in ("train", "val")
    )
    measured, measured_bytes = (val, num_bytes["val"]) if len(val) else (train, num_bytes["train"])
    return TokenData(
        train,
        val,
        tokenizer,
        len(measured) / max(measured_bytes, 1),
        os.fspath(cfg.source),
        tuple(names["train"]),
        tuple(names["val"]),
    )


def _from_token_dir(cfg: DataConfig, meta_path) -> TokenData:
    arrays, meta = read_token_dir(meta_path)
    if cfg.tokenizer != "byte" and not same_tokenizer(cfg.tokenizer, meta["tokenizer"]):
        raise ValueError(
            f"data.tokenizer={cfg.tokenizer!r} but {cfg.source} was tokenized with "
            f"{meta['tokenizer']!r}; drop data.tokenizer or re-run prepare_data.py"
        )
    tokenizer = load_tokenizer(meta["tokenizer"])
    if tokenizer.vocab_size != meta["vocab_size"]:
        raise ValueError(
            f"{meta_path}: vocab_size {meta['vocab_size']} does not match "
            f"tokenizer {meta['tokenizer']} ({tokenizer.vocab_size})"
        )
    train = arrays["train"]
    val = arrays.get("val")
    if val is None:  # a lone .bin: hold out its tail
        cut = len(train) - int(len(train) * cfg.val_fraction)
        train, val = train[:cut], train[cut:]
    return TokenData(
        train, val, tokenizer, float(meta.get("tokens_per_byte", 1.0)), os.fspath(cfg.source)
    )


def load_data(cfg: DataConfig, seq_len: int) -> TokenData | RecordData:
    """Tokens for ``cfg.source`` (see DataConfig), checked to hold windows of ``seq_len + 1``;
    with a records ``data.format``, the examples of ``load_record_data`` instead.

    Text sources are read and tokenized in memory (the stdlib corpus takes well under a
    second with bytes); ``cfg.max_bytes`` caps what is read. A token folder or ``.bin`` from
    scripts/prepare_data.py is memory-mapped instead; its tokenizer comes from its meta.json
    and ``max_bytes`` does not apply (nothing is read until a batch needs it).
    """
    source = os.fspath(cfg.source)
    if cfg.format != "stream":
        return load_record_data(cfg, seq_len)
    if (source.endswith(RECORD_SUFFIXES) and os.path.isfile(source)) or is_saved_dataset(
        Path(source)
    ):
        raise ValueError(
            f"data.source {source!r} holds records; set data.format to text, "
            "prompt_completion or chat (data.format=stream reads it as plain text)"
        )
    meta_path = None if source == STDLIB else find_meta(source)
    if meta_path is not None:
        data = _from_token_dir(cfg, meta_path)
    elif source.endswith(".bin"):
        raise ValueError(
            f"no metadata for {source}: expected {source}.json or meta.json next "
            "to it (written by scripts/prepare_data.py)"
        )
    else:
        data = _from_text(cfg)
    need = seq_len + 1
    if len(data.train) < need:
        raise ValueError(
            f"training split of {source} has {len(data.train)} tokens, fewer than "
            f"seq_len + 1 = {need}; use more text (data.max_bytes) or a shorter "
            "seq_len"
        )
    if cfg.val_fraction > 0 and len(data.val) < need:
        raise ValueError(
            f"validation split of {source} has {len(data.val)} tokens, fewer than "
            f"seq_len + 1 = {need}; raise data.val_fraction or data.max_bytes"
        )
    return data
