"""zeroflow params -> a Hugging Face checkpoint folder that transformers loads.

Writes ``config.json`` and the weights as safetensors: one ``model.safetensors``, or, past
``max_shard_bytes``, ``model-0000k-of-0000n.safetensors`` files with the
``model.safetensors.index.json`` map. Shards are planned from the shapes first and then
filled one at a time, each Hugging Face tensor rebuilt from one layer of our stacked leaves,
so the host holds one shard at a time, never the whole model.
"""

from __future__ import annotations

import json
import math
import os
from collections import defaultdict
from pathlib import Path
from typing import Any

import jax
import numpy as np
from safetensors.numpy import save_file

from zeroflow.config.schema import ModelConfig
from zeroflow.hf.architectures import CONFIG_FILE, CONVERTERS, converter_for_model
from zeroflow.hf.convert import HFConfig
from zeroflow.hf.load import DTYPES
from zeroflow.hf.reader import INDEX_FILE, HFCheckpointError
from zeroflow.hf.tensors import TensorMap, to_hf
from zeroflow.util.tree import path_str

TORCH_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
DEFAULT_SHARD_BYTES = 5 * 10**9


def _layer(leaf, layer: int | None) -> np.ndarray:
    """One layer of a stacked leaf (the whole leaf when unstacked), on the host, in fp32."""
    value = leaf if layer is None else leaf[layer]
    return np.asarray(jax.device_get(value), dtype=np.float32)


def _build(parts: list[tuple[TensorMap, int | None]], leaves: dict[str, Any], dtype) -> np.ndarray:
    """One Hugging Face tensor from its part(s) (three for GPT-2's fused c_attn)."""
    first = parts[0][0]
    if first.part is None:
        m, layer = parts[0]
        return to_hf(m, _layer(leaves[m.ours], layer)).astype(dtype)
    whole = np.zeros(first.hf_shape, dtype)
    for m, layer in parts:
        if m.part is None:
            raise ValueError(f"{m.hf} is fused from parts, but {m.ours} is mapped to all of it")
        dim, offset = m.part
        where = [slice(None)] * len(m.hf_shape)
        where[dim] = slice(offset, offset + m.part_shape[dim])
        whole[tuple(where)] = to_hf(m, _layer(leaves[m.ours], layer))
    return whole


def _plan_shards(sizes: dict[str, int], max_bytes: int) -> list[list[str]]:
    """Tensors in order, packed greedily into shards of at most ``max_bytes`` (a tensor larger
    than that gets a shard of its own)."""
    shards: list[list[str]] = [[]]
    used = 0
    for key, size in sizes.items():
        if shards[-1] and used + size > max_bytes:
            shards.append([])
            used = 0
        shards[-1].append(key)
        used += size
    return shards


def _architecture(model_cfg: ModelConfig, cfg: HFConfig | ModelConfig):
    if isinstance(cfg, HFConfig):
        converter, raw = CONVERTERS[cfg.architecture], dict(cfg.raw)
    else:
        converter, raw = converter_for_model(model_cfg), {}
    reason = converter.unsupported(model_cfg)
    if reason is not None:
        raise HFCheckpointError(f"{converter.architecture} cannot express {reason}")
    return converter, raw


def save_pretrained(
    model,
    params,
    cfg: HFConfig | ModelConfig,
    out_dir: str | os.PathLike,
    *,
    dtype: str = "fp32",
    max_shard_bytes: int = DEFAULT_SHARD_BYTES,
) -> Path:
    """Write ``params`` of ``model`` (zeroflow's GPT) as a Hugging Face checkpoint folder.

    ``cfg`` is the ``HFConfig`` from ``from_pretrained`` (its architecture and the config.json
    keys we do not model are kept; the architecture fields come from ``model.cfg``), or a plain
    ``ModelConfig`` for a model trained from scratch (Llama or GPT-2 is chosen to fit it).
    ``dtype``: 'fp32', 'bf16' or 'fp16' weights.
    """
    if dtype not in TORCH_DTYPES:
        raise ValueError(f"dtype={dtype!r}; choose one of {list(TORCH_DTYPES)}")
    model_cfg = getattr(model, "cfg", None) or (cfg.model if isinstance(cfg, HFConfig) else cfg)
    converter, raw = _architecture(model_cfg, cfg)
    leaves = {path_str(p): x for p, x in jax.tree_util.tree_leaves_with_path(params)}
    maps = converter.tensor_maps(model_cfg)
    if set(leaves) != {m.ours for m in maps}:
        raise HFCheckpointError(
            f"params do not match the {converter.architecture} table: "
            f"{sorted(set(leaves) ^ {m.ours for m in maps})[:6]}"
        )
    tensors: dict[str, list] = defaultdict(list)
    for m in maps:
        for layer in range(model_cfg.num_layers) if m.stacked else [None]:
            tensors[m.key(layer)].append((m, layer))
    np_dtype = DTYPES[dtype]
    sizes = {
        key: math.prod(parts[0][0].hf_shape) * np_dtype.itemsize for key, parts in tensors.items()
    }
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for stale in [*out.glob("model*.safetensors"), out / INDEX_FILE]:
        stale.unlink(missing_ok=True)  # a previous save's shards would mix with these
    shards = _plan_shards(sizes, max_shard_bytes)
    names = (
        ["model.safetensors"]
        if len(shards) == 1
        else [f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors" for k in range(len(shards))]
    )
    for name, keys in zip(names, shards):
        arrays = {key: _build(tensors[key], leaves, np_dtype) for key in keys}
        save_file(arrays, str(out / name), metadata={"format": "pt"})
        del arrays
    if len(shards) > 1:
        index = {
            "metadata": {"total_size": sum(sizes.values())},
            "weight_map": {key: name for name, keys in zip(names, shards) for key in keys},
        }
        (out / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    config = converter.hf_config(model_cfg, raw)
    config.update(dtype=TORCH_DTYPES[dtype], torch_dtype=TORCH_DTYPES[dtype])
    (out / CONFIG_FILE).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return out
