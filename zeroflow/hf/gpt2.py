"""GPT-2: pre-norm LayerNorm (with bias) decoder, learned positions, biased projections and a
gelu MLP. Its ``Conv1D`` weights are stored [in, out] (ours already) and q/k/v are fused
into one ``c_attn`` tensor [embed, 3 * embed], which the table reads as three parts."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from zeroflow.config.schema import ModelConfig
from zeroflow.hf.convert import Converter, get, merged, refuse, unexpressed
from zeroflow.hf.tensors import TensorMap, tensor_map
from zeroflow.models.gpt import head_dim, max_positions, num_kv_heads

ACTIVATIONS = {"gelu_new": "gelu", "gelu_pytorch_tanh": "gelu", "gelu": "gelu_exact"}
"config.json activation_function -> ModelConfig.mlp_activation (tanh approximation or erf)."

_REFUSED_FLAGS = {
    "scale_attn_weights": True,
    "scale_attn_by_inverse_layer_idx": False,
    "add_cross_attention": False,
}
"Flags that change the math, with the only value we run."


@dataclasses.dataclass(frozen=True)
class GPT2Converter(Converter):
    architecture: str = "GPT2LMHeadModel"
    model_type: str = "gpt2"
    key_prefixes: tuple[str, ...] = ("transformer.",)

    def model_config(self, raw: Mapping[str, Any], where: str) -> ModelConfig:
        act = raw.get("activation_function", "gelu_new")
        if act not in ACTIVATIONS:
            raise refuse(where, "activation_function", act, ", ".join(ACTIVATIONS))
        for key, value in _REFUSED_FLAGS.items():
            if raw.get(key, value) != value:
                raise refuse(where, key, raw[key], repr(value))
        embed = get(raw, "n_embd", where)
        context = get(raw, "n_positions", where, default=1024)
        return ModelConfig(
            vocab_size=get(raw, "vocab_size", where),
            seq_len=context,
            num_layers=get(raw, "n_layer", where),
            embed_dim=embed,
            num_heads=get(raw, "n_head", where),
            mlp_dim=get(raw, "n_inner", where, default=4 * embed),
            mlp_activation=ACTIVATIONS[act],
            norm="layernorm",
            norm_eps=get(raw, "layer_norm_epsilon", where, float, 1e-5),
            tie_embeddings=get(raw, "tie_word_embeddings", where, bool, True),
            positions="learned",
            max_positions=context,
            attn_bias="all",
            mlp_bias=True,
        )

    def unsupported(self, cfg: ModelConfig) -> str | None:
        wanted = {
            "norm": "layernorm",
            "positions": "learned",
            "attn_bias": "all",
            "mlp_bias": True,
            "mlp": "dense",
            "sliding_window": 0,
        }
        for field, value in wanted.items():
            if getattr(cfg, field) != value:
                return f"model.{field}={getattr(cfg, field)!r} (it needs {value!r})"
        reason = unexpressed(cfg)
        if reason is not None:
            return reason
        if cfg.mlp_activation not in ("gelu", "gelu_exact"):
            return f"model.mlp_activation={cfg.mlp_activation!r} (it needs 'gelu' or 'gelu_exact')"
        if num_kv_heads(cfg) != cfg.num_heads or head_dim(cfg) * cfg.num_heads != cfg.embed_dim:
            return "grouped-query heads or a head_dim other than embed_dim / num_heads"
        return None

    def hf_config(self, cfg: ModelConfig, raw: Mapping[str, Any]) -> dict[str, Any]:
        activation = "gelu_new" if cfg.mlp_activation == "gelu" else "gelu"
        return merged(
            raw,
            {
                "architectures": [self.architecture],
                "model_type": self.model_type,
                "vocab_size": cfg.vocab_size,
                "n_embd": cfg.embed_dim,
                "n_layer": cfg.num_layers,
                "n_head": cfg.num_heads,
                "n_inner": cfg.mlp_dim,
                "n_positions": max_positions(cfg),
                "activation_function": activation,
                "layer_norm_epsilon": cfg.norm_eps,
                "tie_word_embeddings": cfg.tie_embeddings,
                **_REFUSED_FLAGS,
            },
        )

    def tensor_maps(self, cfg: ModelConfig) -> list[TensorMap]:
        e, m, v, p = cfg.embed_dim, cfg.mlp_dim, cfg.vocab_size, max_positions(cfg)
        h, d = cfg.num_heads, head_dim(cfg)
        block = "transformer.h.{i}"
        rows = [
            tensor_map("embedding", "transformer.wte.weight", [[v], [e]]),
            tensor_map("position_embedding", "transformer.wpe.weight", [[p], [e]]),
        ]
        for ours, theirs in (
            ("final_norm", "transformer.ln_f"),
            ("layers/attn_norm", f"{block}.ln_1"),
            ("layers/mlp_norm", f"{block}.ln_2"),
        ):
            rows += [
                tensor_map(f"{ours}/scale", f"{theirs}.weight", [[e]]),
                tensor_map(f"{ours}/bias", f"{theirs}.bias", [[e]]),
            ]
        for i, name in enumerate(("query", "key", "value")):
            # c_attn.weight [embed, 3 * embed]: columns [q | k | v], each split into heads.
            rows += [
                tensor_map(
                    f"layers/attn/{name}/kernel",
                    f"{block}.attn.c_attn.weight",
                    [[e], [h, d]],
                    fused=(1, i * e, 3 * e),
                ),
                tensor_map(
                    f"layers/attn/{name}/bias",
                    f"{block}.attn.c_attn.bias",
                    [[h, d]],
                    fused=(0, i * e, 3 * e),
                ),
            ]
        rows += [
            tensor_map("layers/attn/out/kernel", f"{block}.attn.c_proj.weight", [[h, d], [e]]),
            tensor_map("layers/attn/out/bias", f"{block}.attn.c_proj.bias", [[e]]),
            tensor_map("layers/mlp/up/kernel", f"{block}.mlp.c_fc.weight", [[e], [m]]),
            tensor_map("layers/mlp/up/bias", f"{block}.mlp.c_fc.bias", [[m]]),
            tensor_map("layers/mlp/down/kernel", f"{block}.mlp.c_proj.weight", [[m], [e]]),
            tensor_map("layers/mlp/down/bias", f"{block}.mlp.c_proj.bias", [[e]]),
        ]
        if not cfg.tie_embeddings:
            rows.append(tensor_map("lm_head", "lm_head.weight", [[v], [e]], (1, 0)))
        return rows


GPT2 = GPT2Converter()
