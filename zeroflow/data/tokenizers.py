"""Tokenizers: bytes by default, SentencePiece when ``data.tokenizer`` names a ``.model`` file,
Hugging Face ``tokenizers`` when it names a ``tokenizer.json`` (or a folder holding one).

All give ``encode(str) -> list[int]``, ``decode(ids) -> str``, ``vocab_size`` and
``encode_array(str) -> np.ndarray`` (the fast path used to build token arrays).
"""

from __future__ import annotations

import io
import json
import os
import shutil
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Protocol

import numpy as np

HF_TOKENIZER_FILE = "tokenizer.json"
HF_TOKENIZER_CONFIG = "tokenizer_config.json"
"Beside tokenizer.json: names the special tokens (eos_token), which tokenizer.json does not."
CHAT_TEMPLATE_FILE = "chat_template.jinja"
"Beside tokenizer.json: the chat template, when it is not in tokenizer_config.json."


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

    def write_hf(self, out_dir: str | os.PathLike) -> str:
        """Write a ``tokenizer.json`` (and a ``tokenizer_config.json`` naming the plain fast
        tokenizer, so that no BOS token is added) giving the same ids: GPT-2's byte-level
        pre-tokenizer maps each byte to one character, and the vocabulary maps that character
        back to the byte's value. Returns the file name."""
        from tokenizers import Tokenizer as Backend
        from tokenizers import decoders, models, pre_tokenizers

        vocab = {char: byte for byte, char in enumerate(_byte_characters())}
        backend = Backend(models.BPE(vocab=vocab, merges=[]))
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        backend.decoder = decoders.ByteLevel()
        out = Path(out_dir)
        backend.save(str(out / HF_TOKENIZER_FILE))
        (out / HF_TOKENIZER_CONFIG).write_text(
            json.dumps(
                {
                    "tokenizer_class": "PreTrainedTokenizerFast",
                    "add_bos_token": False,
                    "add_eos_token": False,
                    "clean_up_tokenization_spaces": False,
                },
                indent=1,
            )
            + "\n"
        )
        return HF_TOKENIZER_FILE


def _byte_characters() -> list[str]:
    """The character GPT-2's byte-level pre-tokenizer gives each byte value 0..255: printable
    Latin-1 bytes stand for themselves, the others are shifted to 256 and up."""
    kept = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    shifted = iter(range(256, 512))
    return [chr(b) if b in kept else chr(next(shifted)) for b in range(256)]


class SentencePieceTokenizer:
    """A trained SentencePiece model (``.model`` file)."""

    def __init__(self, model_path: str | os.PathLike):
        import sentencepiece as spm  # optional dependency: pip install sentencepiece

        self.name = os.fspath(model_path)
        try:
            self._sp = spm.SentencePieceProcessor(model_file=self.name)
        except RuntimeError as e:  # "Internal: could not parse ModelProto from ..."
            raise ValueError(
                f"data.tokenizer {self.name} is not a SentencePiece model ({e}); give a "
                "SentencePiece .model file, a Hugging Face tokenizer.json (or its folder) or "
                "'byte'"
            ) from None
        self.vocab_size = int(self._sp.get_piece_size())
        self._dtype = token_dtype(self.vocab_size)

    def encode(self, text: str) -> list[int]:
        return self._sp.encode(text, out_type=int)

    def encode_array(self, text: str) -> np.ndarray:
        return np.asarray(self._sp.encode(text, out_type=int), dtype=self._dtype)

    def decode(self, ids: Sequence[int]) -> str:
        return self._sp.decode([int(i) for i in ids])


def _special_token(value) -> str | None:
    """tokenizer_config.json writes a special token as a string or as {"content": ...}."""
    return value.get("content") if isinstance(value, dict) else value


class HFTokenizer:
    """A Hugging Face ``tokenizers`` tokenizer (``tokenizer.json``).

    ``encode`` applies the tokenizer's own template (Llama's adds its begin-of-text token);
    ``eos_id`` comes from ``tokenizer_config.json`` beside the file, when there is one, and
    ends each document in the data pipeline. ``backend`` is the ``tokenizers.Tokenizer``.
    """

    def __init__(self, path: str | os.PathLike):
        from tokenizers import Tokenizer as Backend

        self.name = os.fspath(path)
        try:
            self.backend = Backend.from_file(self.name)
        except Exception as e:
            raise ValueError(
                f"cannot read Hugging Face tokenizer {self.name}: "
                f"{str(e).splitlines()[0] if str(e) else type(e).__name__}"
            ) from None
        self.vocab_size = int(self.backend.get_vocab_size(with_added_tokens=True))
        self._dtype = token_dtype(self.vocab_size)
        self.eos_id = self._eos_id(Path(self.name).with_name(HF_TOKENIZER_CONFIG))

    def _eos_id(self, config: Path) -> int | None:
        if not config.is_file():
            return None
        try:
            eos = _special_token(json.loads(config.read_text()).get("eos_token"))
        except (OSError, ValueError) as e:
            raise ValueError(f"cannot read {config}: {e}") from None
        return None if eos is None else self.backend.token_to_id(eos)

    def encode(self, text: str) -> list[int]:
        return self.backend.encode(text).ids

    def encode_array(self, text: str) -> np.ndarray:
        return np.asarray(self.backend.encode(text).ids, dtype=self._dtype)

    def decode(self, ids: Sequence[int]) -> str:
        return self.backend.decode([int(i) for i in ids], skip_special_tokens=False)

    @property
    def folder(self) -> Path:
        return Path(self.name).parent

    @property
    def files(self) -> list[Path]:
        """tokenizer.json and, when present, the tokenizer_config.json and chat template
        beside it: what to copy."""
        extra = [self.folder / name for name in (HF_TOKENIZER_CONFIG, CHAT_TEMPLATE_FILE)]
        return [Path(self.name)] + [path for path in extra if path.is_file()]


def hf_tokenizer_file(spec: str | os.PathLike) -> Path | None:
    """``spec`` as a Hugging Face tokenizer.json: the file itself or a folder holding one."""
    path = Path(spec)
    if path.is_dir() and (path / HF_TOKENIZER_FILE).is_file():
        return path / HF_TOKENIZER_FILE
    if path.is_file() and path.suffix == ".json":
        return path
    return None


def load_tokenizer(spec: str | os.PathLike) -> ByteTokenizer | SentencePieceTokenizer | HFTokenizer:
    """``'byte'`` -> ByteTokenizer; a SentencePiece ``.model`` -> SentencePieceTokenizer; a
    ``tokenizer.json`` or a folder holding one (a Hugging Face model folder) -> HFTokenizer."""
    if os.fspath(spec) == "byte":
        return ByteTokenizer()
    hf_file = hf_tokenizer_file(spec)
    if hf_file is not None:
        return HFTokenizer(hf_file)
    if not os.path.isfile(spec):
        raise ValueError(
            f"tokenizer not found: {os.fspath(spec)!r} (use 'byte', a SentencePiece "
            ".model file, or a Hugging Face tokenizer.json or a folder holding one)"
        )
    return SentencePieceTokenizer(spec)


def tokenizer_files(tokenizer) -> list[Path]:
    """The files that define ``tokenizer`` (none for bytes)."""
    if isinstance(tokenizer, HFTokenizer):
        return tokenizer.files
    if isinstance(tokenizer, SentencePieceTokenizer):
        return [Path(tokenizer.name)]
    return []


def copy_tokenizer(
    tokenizer, out_dir: str | os.PathLike, model_name: str = "tokenizer.model"
) -> str:
    """Copy the tokenizer's files into ``out_dir``; returns the spec to load it from there,
    relative to ``out_dir`` ('byte' for bytes). A SentencePiece model is named ``model_name``."""
    out = Path(out_dir)
    files = tokenizer_files(tokenizer)
    if not files:
        return "byte"
    names = [f.name for f in files] if isinstance(tokenizer, HFTokenizer) else [model_name]
    for source, name in zip(files, names):
        if source.resolve() != (out / name).resolve():
            shutil.copyfile(source, out / name)
    return names[0]


def same_tokenizer(a: str | os.PathLike, b: str | os.PathLike) -> bool:
    """Whether two tokenizer specs name the same tokenizer (same file contents)."""
    files = [tokenizer_files(load_tokenizer(spec)) for spec in (a, b)]
    if not files[0] or not files[1]:
        return not files[0] and not files[1]
    return files[0][0].read_bytes() == files[1][0].read_bytes()


def train_sentencepiece(
    lines: Iterable[str],
    model_path: str | os.PathLike,
    *,
    vocab_size: int = 4096,
    num_threads: int = 2,
) -> SentencePieceTokenizer:
    """Train a lossless BPE SentencePiece model on ``lines`` and write it to ``model_path``.

    Lossless on code and prose: no normalisation, whitespace kept (so indentation survives),
    unknown characters fall back to bytes (newlines included). BPE trains in seconds where
    unigram takes tens of seconds on the same text.
    """
    import sentencepiece as spm

    model = io.BytesIO()
    try:
        spm.SentencePieceTrainer.train(
            sentence_iterator=(line for line in lines if line.strip()),
            model_writer=model,
            vocab_size=vocab_size,
            model_type="bpe",
            normalization_rule_name="identity",
            remove_extra_whitespaces=False,
            add_dummy_prefix=False,
            byte_fallback=True,
            allow_whitespace_only_pieces=True,
            split_digits=True,
            character_coverage=0.9995,
            max_sentence_length=16384,
            num_threads=num_threads,
            minloglevel=2,
        )
    except RuntimeError as e:
        reason = str(e).splitlines()[-1] if str(e) else type(e).__name__
        raise ValueError(
            f"sentencepiece training failed (vocab_size={vocab_size}): {reason}"
        ) from None
    with open(model_path, "wb") as f:
        f.write(model.getvalue())
    return SentencePieceTokenizer(model_path)
