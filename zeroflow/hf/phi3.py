"""Phi-3 and Phi-4 (``Phi3ForCausalLM``): a Mistral-like decoder whose query, key and value
projections are one ``qkv_proj`` tensor ``[(H + 2 KV) * D, E]`` and whose gate and up
projections are one ``gate_up_proj`` ``[2 M, E]`` (gate first). The table reads each as the
parts of the fused tensor (split on load) and the saver writes them back fused.

LongRoPE (the 128k-context variants' ``rope_type`` 'longrope', per-frequency factors that
switch with the sequence length) and partial rotary embeddings (Phi-4-mini) are refused.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from zeroflow.config.schema import ModelConfig
from zeroflow.hf.convert import refuse
from zeroflow.hf.llama import _T, LlamaFamily
from zeroflow.hf.tensors import TensorMap, tensor_map
from zeroflow.models.gpt import head_dim, num_kv_heads

_FUSED = ("layers/attn/query/", "layers/attn/key/", "layers/attn/value/", "layers/mlp/gate/")
"Rows of the Llama table that Phi-3 stores inside a fused tensor."


@dataclasses.dataclass(frozen=True)
class Phi3Converter(LlamaFamily):
    architecture: str = "Phi3ForCausalLM"
    model_type: str = "phi3"
    windowed: bool = True

    def model_config(self, raw: Mapping[str, Any], where: str) -> ModelConfig:
        for key in ("rope_parameters", "rope_scaling"):
            params = raw.get(key) or {}
            kind = (
                params.get("rope_type", params.get("type")) if isinstance(params, Mapping) else None
            )
            if kind in ("longrope", "su", "yarn"):
                raise refuse(
                    where,
                    f"{key}.rope_type",
                    kind,
                    "Phi-3 with rope_type 'default' (the 4k-context variants and Phi-4); "
                    "LongRoPE (the 128k variants) is not implemented",
                )
        return super().model_config(raw, where)

    def unsupported(self, cfg: ModelConfig) -> str | None:
        reason = super().unsupported(cfg)
        if reason is None and head_dim(cfg) * cfg.num_heads != cfg.embed_dim:
            return f"head_dim {head_dim(cfg)} (it needs embed_dim / num_heads)"
        return reason

    def hf_config(self, cfg: ModelConfig, raw: Mapping[str, Any]) -> dict[str, Any]:
        config = super().hf_config(cfg, raw)
        config.pop("head_dim", None)  # Phi-3 derives it from hidden_size / heads
        return config

    def tensor_maps(self, cfg: ModelConfig) -> list[TensorMap]:
        e, m = cfg.embed_dim, cfg.mlp_dim
        h, kv, d = cfg.num_heads, num_kv_heads(cfg), head_dim(cfg)
        attn, mlp = "model.layers.{i}.self_attn", "model.layers.{i}.mlp"
        rows = [r for r in super().tensor_maps(cfg) if not r.ours.startswith(_FUSED)]
        rows = [r for r in rows if r.ours != "layers/mlp/up/kernel"]
        whole = (h + 2 * kv) * d
        for name, heads, offset in (
            ("query", h, 0),
            ("key", kv, h * d),
            ("value", kv, (h + kv) * d),
        ):
            rows.append(
                tensor_map(
                    f"layers/attn/{name}/kernel",
                    f"{attn}.qkv_proj.weight",
                    [[heads, d], [e]],
                    (2, 0, 1),
                    fused=(0, offset, whole),
                )
            )
        for name, offset in (("gate", 0), ("up", m)):
            rows.append(
                tensor_map(
                    f"layers/mlp/{name}/kernel",
                    f"{mlp}.gate_up_proj.weight",
                    [[m], [e]],
                    _T,
                    fused=(0, offset, 2 * m),
                )
            )
        return rows


PHI3 = Phi3Converter()
