"""Frozen encoders from Hugging Face folders: ``load_encoder(path) -> (module, params, cfg)``.

    from zeroflow import hf
    vit, vit_params, vit_cfg = hf.load_encoder("path/to/clip-vision")   # CLIPVisionModel
    out = vit.apply({"params": vit_params}, pixel_values)              # {"hidden", "pooled"}
    bert, bert_params, bert_cfg = hf.load_encoder("path/to/bge")        # BertModel

Each tensor is read lazily and placed straight into its sharding, as ``load_params`` does for
the GPT architectures; the weights are checked the same way (shapes, float storage, nothing
left unread but the converter's known buffers).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from typing import Any

import jax
import jax.numpy as jnp

from zeroflow.hf.architectures import config_file
from zeroflow.hf.bert import BERT
from zeroflow.hf.clip_vision import CLIP_VISION
from zeroflow.hf.encoder_convert import EncoderConverter
from zeroflow.hf.load import _dtype, _place
from zeroflow.hf.reader import HFCheckpointError, SafetensorsReader
from zeroflow.hf.tensors import TensorMap
from zeroflow.models.encoders import VISION, EncoderConfig, encoder_module
from zeroflow.util.tree import path_str

ENCODERS: dict[str, EncoderConverter] = {c.architecture: c for c in (CLIP_VISION, BERT)}
"Encoder architecture name (config.json ``architectures[0]``) -> converter."


@dataclasses.dataclass(frozen=True)
class HFEncoder:
    """What ``load_encoder`` read: the architecture, our config and config.json."""

    architecture: str
    encoder: EncoderConfig
    raw: dict[str, Any]
    identity: str
    "SHA-256 of config.json and the weights' bytes: the encoder, whatever its folder is called."

    @property
    def preprocessing(self) -> dict[str, Any]:
        return ENCODERS[self.architecture].preprocessing(self.raw)


def read_encoder_config(path: str | os.PathLike) -> tuple[EncoderConverter, EncoderConfig, dict]:
    file = config_file(path)
    try:
        raw = json.loads(file.read_text())
    except (OSError, ValueError) as e:
        raise HFCheckpointError(f"cannot read {file}: {e}") from None
    names = raw.get("architectures") or [raw.get("model_type")]
    by_type = {c.model_type: c for c in ENCODERS.values()}
    converter = ENCODERS.get(names[0]) or by_type.get(names[0])
    if converter is None:
        raise HFCheckpointError(
            f"{file}: encoder architecture {names[0]!r} is not supported; "
            f"supported: {', '.join(ENCODERS)}"
        )
    return converter, converter.encoder_config(raw, os.fspath(file)), raw


def _check_tensors(
    reader: SafetensorsReader, converter: EncoderConverter, maps: list[TensorMap], num_layers: int
) -> None:
    used = set()
    for m in maps:
        for layer in range(num_layers) if m.stacked else [None]:
            key = reader.resolve(m.key(layer))
            used.add(key)
            if reader.shape(key) != m.hf_shape:
                raise HFCheckpointError(
                    f"{reader.file_of(key)}: {key} has shape "
                    f"{list(reader.shape(key))}, but config.json implies "
                    f"{list(m.hf_shape)}"
                )
            if reader.dtype(key) not in ("F32", "F16", "BF16", "F64"):
                raise HFCheckpointError(
                    f"{reader.file_of(key)}: {key} is stored as "
                    f"{reader.dtype(key)}; expected a float type"
                )
    left = [k for k in reader.weight_map if k not in used and not converter.ignored.search(k)]
    if left:
        raise HFCheckpointError(
            f"{reader.file_of(left[0])}: {len(left)} tensors are not part of the "
            f"{converter.architecture} config.json describes, e.g. {left[:3]}"
        )


def fingerprint(path: str | os.PathLike, reader: SafetensorsReader) -> str:
    """SHA-256 over config.json and every weight file the folder's index names."""
    digest = hashlib.sha256(config_file(path).read_bytes())
    for name in sorted(set(reader.weight_map.values())):
        with open(reader.folder / name, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 24), b""):
                digest.update(chunk)
    return digest.hexdigest()


def load_encoder(path: str | os.PathLike, dtype: str = "fp32", *, shardings: Any = None):
    """``(module, params, HFEncoder)`` from a folder holding config.json and safetensors.

    ``module.apply({"params": params}, inputs)`` returns ``{"hidden", "pooled"}`` (inputs:
    ``pixel_values`` [B, C, H, W], or ``input_ids`` and ``attention_mask`` [B, T]); its
    matmuls run in ``dtype`` ('fp32', 'bf16', 'fp16'), the params' dtype too. ``shardings``:
    a tree of shardings for the params, or one for every leaf (default: the first device)."""
    np_dtype = _dtype(dtype)
    converter, cfg, raw = read_encoder_config(path)
    module = encoder_module(cfg, np_dtype)
    abstract = jax.eval_shape(lambda: module.init(jax.random.key(0), *_dummy(cfg)))["params"]
    maps = {m.ours: m for m in converter.tensor_maps(cfg)}
    paths = {path_str(p) for p, _ in jax.tree_util.tree_leaves_with_path(abstract)}
    if paths != set(maps):
        raise AssertionError(
            f"{converter.architecture} table and module disagree: {sorted(paths ^ set(maps))}"
        )
    reader = SafetensorsReader(path, converter.key_prefixes)
    _check_tensors(reader, converter, list(maps.values()), cfg.num_layers)
    if shardings is None:
        shardings = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    if isinstance(shardings, jax.sharding.Sharding):
        shardings = jax.tree.map(lambda _, one=shardings: one, abstract)
    try:
        params = jax.tree_util.tree_map_with_path(
            lambda p, leaf, sharding: _place(
                maps[path_str(p)], leaf.shape, sharding, np_dtype, reader.read
            ),
            abstract,
            shardings,
        )
        identity = fingerprint(path, reader)
    finally:
        reader.close()
    return module, params, HFEncoder(converter.architecture, cfg, raw, identity)


def _dummy(cfg: EncoderConfig):
    if cfg.modality == VISION:
        return (jnp.zeros((1, cfg.channels, cfg.image_size, cfg.image_size), jnp.float32),)
    return (jnp.zeros((1, 2), jnp.int32),)
