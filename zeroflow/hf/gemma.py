"""Gemma 2 and Gemma 3 (text): Llama-like decoders with every norm scaled by ``1 + w``
(``model.norm_offset``), a norm after attention and after the MLP as well as before
(``model.post_norms``), a GeGLU MLP (tanh-approximated gelu), embeddings multiplied by
sqrt(hidden) (``model.scale_embeddings``), scores scaled by ``query_pre_attn_scalar`` and
sliding-window layers interleaved with global ones (``model.global_every``). Gemma 2 adds
soft-capping of the attention scores and the logits; Gemma 3 adds qk-norm and a rotary base
per kind of layer (``model.local_rope_base`` for the windowed ones, whose rotary embedding is
never scaled; ``rope_scaling`` applies to the global ones).

``Gemma3ForConditionalGeneration`` checkpoints (the published 4B-27B) are read through the
same converter: the text decoder of ``text_config`` (keys ``language_model.model.*`` or
``model.language_model.*``); the vision tower and its projector are left out, with one
warning line, and the model is saved as ``Gemma3ForCausalLM``. Keys config.json leaves out
take transformers' defaults for the class (``DEFAULTS``).
"""

from __future__ import annotations

import dataclasses
import warnings
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
    rope_setting,
    write_rope,
)
from zeroflow.hf.llama import decoder_rows
from zeroflow.hf.tensors import TensorMap, tensor_map
from zeroflow.models.gpt import head_dim, max_positions, num_kv_heads

GEMMA3_MULTIMODAL = "gemma3"
"config.json model_type of Gemma3ForConditionalGeneration."
SLIDING, FULL = "sliding_attention", "full_attention"
_COMMON_DEFAULTS = {
    "hidden_size": 2304,
    "intermediate_size": 9216,
    "num_hidden_layers": 26,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 256,
    "hidden_activation": "gelu_pytorch_tanh",
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": True,
    "query_pre_attn_scalar": 256,
    "sliding_window": 4096,
    "attention_bias": False,
}
DEFAULTS = {
    "gemma2": {
        **_COMMON_DEFAULTS,
        "vocab_size": 256000,
        "max_position_embeddings": 8192,
        "final_logit_softcapping": 30.0,
        "attn_logit_softcapping": 50.0,
        "rope_theta": 10000.0,
    },
    "gemma3_text": {
        **_COMMON_DEFAULTS,
        "vocab_size": 262208,
        "max_position_embeddings": 131072,
        "rope_theta": 1_000_000.0,
        "rope_local_base_freq": 10000.0,
    },
}
"transformers' Gemma2Config / Gemma3TextConfig defaults of the keys we read."
_VISION = (
    "vision_tower.",
    "multi_modal_projector.",
    "model.vision_tower.",
    "model.multi_modal_projector.",
)


def _pattern(raw: Mapping[str, Any], layers: int, where: str, default: int) -> int:
    """config.json's layer kinds as ``global_every``: each ``n``-th layer global, the others
    windowed (``layers + 1`` when none is global). Other arrangements are refused."""
    every = raw.get("sliding_window_pattern", raw.get("_sliding_window_pattern"))
    kinds = raw.get("layer_types")
    if kinds is None:
        return int(every or default)
    if every is None:
        every = next((i + 1 for i, kind in enumerate(kinds) if kind == FULL), layers + 1)
    if list(kinds) != layer_types(int(every), layers):
        raise refuse(
            where,
            "layer_types",
            kinds,
            "a global layer every n-th layer and sliding-window layers between (Gemma's)",
        )
    return int(every)


def layer_types(every: int, layers: int) -> list[str]:
    return [FULL if (i + 1) % every == 0 else SLIDING for i in range(layers)]


def _rope(raw: Mapping[str, Any], where: str) -> dict[str, Any]:
    """Gemma 3's rotary settings per kind of layer (transformers 5's nested rope_parameters,
    or rope_theta / rope_local_base_freq / rope_scaling), or Gemma 2's single one."""
    params = raw.get("rope_parameters")
    if isinstance(params, Mapping) and FULL in params:
        if raw.get("rope_scaling"):
            raise refuse(
                where,
                "rope_scaling",
                raw["rope_scaling"],
                "no rope_scaling beside rope_parameters per kind of layer (transformers 5 lets "
                "rope_scaling replace rope_parameters); keep one",
            )
        fields = read_rope({"rope_parameters": params[FULL]}, where, f"rope_parameters.{FULL}")
        local = params.get(SLIDING) or {}
        if local.get("rope_type", "default") != "default":
            raise refuse(
                where, f"rope_parameters.{SLIDING}.rope_type", local["rope_type"], "'default'"
            )
        fields["local_rope_base"] = float(local.get("rope_theta", 10000.0))
        return fields
    fields = read_rope(raw, where)
    if "rope_local_base_freq" in raw:
        fields["local_rope_base"] = get(raw, "rope_local_base_freq", where, float)
    return fields


def _number(value: float) -> int | float:
    """A whole number as an int (transformers' Gemma configs type query_pre_attn_scalar int)."""
    return int(value) if float(value).is_integer() else value


def _softcap(raw: Mapping[str, Any], key: str, where: str) -> float:
    return get(raw, key, where, float, 0.0)


@dataclasses.dataclass(frozen=True)
class GemmaFamily(Converter):
    architecture: str
    model_type: str
    qk_norm: bool = False
    "Gemma 3: RMSNorm on each head's queries and keys, a rotary base per kind of layer."
    key_prefixes: tuple = ("model.",)
    ignored_prefixes: tuple[str, ...] = ()

    def text_config(self, raw: Mapping[str, Any], where: str) -> Mapping[str, Any]:
        if "text_config" not in raw:
            return raw
        # Issued from read_config's one line (stacklevel 2), so that Python shows it once per
        # process however many times a run reads the folder's config.json.
        warnings.warn(
            f"{where}: {raw.get('architectures', ['?'])[0]} read as its text decoder; the "
            f"vision tower is not loaded (saved back as {self.architecture})",
            stacklevel=2,
        )
        text = dict(raw["text_config"] or {})
        for key in ("bos_token_id", "eos_token_id", "pad_token_id", "tie_word_embeddings"):
            if key in raw and key not in text:
                text[key] = raw[key]
        return {**text, "architectures": [self.architecture], "model_type": self.model_type}

    def model_config(self, raw: Mapping[str, Any], where: str) -> ModelConfig:
        raw = {**DEFAULTS[self.model_type], **raw}
        act = raw.get("hidden_activation") or raw.get("hidden_act")
        if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
            raise refuse(where, "hidden_activation", act, "'gelu_pytorch_tanh' (GeGLU)")
        for key in ("use_bidirectional_attention", "attention_bias"):
            if raw.get(key):
                raise refuse(where, key, raw[key], "false")
        if not raw.get("sliding_window"):
            raise refuse(where, "sliding_window", raw.get("sliding_window"), "a window size")
        layers, hidden = get(raw, "num_hidden_layers", where), get(raw, "hidden_size", where)
        context = get(raw, "max_position_embeddings", where)
        return ModelConfig(
            vocab_size=get(raw, "vocab_size", where),
            seq_len=context,
            num_layers=layers,
            embed_dim=hidden,
            num_heads=get(raw, "num_attention_heads", where),
            num_kv_heads=get(raw, "num_key_value_heads", where),
            head_dim=get(raw, "head_dim", where),
            mlp_dim=get(raw, "intermediate_size", where),
            mlp_activation="geglu",
            norm="rmsnorm",
            norm_eps=get(raw, "rms_norm_eps", where, float),
            tie_embeddings=get(raw, "tie_word_embeddings", where, bool),
            positions="rope",
            max_positions=context,
            sliding_window=get(raw, "sliding_window", where),
            global_every=_pattern(raw, layers, where, 6 if self.qk_norm else 2),
            qk_norm=self.qk_norm,
            norm_offset=1.0,
            post_norms=True,
            scale_embeddings=True,
            query_pre_attn_scalar=get(raw, "query_pre_attn_scalar", where, float),
            attn_softcap=_softcap(raw, "attn_logit_softcapping", where),
            logit_softcap=_softcap(raw, "final_logit_softcapping", where),
            **self._rope(raw, where),
        )

    def _rope(self, raw: Mapping[str, Any], where: str) -> dict[str, Any]:
        """``_rope``, with Gemma 2's rope scaling refused: its one rotary embedding is scaled
        in every layer, and the GPT scales the global layers' only (Gemma 3's way)."""
        fields = _rope(raw, where)
        if self.qk_norm or fields["rope_scaling"] == "none":
            return fields
        params = raw.get("rope_parameters")
        nested = isinstance(params, Mapping) and FULL in params
        key = f"rope_parameters.{FULL}" if nested else rope_setting(raw, where)[1]
        raise refuse(
            where,
            f"{key}.rope_type",
            fields["rope_scaling"],
            "Gemma 2 without rope scaling (rope_type 'default'); zeroflow scales the rotary "
            "embedding of the global layers only, as Gemma 3 has it",
        )

    def unsupported(self, cfg: ModelConfig) -> str | None:
        wanted = {
            "norm": "rmsnorm",
            "mlp_activation": "geglu",
            "positions": "rope",
            "mlp": "dense",
            "attn_bias": "none",
            "mlp_bias": False,
            "qk_norm": self.qk_norm,
            "norm_offset": 1.0,
            "post_norms": True,
            "scale_embeddings": True,
        }
        for field, value in wanted.items():
            if getattr(cfg, field) != value:
                return f"model.{field}={getattr(cfg, field)!r} (it needs {value!r})"
        if not (cfg.sliding_window and cfg.global_every):
            return "no sliding-window layers (model.sliding_window and global_every > 0)"
        if not self.qk_norm and (cfg.local_rope_base or cfg.rope_scaling != "none"):
            return "a rotary base per kind of layer or rope scaling (Gemma 2 has neither)"
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
            "hidden_activation": "gelu_pytorch_tanh",
            "max_position_embeddings": max_positions(cfg),
            "rms_norm_eps": cfg.norm_eps,
            "tie_word_embeddings": cfg.tie_embeddings,
            "query_pre_attn_scalar": _number(cfg.query_pre_attn_scalar or head_dim(cfg)),
            "sliding_window": cfg.sliding_window,
            "layer_types": layer_types(cfg.global_every, cfg.num_layers),
            "attn_logit_softcapping": cfg.attn_softcap or None,
            "final_logit_softcapping": cfg.logit_softcap or None,
            "attention_bias": False,
            "text_config": DROP,
            "vision_config": DROP,
            **self._rope_keys(cfg, raw),
        }
        return merged(raw, updates)

    def _rope_keys(self, cfg: ModelConfig, raw: Mapping[str, Any]) -> dict[str, Any]:
        keys = write_rope(cfg, raw)
        if not self.qk_norm:
            return keys
        local = cfg.local_rope_base or cfg.rope_base
        if "rope_parameters" in keys:
            keys["rope_parameters"] = {
                FULL: keys["rope_parameters"],
                SLIDING: {"rope_type": "default", "rope_theta": local},
            }
            return {**keys, "rope_local_base_freq": DROP}
        return {**keys, "rope_local_base_freq": local}

    def tensor_maps(self, cfg: ModelConfig) -> list[TensorMap]:
        e, block = cfg.embed_dim, "model.layers.{i}"
        return [
            *decoder_rows(cfg),
            tensor_map(
                "layers/attn_post_norm/scale", f"{block}.post_attention_layernorm.weight", [[e]]
            ),
            tensor_map("layers/mlp_norm/scale", f"{block}.pre_feedforward_layernorm.weight", [[e]]),
            tensor_map(
                "layers/mlp_post_norm/scale", f"{block}.post_feedforward_layernorm.weight", [[e]]
            ),
        ]


GEMMA2 = GemmaFamily("Gemma2ForCausalLM", "gemma2")
GEMMA3 = GemmaFamily(
    "Gemma3ForCausalLM",
    "gemma3_text",
    qk_norm=True,
    key_prefixes=(
        "model.",
        ("model.", "language_model.model."),
        ("model.", "model.language_model."),
        ("lm_head.", "language_model.lm_head."),
    ),
    ignored_prefixes=_VISION,
)
