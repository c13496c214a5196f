"""The encoder converter contract: config.json -> ``EncoderConfig``, and the tensor table.

Encoders are not zeroflow's GPT, so they have their own contract beside ``convert.Converter``
(one object per architecture, so adding one touches no loader code); the table rows are the same ``TensorMap``s and
are read by the same lazy, sharding-aware placement (``zeroflow.hf.load``).
"""

from __future__ import annotations

import abc
import re
from collections.abc import Mapping
from typing import Any

from zeroflow.hf.convert import get, refuse
from zeroflow.hf.tensors import TensorMap
from zeroflow.models.encoders import ACTIVATIONS, EncoderConfig

_ACT_NAMES = {
    "gelu": "gelu",
    "quick_gelu": "quick_gelu",
    "gelu_new": "gelu_tanh",
    "gelu_pytorch_tanh": "gelu_tanh",
}
"config.json hidden_act -> EncoderConfig.activation."


def activation(raw: Mapping[str, Any], where: str, default: str) -> str:
    act = raw.get("hidden_act", default)
    if act not in _ACT_NAMES:
        raise refuse(where, "hidden_act", act, ", ".join(sorted(_ACT_NAMES)))
    assert _ACT_NAMES[act] in ACTIVATIONS
    return _ACT_NAMES[act]


def block_fields(raw: Mapping[str, Any], where: str) -> dict[str, Any]:
    """The EncoderConfig fields every BERT/ViT-style config.json spells the same way."""
    hidden, heads = get(raw, "hidden_size", where), get(raw, "num_attention_heads", where)
    if hidden % heads:
        raise refuse(where, "num_attention_heads", heads, f"a divisor of hidden_size={hidden}")
    return {
        "hidden": hidden,
        "num_heads": heads,
        "num_layers": get(raw, "num_hidden_layers", where),
        "mlp_dim": get(raw, "intermediate_size", where),
    }


class EncoderConverter(abc.ABC):
    """One Hugging Face encoder architecture."""

    architecture: str
    "The config.json ``architectures`` entry, e.g. 'BertModel'."
    model_type: str
    key_prefixes: tuple[str, ...] = ()
    "Leading key components some exports drop (tried when a key is missing as named)."
    ignored: re.Pattern = re.compile(r"$^")
    "Checkpoint tensors that are not read on purpose (buffers, unused heads)."

    @abc.abstractmethod
    def encoder_config(self, raw: Mapping[str, Any], where: str) -> EncoderConfig:
        """config.json -> EncoderConfig, or HFCheckpointError naming a key we cannot run."""

    @abc.abstractmethod
    def tensor_maps(self, cfg: EncoderConfig) -> list[TensorMap]:
        """One row per parameter of ``zeroflow.models.encoders``' module."""

    @abc.abstractmethod
    def preprocessing(self, raw: Mapping[str, Any]) -> dict[str, Any]:
        """What the inputs must look like (image size and normalisation, or the text's
        length), recorded with every latent cache made with this encoder."""
