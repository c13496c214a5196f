"""BERT (``BertModel``): the bidirectional text encoder BGE and E5 checkpoints use.

Post-norm blocks, absolute learned positions, token types (all 0 here: one segment). The
pooler (a tanh Dense on [CLS]) is not read: sentence embeddings take [CLS] itself (BGE) or
the mean of the tokens (E5).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from typing import Any

from zeroflow.hf.clip_vision import block_rows, norm_rows
from zeroflow.hf.convert import get, refuse
from zeroflow.hf.encoder_convert import EncoderConverter, activation, block_fields
from zeroflow.hf.tensors import TensorMap, tensor_map
from zeroflow.models.encoders import TEXT, EncoderConfig


@dataclasses.dataclass(frozen=True)
class Bert(EncoderConverter):
    architecture: str = "BertModel"
    model_type: str = "bert"
    key_prefixes: tuple[str, ...] = ()
    ignored: re.Pattern = re.compile(r"(^|\.)(position_ids|pooler\.dense\.(weight|bias))$")

    def encoder_config(self, raw: Mapping[str, Any], where: str) -> EncoderConfig:
        kind = raw.get("position_embedding_type", "absolute")
        if kind != "absolute":
            raise refuse(where, "position_embedding_type", kind, "'absolute'")
        if raw.get("is_decoder") or raw.get("add_cross_attention"):
            raise refuse(where, "is_decoder", True, "a bidirectional encoder (false)")
        return EncoderConfig(
            modality=TEXT,
            activation=activation(raw, where, "gelu"),
            norm_eps=get(raw, "layer_norm_eps", where, float, 1e-12),
            vocab_size=get(raw, "vocab_size", where),
            max_positions=get(raw, "max_position_embeddings", where),
            type_vocab_size=get(raw, "type_vocab_size", where, default=2),
            **block_fields(raw, where),
        )

    def tensor_maps(self, cfg: EncoderConfig) -> list[TensorMap]:
        e, layer = cfg.hidden, "encoder.layer.{i}"
        names = {n: f"{layer}.attention.self.{n}" for n in ("query", "key", "value")}
        names.update(
            out=f"{layer}.attention.output.dense",
            fc1=f"{layer}.intermediate.dense",
            fc2=f"{layer}.output.dense",
            norm1=f"{layer}.attention.output.LayerNorm",
            norm2=f"{layer}.output.LayerNorm",
        )
        return [
            tensor_map("token_embed", "embeddings.word_embeddings.weight", [[cfg.vocab_size], [e]]),
            tensor_map(
                "positions", "embeddings.position_embeddings.weight", [[cfg.max_positions], [e]]
            ),
            tensor_map(
                "type_embed",
                "embeddings.token_type_embeddings.weight",
                [[cfg.type_vocab_size], [e]],
            ),
            *norm_rows("embed_norm", "embeddings.LayerNorm", e),
            *block_rows(cfg, names),
        ]

    def preprocessing(self, raw: Mapping[str, Any]) -> dict[str, Any]:
        return {
            "max_positions": raw.get("max_position_embeddings"),
            "vocab_size": raw.get("vocab_size"),
        }


BERT = Bert()
