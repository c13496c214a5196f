"""Pre-tokenized datasets on disk: ``train.bin``, ``val.bin`` and ``meta.json`` in one folder.

The ``.bin`` files are raw little-endian token ids, read back with ``np.memmap`` so nothing is
loaded until a batch touches it. ``meta.json`` says how to read them::

    {"format": "zeroflow-tokens", "version": 1, "dtype": "uint16", "vocab_size": 4096,
     "tokenizer": "tokenizer.model",   # 'byte', or a .model path relative to this folder
     "tokens_per_byte": 0.31, "val_fraction": 0.05, "source": "...",
     "splits": {"train": {"file": "train.bin", "tokens": ..., "bytes": ..., "documents": ...},
                "val":   {"file": "val.bin", ...}}}

The dtype is the smallest that holds the vocabulary: uint8 for bytes (256), uint16 up to
65536, else uint32. A lone ``name.bin`` may carry its own sidecar ``name.bin.json`` of the same
shape; without a ``val`` split its tail is held out at load time.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np

from zeroflow.data.tokenizers import token_dtype

FORMAT = "zeroflow-tokens"
VERSION = 1
META_NAME = "meta.json"
SPLITS = ("train", "val")


class TokenDirWriter:
    """Streams token arrays into ``out_dir/{train,val}.bin``; ``close()`` writes ``meta.json``."""

    def __init__(self, out_dir: str | os.PathLike, *, vocab_size: int, tokenizer: str, **meta: Any):
        self.out_dir = Path(out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.dtype = token_dtype(vocab_size)
        self.meta = {
            "format": FORMAT,
            "version": VERSION,
            "dtype": self.dtype.name,
            "vocab_size": int(vocab_size),
            "tokenizer": tokenizer,
            **meta,
        }
        self.counts: dict[str, dict[str, Any]] = {
            s: {"file": f"{s}.bin", "tokens": 0, "bytes": 0, "documents": 0} for s in SPLITS
        }
        self._files = {s: open(self.out_dir / f"{s}.bin", "wb") for s in SPLITS}

    def write(self, split: str, tokens: np.ndarray, num_bytes: int) -> None:
        """Append one document's tokens (``num_bytes`` = the UTF-8 bytes they encode)."""
        tokens = np.asarray(tokens)
        if tokens.size and int(tokens.max()) >= self.meta["vocab_size"]:
            raise ValueError(
                f"token id {int(tokens.max())} >= vocab_size {self.meta['vocab_size']}"
            )
        self._files[split].write(tokens.astype(self.dtype.newbyteorder("<"), copy=False).tobytes())
        count = self.counts[split]
        count["tokens"] += int(tokens.size)
        count["bytes"] += int(num_bytes)
        count["documents"] += 1

    def close(self) -> dict[str, Any]:
        for f in self._files.values():
            f.close()
        measured = self.counts["val"] if self.counts["val"]["bytes"] else self.counts["train"]
        self.meta["tokens_per_byte"] = measured["tokens"] / max(measured["bytes"], 1)
        self.meta["splits"] = self.counts
        (self.out_dir / META_NAME).write_text(json.dumps(self.meta, indent=2) + "\n")
        return self.meta

    def __enter__(self) -> TokenDirWriter:
        return self

    def __exit__(self, *exc) -> None:
        if exc[0] is None:
            self.close()
        else:
            for f in self._files.values():
                f.close()


def find_meta(source: str | os.PathLike) -> Path | None:
    """A token dataset's metadata: ``DIR/meta.json``, or ``X.bin.json`` / ``meta.json`` by X.bin."""
    path = Path(source)
    if path.is_dir():
        return path / META_NAME if (path / META_NAME).is_file() else None
    if path.suffix == ".bin":
        for candidate in (path.with_name(path.name + ".json"), path.with_name(META_NAME)):
            if candidate.is_file():
                return candidate
    return None


def _memmap(path: Path, dtype: np.dtype) -> np.ndarray:
    if path.stat().st_size == 0:  # np.memmap refuses empty files
        return np.zeros(0, dtype)
    return np.memmap(path, dtype=dtype, mode="r")


def read_token_dir(meta_path: str | os.PathLike) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """``({"train": memmap, "val": memmap?}, meta)``; the tokenizer path is made absolute."""
    meta_path = Path(meta_path)
    try:
        meta = json.loads(meta_path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"cannot read token metadata {meta_path}: {e}") from None
    if meta.get("format") != FORMAT or "splits" not in meta or "dtype" not in meta:
        raise ValueError(f"{meta_path} is not a {FORMAT} metadata file (made by prepare_data.py)")
    dtype = np.dtype(meta["dtype"]).newbyteorder("<")
    arrays = {}
    for split, info in meta["splits"].items():
        path = meta_path.parent / info["file"]
        if not path.is_file():
            raise ValueError(f"token file missing: {path} (listed in {meta_path})")
        arrays[split] = _memmap(path, dtype)
    if "train" not in arrays:
        raise ValueError(f"{meta_path} lists no 'train' split")
    if meta["tokenizer"] != "byte":
        meta["tokenizer"] = os.fspath(meta_path.parent / meta["tokenizer"])
    return arrays, meta
