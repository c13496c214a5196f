"""Llama, Mistral, Qwen2 and Qwen3: pre-norm RMSNorm decoders with rotary GQA attention and
a SwiGLU MLP, i.e. zeroflow's default GPT. They differ only in biases, the attention window
and Qwen3's RMSNorm on each head's queries and keys (``model.qk_norm``):

| architecture | q/k/v bias | output / MLP bias | window | qk-norm |
|---|---|---|---|---|
| LlamaForCausalLM | ``attention_bias`` | ``attention_bias`` / ``mlp_bias`` | none | no |
| MistralForCausalLM | no | no | ``sliding_window`` | no |
| Qwen2ForCausalLM | always | no | none (``use_sliding_window`` refused) | no |
| Qwen3ForCausalLM | ``attention_bias`` | ``attention_bias`` / no | none (refused as Qwen2) | yes |
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from zeroflow.config.schema import ModelConfig
from zeroflow.hf.convert import (
    DROP,
    Converter,
    get,
    merged,
    read_rope,
    refuse,
    unexpressed,
    write_rope,
)
from zeroflow.hf.tensors import TensorMap, tensor_map
from zeroflow.models.gpt import head_dim, max_positions, num_kv_heads

_T = (1, 0)
"Transpose: Hugging Face Linear weights are [out, in], our kernels [in, out]."


@dataclasses.dataclass(frozen=True)
class LlamaFamily(Converter):
    architecture: str
    model_type: str
    bias_keys: bool = False
    "config.json has attention_bias / mlp_bias (Llama)."
    qkv_bias: bool = False
    "q/k/v projections always carry biases (Qwen2)."
    windowed: bool = False
    "config.json's sliding_window applies (Mistral)."
    qk_norm: bool = False
    "RMSNorm on each head's queries and keys (Qwen3); attention_bias but no mlp_bias key."
    key_prefixes: tuple = ("model.",)

    # -- config.json -> ModelConfig ------------------------------------------------------------
    def model_config(self, raw: Mapping[str, Any], where: str) -> ModelConfig:
        act = raw.get("hidden_act", "silu")
        if act != "silu":
            raise refuse(where, "hidden_act", act, "'silu' (SwiGLU) for this architecture")
        if not self.windowed and (
            raw.get("use_sliding_window")
            or any(t != "full_attention" for t in raw.get("layer_types") or ())
        ):
            key = "use_sliding_window" if raw.get("use_sliding_window") else "layer_types"
            raise refuse(where, key, raw[key], "full attention in every layer")
        hidden, heads = get(raw, "hidden_size", where), get(raw, "num_attention_heads", where)
        dim = get(raw, "head_dim", where, default=hidden // heads)
        context = get(raw, "max_position_embeddings", where, default=2048)
        attn_bias = "qkv" if self.qkv_bias else "none"
        if (self.bias_keys or self.qk_norm) and get(raw, "attention_bias", where, bool, False):
            attn_bias = "all"
        return ModelConfig(
            vocab_size=get(raw, "vocab_size", where),
            seq_len=context,
            num_layers=get(raw, "num_hidden_layers", where),
            embed_dim=hidden,
            num_heads=heads,
            num_kv_heads=get(raw, "num_key_value_heads", where, default=heads),
            head_dim=0 if dim * heads == hidden else dim,
            mlp_dim=get(raw, "intermediate_size", where),
            mlp_activation="swiglu",
            norm="rmsnorm",
            norm_eps=get(raw, "rms_norm_eps", where, float, 1e-6),
            tie_embeddings=get(raw, "tie_word_embeddings", where, bool, False),
            positions="rope",
            max_positions=context,
            attn_bias=attn_bias,
            mlp_bias=self.bias_keys and get(raw, "mlp_bias", where, bool, False),
            sliding_window=get(raw, "sliding_window", where, int, 0) if self.windowed else 0,
            qk_norm=self.qk_norm,
            **read_rope(raw, where),
        )

    # -- ModelConfig -> config.json ------------------------------------------------------------
    def unsupported(self, cfg: ModelConfig) -> str | None:
        wanted = {
            "norm": "rmsnorm",
            "mlp_activation": "swiglu",
            "positions": "rope",
            "mlp": "dense",
        }
        for field, value in wanted.items():
            if getattr(cfg, field) != value:
                return f"model.{field}={getattr(cfg, field)!r} (it needs {value!r})"
        reason = unexpressed(cfg, ("qk_norm",))
        if reason is not None or cfg.qk_norm != self.qk_norm:
            return reason or f"model.qk_norm={cfg.qk_norm} (it needs {self.qk_norm})"
        biases = {"qkv" if self.qkv_bias else "none"}
        if self.bias_keys or self.qk_norm:
            biases = {"none", "all"}
        if cfg.attn_bias not in biases:
            return f"model.attn_bias={cfg.attn_bias!r} (it needs one of {sorted(biases)})"
        if cfg.mlp_bias and not self.bias_keys:
            return "model.mlp_bias=True (it has no MLP biases)"
        if cfg.sliding_window and not self.windowed:
            return f"model.sliding_window={cfg.sliding_window} (it has no attention window)"
        return None

    def hf_config(self, cfg: ModelConfig, raw: Mapping[str, Any]) -> dict[str, Any]:
        updates: dict[str, Any] = {
            "architectures": [self.architecture],
            "model_type": self.model_type,
            "vocab_size": cfg.vocab_size,
            "hidden_size": cfg.embed_dim,
            "intermediate_size": cfg.mlp_dim,
            "num_hidden_layers": cfg.num_layers,
            "num_attention_heads": cfg.num_heads,
            "num_key_value_heads": num_kv_heads(cfg),
            "head_dim": head_dim(cfg),
            "hidden_act": "silu",
            "max_position_embeddings": max_positions(cfg),
            "rms_norm_eps": cfg.norm_eps,
            "tie_word_embeddings": cfg.tie_embeddings,
            **write_rope(cfg, raw),
        }
        if self.bias_keys:
            updates.update(attention_bias=cfg.attn_bias == "all", mlp_bias=cfg.mlp_bias)
        if self.qk_norm:
            updates["attention_bias"] = cfg.attn_bias == "all"
        if self.windowed:
            updates["sliding_window"] = cfg.sliding_window or None
        elif "use_sliding_window" in raw or self.qkv_bias or self.qk_norm:
            updates["use_sliding_window"] = False
            updates["layer_types"] = DROP  # rebuilt by transformers from num_hidden_layers
        return merged(raw, updates)

    # -- the tensor table ----------------------------------------------------------------------
    def tensor_maps(self, cfg: ModelConfig) -> list[TensorMap]:
        e = cfg.embed_dim
        return [
            *decoder_rows(cfg),
            tensor_map(
                "layers/mlp_norm/scale", "model.layers.{i}.post_attention_layernorm.weight", [[e]]
            ),
        ]


def decoder_rows(cfg: ModelConfig) -> list[TensorMap]:
    """The rows every Llama-like decoder shares (Llama's names): embedding, final and input
    norms, q/k/v/o (with biases and qk-norms as ``cfg`` has them), the MLP and ``lm_head``;
    the norm before the MLP is named differently from one architecture to the next."""
    e, m, v = cfg.embed_dim, cfg.mlp_dim, cfg.vocab_size
    h, kv, d = cfg.num_heads, num_kv_heads(cfg), head_dim(cfg)
    attn, mlp = "model.layers.{i}.self_attn", "model.layers.{i}.mlp"
    rows = [
        tensor_map("embedding", "model.embed_tokens.weight", [[v], [e]]),
        tensor_map("final_norm/scale", "model.norm.weight", [[e]]),
        tensor_map("layers/attn_norm/scale", "model.layers.{i}.input_layernorm.weight", [[e]]),
    ]
    if cfg.qk_norm:
        rows += [
            tensor_map("layers/attn/query_norm/scale", f"{attn}.q_norm.weight", [[d]]),
            tensor_map("layers/attn/key_norm/scale", f"{attn}.k_norm.weight", [[d]]),
        ]
    for name, proj, heads in (
        ("query", "q_proj", h),
        ("key", "k_proj", kv),
        ("value", "v_proj", kv),
    ):
        # [heads * head_dim, embed] -> view [heads, head_dim, embed] -> [embed, heads, head_dim]
        rows.append(
            tensor_map(
                f"layers/attn/{name}/kernel",
                f"{attn}.{proj}.weight",
                [[heads, d], [e]],
                (2, 0, 1),
            )
        )
        if cfg.attn_bias in ("qkv", "all"):
            rows.append(tensor_map(f"layers/attn/{name}/bias", f"{attn}.{proj}.bias", [[heads, d]]))
    rows.append(
        tensor_map("layers/attn/out/kernel", f"{attn}.o_proj.weight", [[e], [h, d]], (1, 2, 0))
    )
    if cfg.attn_bias == "all":
        rows.append(tensor_map("layers/attn/out/bias", f"{attn}.o_proj.bias", [[e]]))
    for name, out, inp in (("gate", m, e), ("up", m, e), ("down", e, m)):
        rows.append(
            tensor_map(f"layers/mlp/{name}/kernel", f"{mlp}.{name}_proj.weight", [[out], [inp]], _T)
        )
        if cfg.mlp_bias:
            rows.append(tensor_map(f"layers/mlp/{name}/bias", f"{mlp}.{name}_proj.bias", [[out]]))
    if not cfg.tie_embeddings:
        rows.append(tensor_map("lm_head", "lm_head.weight", [[v], [e]], _T))
    return rows


LLAMA = LlamaFamily("LlamaForCausalLM", "llama", bias_keys=True)
QWEN3 = LlamaFamily("Qwen3ForCausalLM", "qwen3", qk_norm=True)
MISTRAL = LlamaFamily("MistralForCausalLM", "mistral", windowed=True)
QWEN2 = LlamaFamily("Qwen2ForCausalLM", "qwen2", qkv_bias=True)
