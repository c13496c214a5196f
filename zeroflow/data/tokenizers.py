"""Tokenizers: bytes by default, SentencePiece when ``data.tokenizer`` names a ``.model`` file.

Both give ``encode(str) -> list[int]``, ``decode(ids) -> str``, ``vocab_size`` and
``encode_array(str) -> np.ndarray`` (the fast path used to build token arrays).
"""
from __future__ import annotations

import io
import os
from collections.abc import Iterable, Sequence
from typing import Protocol

import numpy as np


def token_dtype(vocab_size: int) -> np.dtype:
    """Smallest unsigned dtype that holds every token id of a ``vocab_size`` vocabulary."""
    if vocab_size <= 1 << 8:
        return np.dtype(np.uint8)
    if vocab_size <= 1 << 16:
        return np.dtype(np.uint16)
    return np.dtype(np.uint32)


class Tokenizer(Protocol):
    name: str
    vocab_size: int

    def encode(self, text: str) -> list[int]: ...
    def encode_array(self, text: str) -> np.ndarray: ...
    def decode(self, ids: Sequence[int]) -> str: ...


class ByteTokenizer:
    """Token = UTF-8 byte value; vocabulary 256, exactly one token per byte."""

    name = "byte"
    vocab_size = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def encode_array(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8)

    def decode(self, ids: Sequence[int]) -> str:
        # Sampled ids need not form valid UTF-8; show the damage instead of raising.
        return bytes(int(i) for i in ids).decode("utf-8", "replace")


class SentencePieceTokenizer:
    """A trained SentencePiece model (``.model`` file)."""

    def __init__(self, model_path: str | os.PathLike):
        import sentencepiece as spm  # optional dependency: pip install sentencepiece

        self.name = os.fspath(model_path)
        self._sp = spm.SentencePieceProcessor(model_file=self.name)
        self.vocab_size = int(self._sp.get_piece_size())
        self._dtype = token_dtype(self.vocab_size)

    def encode(self, text: str) -> list[int]:
        return self._sp.encode(text, out_type=int)

    def encode_array(self, text: str) -> np.ndarray:
        return np.asarray(self._sp.encode(text, out_type=int), dtype=self._dtype)

    def decode(self, ids: Sequence[int]) -> str:
        return self._sp.decode([int(i) for i in ids])


def load_tokenizer(spec: str | os.PathLike) -> ByteTokenizer | SentencePieceTokenizer:
    """``'byte'`` -> ByteTokenizer; a SentencePiece ``.model`` path -> SentencePieceTokenizer."""
    if os.fspath(spec) == "byte":
        return ByteTokenizer()
    if not os.path.isfile(spec):
        raise ValueError(f"tokenizer not found: {os.fspath(spec)!r} "
                         "(use 'byte' or a path to a SentencePiece .model file)")
    return SentencePieceTokenizer(spec)


def train_sentencepiece(lines: Iterable[str], model_path: str | os.PathLike, *,
                        vocab_size: int = 4096, num_threads: int = 2) -> SentencePieceTokenizer:
    """Train a lossless BPE SentencePiece model on ``lines`` and write it to ``model_path``.

    Lossless on code and prose: no normalisation, whitespace kept (so indentation survives),
    unknown characters fall back to bytes (newlines included). BPE trains in seconds where
    unigram takes tens of seconds on the same text.
    """
    import sentencepiece as spm

    model = io.BytesIO()
    try:
        spm.SentencePieceTrainer.train(
            sentence_iterator=(line for line in lines if line.strip()), model_writer=model,
            vocab_size=vocab_size, model_type="bpe", normalization_rule_name="identity",
            remove_extra_whitespaces=False, add_dummy_prefix=False, byte_fallback=True,
            allow_whitespace_only_pieces=True, split_digits=True, character_coverage=0.9995,
            max_sentence_length=16384, num_threads=num_threads, minloglevel=2)
    except RuntimeError as e:
        reason = str(e).splitlines()[-1] if str(e) else type(e).__name__
        raise ValueError(f"sentencepiece training failed (vocab_size={vocab_size}): "
                         f"{reason}") from None
    with open(model_path, "wb") as f:
        f.write(model.getvalue())
    return SentencePieceTokenizer(model_path)
