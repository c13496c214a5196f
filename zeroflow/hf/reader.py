"""Lazy reads from a Hugging Face checkpoint folder's safetensors files.

Nothing is read when the folder is opened: the file index (``model.safetensors.index.json``,
or the headers of the ``*.safetensors`` files) says which file holds each tensor, and
``read(key, slices)`` memory-maps only the requested slice (safetensors' ``get_slice``).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from pathlib import Path

import ml_dtypes  # noqa: F401  (registers bfloat16 with numpy: safetensors reads BF16 through it)
import numpy as np
from safetensors import safe_open

INDEX_FILE = "model.safetensors.index.json"


class HFCheckpointError(ValueError):
    """A checkpoint folder that cannot be read as asked, described in one line."""


def open_safetensors(path: Path) -> safe_open:
    """``safe_open(path)``, or HFCheckpointError naming the file and what is wrong with it
    (safetensors checks the header and that the file holds every tensor it lists)."""
    try:
        return safe_open(path, framework="numpy")
    except Exception as e:
        detail = str(e).split(": ", 1)[-1].strip() or type(e).__name__
        if "not fully covered" in detail:
            detail = "shorter than its header says: cut short?"
        raise HFCheckpointError(
            f"{path} is not a readable safetensors file ({detail}); copy or convert it again"
        ) from None


def _index(folder: Path) -> dict[str, str]:
    """Tensor name -> safetensors file name."""
    index_path = folder / INDEX_FILE
    if index_path.is_file():
        try:
            return dict(json.loads(index_path.read_text())["weight_map"])
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise HFCheckpointError(f"cannot read {index_path}: {e}") from None
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        found = ", ".join(sorted(p.name for p in folder.iterdir())[:8]) or "nothing"
        raise HFCheckpointError(
            f"{folder} has no *.safetensors weights (found: {found}); "
            "pytorch_model.bin is not read, save it as safetensors"
        )
    weight_map = {}
    for path in files:
        with open_safetensors(path) as f:
            weight_map.update({key: path.name for key in f.keys()})
    return weight_map


Prefix = str | tuple[str, str]
"A leading key component some exports drop, or ``(ours, theirs)``: one they spell differently."


class SafetensorsReader:
    """Tensor slices from one checkpoint folder; ``prefixes`` are leading key components that
    some exports drop (GPT-2's ``transformer.``) or rename (``("model.",
    "language_model.model.")``: a multimodal checkpoint's text decoder), tried in order when a
    key is not found as named."""

    def __init__(self, folder: str | os.PathLike, prefixes: Iterable[Prefix] = ()):
        self.folder = Path(folder)
        self.weight_map = _index(self.folder)
        self.prefixes = tuple(prefixes)
        self._handles: dict[str, safe_open] = {}

    def file_of(self, key: str) -> Path:
        """The safetensors file holding ``key`` (as named in the index or a file header)."""
        return self.folder / self.weight_map[key]

    def listing(self) -> Path:
        """The file that lists the tensors: the index, or the one safetensors file (the folder
        when several unindexed files share the listing)."""
        if (self.folder / INDEX_FILE).is_file():
            return self.folder / INDEX_FILE
        files = set(self.weight_map.values())
        return self.folder / files.pop() if len(files) == 1 else self.folder

    def _spellings(self, key: str) -> list[str]:
        """``key`` as each of ``prefixes`` would spell it in the checkpoint."""
        out = []
        for prefix in self.prefixes:
            ours, theirs = prefix if isinstance(prefix, tuple) else (prefix, "")
            if key.startswith(ours):
                out.append(theirs + key[len(ours) :])
        return out

    def resolve(self, key: str) -> str:
        if key in self.weight_map:
            return key
        spellings = self._spellings(key)
        for spelled in spellings:
            if spelled in self.weight_map:
                return spelled
        sample = ", ".join(sorted(self.weight_map)[:4])
        also = f" (nor {', '.join(map(repr, spellings))})" if spellings else ""
        raise HFCheckpointError(
            f"{self.listing()}: no tensor {key!r}{also}, which config.json's architecture "
            f"needs (it lists {len(self.weight_map)} tensors, e.g. {sample})"
        )

    def _slice(self, key: str):
        name = self.weight_map[key]
        if name not in self._handles:
            path = self.folder / name
            if not path.is_file():
                raise HFCheckpointError(f"{path} (listed in {INDEX_FILE}) is missing")
            self._handles[name] = open_safetensors(path)
        try:
            return self._handles[name].get_slice(key)
        except Exception:  # safetensors' own error: the index names a file without the key
            raise HFCheckpointError(
                f"{self.folder / name}: no tensor {key!r}, though {INDEX_FILE} lists it there"
            ) from None

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self._slice(self.resolve(key)).get_shape())

    def dtype(self, key: str) -> str:
        """The safetensors dtype name, e.g. 'BF16'."""
        return self._slice(self.resolve(key)).get_dtype()

    def read(self, key: str, slices: tuple[slice, ...]) -> np.ndarray:
        """``tensor[slices]`` as a numpy array in the stored dtype (bf16 via ml_dtypes)."""
        return np.asarray(self._slice(self.resolve(key))[slices])

    def close(self) -> None:
        self._handles.clear()
