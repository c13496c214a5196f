"""Hugging Face checkpoints in and out: Llama, Mistral, Qwen2 and GPT-2 on zeroflow's GPT;
frozen encoders (CLIP's vision tower, BERT) read with ``load_encoder``.

    from zeroflow import hf
    model, params, cfg = hf.from_pretrained("path/to/hf_dir", dtype="fp32")
    logits = model.apply({"params": params}, tokens)          # tokens: int32 [B, T]
    hf.save_pretrained(model, params, cfg, "out_dir")          # safetensors + config.json
    tok = hf.load_tokenizer("path/to/hf_dir")                  # tokenizers on tokenizer.json

One converter per architecture (``CONVERTERS``): config.json both ways and a table between
the two parameter trees (``zeroflow/hf/tensors.py``). Nothing is ever downloaded: paths are
local folders. See docs/hf.md.
"""

from __future__ import annotations

import os

from zeroflow.data.tokenizers import HFTokenizer, hf_tokenizer_file
from zeroflow.hf.architectures import CONVERTERS, converter_for_model, read_config, with_run_fields
from zeroflow.hf.convert import RUNTIME_FIELDS, Converter, HFConfig
from zeroflow.hf.encoders import ENCODERS, HFEncoder, load_encoder
from zeroflow.hf.load import from_pretrained, load_params
from zeroflow.hf.reader import HFCheckpointError, SafetensorsReader
from zeroflow.hf.save import save_pretrained
from zeroflow.hf.vocabulary import check_tokenizer


def load_tokenizer(path: str | os.PathLike) -> HFTokenizer:
    """The ``tokenizers`` tokenizer of a Hugging Face folder (or a tokenizer.json file):
    ``encode(text) -> ids``, ``decode(ids) -> text``, ``vocab_size``, ``eos_id``, ``backend``."""
    file = hf_tokenizer_file(path)
    if file is None:
        raise HFCheckpointError(
            f"no tokenizer.json at {os.fspath(path)!r} (expected a folder "
            "holding tokenizer.json, or the file itself)"
        )
    return HFTokenizer(file)


__all__ = [
    "CONVERTERS",
    "Converter",
    "ENCODERS",
    "HFCheckpointError",
    "HFConfig",
    "HFEncoder",
    "HFTokenizer",
    "RUNTIME_FIELDS",
    "SafetensorsReader",
    "check_tokenizer",
    "converter_for_model",
    "from_pretrained",
    "load_encoder",
    "load_params",
    "load_tokenizer",
    "read_config",
    "save_pretrained",
    "with_run_fields",
]
