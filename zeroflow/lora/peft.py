"""Adapters as a Hugging Face ``peft`` folder: ``adapter_config.json`` and
``adapter_model.safetensors``, which ``peft.PeftModel.from_pretrained`` puts on the
transformers model that ``zeroflow.hf.save_pretrained`` writes for the base weights.

Each adapted weight is found in the architecture's conversion table (``zeroflow/hf/``); its
factors go through the same view and transpose as the weight, giving peft's
``lora_A.weight [r, in]`` and ``lora_B.weight [out, r]`` per layer. GPT-2's fused ``c_attn``
(query, key and value in one module) gets one adapter of rank ``r`` times the number of parts
adapted: ``lora_A`` stacks the parts' ``A``s, ``lora_B`` places each part's ``B`` in its rows
and columns (zeros elsewhere), and ``rank_pattern`` / ``alpha_pattern`` keep the scale
``alpha / r`` for it, so the update is exactly the three separate ones.
"""

from __future__ import annotations

import json
import math
import os
from collections import defaultdict
from pathlib import Path

import jax
import numpy as np
from safetensors.numpy import save_file

from zeroflow.hf.architectures import CONVERTERS, converter_for_model
from zeroflow.hf.convert import HFConfig
from zeroflow.hf.reader import HFCheckpointError
from zeroflow.hf.tensors import TensorMap
from zeroflow.lora.adapters import flatten

CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"
PREFIX = "base_model.model."
"peft's prefix before a module's path in the transformers model."
_LAYER = ".{i}."


def save_peft(
    adapters,
    cfg,
    out_dir: str | os.PathLike,
    *,
    alpha: float,
    base_model: str = "",
    dropout: float = 0.0,
) -> Path:
    """Write ``adapters`` (``LoRA.init``'s tree) for the model of ``cfg`` (an ``HFConfig``
    from ``zeroflow.hf.from_pretrained``, or a ``ModelConfig``: Llama or GPT-2 chosen to fit
    it, as ``save_pretrained`` does) as a peft LoRA folder; ``base_model`` is recorded as
    ``base_model_name_or_path``."""
    converter, model_cfg = _converter(cfg)
    maps = {m.ours: m for m in converter.tensor_maps(model_cfg)}
    flat = flatten(adapters)
    ranks = {int(pair["a"].shape[-1]) for pair in flat.values()}
    if len(ranks) != 1:
        raise ValueError(f"adapters of several ranks {sorted(ranks)}; peft's folder has one r")
    rank = ranks.pop()
    modules: dict[str, list] = defaultdict(list)
    for path, pair in sorted(flat.items()):
        m = maps.get(path)
        if m is None or not m.hf.endswith(".weight"):
            raise ValueError(
                f"adapter {path!r} has no Hugging Face {converter.architecture} weight to go on"
            )
        modules[m.hf[: -len(".weight")]].append((m, _host(pair["a"]), _host(pair["b"])))
    tensors, rank_pattern, alpha_pattern = {}, {}, {}
    for module, parts in modules.items():
        layers = range(model_cfg.num_layers) if parts[0][0].stacked else [None]
        for layer in layers:
            name = module.replace("{i}", str(layer)) if layer is not None else module
            lora_a, lora_b = _module_factors(parts, layer, rank, _input_dim(converter, module))
            tensors[f"{PREFIX}{name}.lora_A.weight"] = np.ascontiguousarray(lora_a)
            tensors[f"{PREFIX}{name}.lora_B.weight"] = np.ascontiguousarray(lora_b)
        if len(parts) > 1:  # a fused module: rank and alpha both grow by the number of parts
            rank_pattern[_target(module)] = rank * len(parts)
            alpha_pattern[_target(module)] = alpha * len(parts)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / WEIGHTS_FILE), metadata={"format": "pt"})
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": rank,
        "lora_alpha": alpha,
        "lora_dropout": dropout,
        "target_modules": sorted({_target(m) for m in modules}),
        "bias": "none",
        "fan_in_fan_out": converter.model_type == "gpt2",
        "rank_pattern": rank_pattern,
        "alpha_pattern": alpha_pattern,
        "init_lora_weights": True,
        "use_rslora": False,
        "use_dora": False,
        "modules_to_save": None,
        "inference_mode": True,
    }
    (out / CONFIG_FILE).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return out


def _converter(cfg):
    if isinstance(cfg, HFConfig):
        converter, model_cfg = CONVERTERS[cfg.architecture], cfg.model
    else:
        converter, model_cfg = converter_for_model(cfg), cfg
    reason = converter.unsupported(model_cfg)
    if reason is not None:
        raise HFCheckpointError(f"{converter.architecture} cannot express {reason}")
    return converter, model_cfg


def _host(x) -> np.ndarray:
    return np.asarray(jax.device_get(x), dtype=np.float32)


def _target(module: str) -> str:
    """peft's ``target_modules`` entry: the module's path within a block (``self_attn.q_proj``,
    ``attn.c_proj``, which ``mlp.c_proj`` does not end with), or its whole path outside."""
    return module.split(_LAYER, 1)[1] if _LAYER in module else module


def _input_dim(converter, module: str) -> int:
    """Which dimension of the Hugging Face weight is the module's input: GPT-2's ``Conv1D``
    blocks store ``[in, out]``, every ``Linear`` ``[out, in]``."""
    return 0 if converter.model_type == "gpt2" and _LAYER in module else 1


def _groups(m: TensorMap, aligned: np.ndarray) -> np.ndarray:
    """A factor of one layer (our layout, trailing rank) viewed as the Hugging Face tensor:
    the size of each of its dimensions (1 where the factor has none of it) and the rank."""
    view = aligned.transpose([*np.argsort(m.perm), aligned.ndim - 1])
    sizes, first = [], 0
    for group in m.split:
        sizes.append(math.prod(view.shape[first : first + len(group)]))
        first += len(group)
    return view.reshape([*sizes, view.shape[-1]])


def _module_factors(parts, layer, rank: int, in_dim: int):
    """peft's ``(lora_A [R, in], lora_B [out, R])`` of one module, ``R = rank * len(parts)``."""
    out_dim = 1 - in_dim
    a_list, b_list = [], []
    for m, a, b in parts:
        a_view = _groups(m, a[layer] if layer is not None else a)
        b_view = _groups(m, b[layer] if layer is not None else b)
        fits = (
            a_view.shape[out_dim] == 1
            and b_view.shape[in_dim] == 1
            and a_view.shape[in_dim] == m.part_shape[in_dim]
            and b_view.shape[out_dim] == m.part_shape[out_dim]
        )
        if not fits:
            raise ValueError(
                f"adapter {m.ours!r} does not contract the input dimension of "
                f"{m.hf!r}; peft cannot express it"
            )
        a_list.append(np.moveaxis(a_view, in_dim, 0).reshape(-1, rank).T)
        b_list.append(np.moveaxis(b_view, out_dim, 0).reshape(-1, rank))
    first = parts[0][0]
    if first.part is None:
        return a_list[0], b_list[0]
    if first.part[0] != out_dim:
        raise ValueError(f"{first.hf!r} is fused along its input dimension; peft cannot express it")
    lora_a = np.concatenate(a_list, axis=0)
    lora_b = np.zeros((first.hf_shape[out_dim], rank * len(parts)), np.float32)
    for k, ((m, _, _), b_part) in enumerate(zip(parts, b_list)):
        offset = m.part[1]
        lora_b[offset : offset + b_part.shape[0], k * rank : (k + 1) * rank] = b_part
    return lora_a, lora_b
