"""The converter contract, the config it produces, and the config.json helpers they share.

A converter is one object per Hugging Face architecture (a table, not a script,
so a new architecture adds a converter and touches no loading code): ``model_config``
reads config.json into our ``ModelConfig``, ``hf_config`` writes one back, ``unsupported``
says why a ``ModelConfig`` has no form in that architecture, and ``tensor_maps`` is the table
between the two parameter trees. Anything config.json says that we cannot run is refused with
one line naming the key, never approximated.
"""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Mapping
from typing import Any

from zeroflow.config.schema import ModelConfig
from zeroflow.hf.reader import HFCheckpointError, Prefix
from zeroflow.hf.tensors import TensorMap

RUNTIME_FIELDS = (
    "seq_len",
    "remat",
    "remat_dtype",
    "attention",
    "dropout",
    "init_from",
    "loss_chunk",
    "loss_vocab_chunk",
    "mlp_chunk",
    "layer_chunk",
)
"ModelConfig fields a run chooses for itself; config.json decides every other one."

_REQUIRED = object()
DROP = object()
"A config.json key to remove when writing (``merged``)."


@dataclasses.dataclass(frozen=True)
class HFConfig:
    """What ``from_pretrained`` read: the architecture, our model config, and config.json."""

    architecture: str
    "e.g. 'LlamaForCausalLM'."
    model: ModelConfig
    raw: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    "config.json as read; keys zeroflow does not model (token ids, ...) are written back as is."


def get(raw: Mapping[str, Any], key: str, where: str, kind: type = int, default: Any = _REQUIRED):
    """``raw[key]`` checked to be a ``kind``; a missing or null key takes ``default``."""
    value = raw.get(key)
    if value is None:
        if default is _REQUIRED:
            raise HFCheckpointError(f"{where}: config.json has no {key!r}")
        return default
    ok = isinstance(value, kind) and not (kind is not bool and isinstance(value, bool))
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        value, ok = float(value), True
    if not ok:
        raise HFConfigValueError(where, key, value, f"a {kind.__name__}")
    return value


class HFConfigValueError(HFCheckpointError):
    def __init__(self, where: str, key: str, value: Any, supported: str):
        super().__init__(
            f"{where}: config.json {key}={value!r} is not supported; zeroflow supports {supported}"
        )


def refuse(where: str, key: str, value: Any, supported: str) -> HFConfigValueError:
    """The one-line error for a config.json value we cannot run."""
    return HFConfigValueError(where, key, value, supported)


# --- rotary embeddings: transformers 4's rope_theta/rope_scaling and 5's rope_parameters -----

ROPE_TYPES = ("default", "llama3", "linear")
_LLAMA3_KEYS = {
    "factor": "rope_scaling_factor",
    "low_freq_factor": "rope_low_freq_factor",
    "high_freq_factor": "rope_high_freq_factor",
}


def _rope_kind(params: Any, key: str, where: str) -> str:
    """The rope type of one rope setting, refused unless zeroflow runs it."""
    if not isinstance(params, Mapping) or any(isinstance(v, Mapping) for v in params.values()):
        raise refuse(where, key, params, "one rope setting for all layers (a mapping of scalars)")
    kind = params.get("rope_type", params.get("type", "default"))
    if kind not in ROPE_TYPES:
        raise refuse(where, f"{key}.rope_type", kind, f"rope types {', '.join(ROPE_TYPES)}")
    return kind


def _scaling_of(params: Mapping[str, Any], kind: str) -> dict[str, Any]:
    return {
        **{k: v for k, v in params.items() if k not in ("rope_theta", "type", "rope_type")},
        "rope_type": kind,
    }


def rope_setting(
    raw: Mapping[str, Any], where: str, within: str = ""
) -> tuple[Mapping[str, Any], str, str]:
    """``(settings, key, rope type)`` of config.json's rotary embedding: ``rope_parameters``
    (transformers 5) or ``rope_scaling`` (4, and what 5 reads instead when it is set, taking
    ``rope_theta`` from beside it). Each present one is checked; both present must say the same
    scaling and rotary base, else transformers' model is not the one ``rope_parameters``
    describes. ``within``: the key ``raw`` sits under in config.json, named in errors (Gemma 3's
    ``rope_parameters.full_attention``)."""
    keys = ("rope_parameters", "rope_scaling")
    present = [(raw[k], within or k) for k in keys if raw.get(k)]
    kinds = [_rope_kind(params, key, where) for params, key in present]
    if len(present) == 2:
        (params, _), (scaling, _) = present
        said = {**_scaling_of(params, kinds[0]), "rope_theta": params.get("rope_theta")}
        read = {
            **_scaling_of(scaling, kinds[1]),
            "rope_theta": scaling.get("rope_theta", raw.get("rope_theta")),
        }
        if said != read:
            raise refuse(
                where,
                "rope_scaling",
                dict(scaling),
                f"a rope_scaling (and rope_theta) that say what rope_parameters says ({said}) "
                "when config.json has both, as transformers reads rope_scaling over "
                "rope_parameters; keep one",
            )
    if not present:
        return {}, "rope_scaling", "default"
    return present[0][0], present[0][1], kinds[0]


def read_rope(raw: Mapping[str, Any], where: str, within: str = "") -> dict[str, Any]:
    """config.json's rotary settings -> ModelConfig fields (rope_base, rope_scaling, ...)."""
    params, key, kind = rope_setting(raw, where, within)
    partial = params.get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0))
    if partial != 1.0:
        raise refuse(where, "partial_rotary_factor", partial, "1.0 (rotary on the whole head)")
    theta = params.get("rope_theta", raw.get("rope_theta", 10000.0))
    fields: dict[str, Any] = {
        "rope_base": get({"rope_theta": theta}, "rope_theta", where, float),
        "rope_scaling": "none",
    }
    if kind == "linear":
        fields["rope_scaling"] = "linear"
        fields["rope_scaling_factor"] = get(params, "factor", f"{where} ({key})", float)
    if kind == "llama3":
        fields["rope_scaling"] = "llama3"
        for hf_key, ours in _LLAMA3_KEYS.items():
            fields[ours] = get(params, hf_key, f"{where} ({key})", float)
        fields["rope_original_max_positions"] = get(
            params,
            "original_max_position_embeddings",
            f"{where} ({key})",
            int,
            raw.get("max_position_embeddings"),
        )
    return fields


def write_rope(cfg: ModelConfig, raw: Mapping[str, Any]) -> dict[str, Any]:
    """The rotary keys of config.json, in the style the source used (transformers 5's
    rope_parameters when it had them, else rope_theta/rope_scaling, which 4.x and 5.x read)."""
    scaling = None
    if cfg.rope_scaling == "llama3":
        scaling = {
            "rope_type": "llama3",
            "factor": cfg.rope_scaling_factor,
            "low_freq_factor": cfg.rope_low_freq_factor,
            "high_freq_factor": cfg.rope_high_freq_factor,
            "original_max_position_embeddings": cfg.rope_original_max_positions,
        }
    if cfg.rope_scaling == "linear":
        scaling = {"rope_type": "linear", "factor": cfg.rope_scaling_factor}
    if "rope_parameters" in raw:
        params = {"rope_type": "default", **(scaling or {}), "rope_theta": cfg.rope_base}
        return {"rope_parameters": params, "rope_theta": DROP, "rope_scaling": DROP}
    return {"rope_theta": cfg.rope_base, "rope_scaling": scaling, "rope_parameters": DROP}


LAYER_OPTIONS = {
    "global_every": 0,
    "local_rope_base": 0.0,
    "qk_norm": False,
    "norm_offset": 0.0,
    "post_norms": False,
    "scale_embeddings": False,
    "query_pre_attn_scalar": 0.0,
    "attn_softcap": 0.0,
    "logit_softcap": 0.0,
}
"ModelConfig options of the newer architectures, with the value that leaves them off."


def unexpressed(cfg: ModelConfig, allowed: tuple[str, ...] = ()) -> str | None:
    """The first of ``LAYER_OPTIONS`` that ``cfg`` turns on and an architecture lacks."""
    for field, off in LAYER_OPTIONS.items():
        if field not in allowed and getattr(cfg, field) != off:
            return f"model.{field}={getattr(cfg, field)!r} (it has no such option)"
    return None


class Converter(abc.ABC):
    """One Hugging Face architecture: config.json both ways and the tensor table."""

    architecture: str
    "The config.json ``architectures`` entry, e.g. 'LlamaForCausalLM'."
    model_type: str
    "The config.json ``model_type``, e.g. 'llama'."
    key_prefixes: tuple[Prefix, ...] = ()
    "Leading key components some exports drop or rename (tried when a key is missing as named)."
    ignored_prefixes: tuple[str, ...] = ()
    "Tensors a checkpoint may hold that this converter leaves out (a vision tower)."

    def text_config(self, raw: Mapping[str, Any], where: str) -> Mapping[str, Any]:
        """The part of config.json that describes the decoder (all of it, but for multimodal
        checkpoints, whose text part is read)."""
        return raw

    @abc.abstractmethod
    def model_config(self, raw: Mapping[str, Any], where: str) -> ModelConfig:
        """config.json -> ModelConfig (seq_len = the model's context length)."""

    @abc.abstractmethod
    def hf_config(self, cfg: ModelConfig, raw: Mapping[str, Any]) -> dict[str, Any]:
        """ModelConfig -> config.json, keeping ``raw``'s keys that we do not model."""

    @abc.abstractmethod
    def unsupported(self, cfg: ModelConfig) -> str | None:
        """Why ``cfg`` has no form in this architecture, or None."""

    @abc.abstractmethod
    def tensor_maps(self, cfg: ModelConfig) -> list[TensorMap]:
        """One row per zeroflow parameter."""


def merged(raw: Mapping[str, Any], updates: Mapping[str, Any]) -> dict[str, Any]:
    """``raw`` updated; keys set to ``DROP`` in ``updates`` are removed."""
    out = {k: v for k, v in raw.items() if k not in updates}
    out.update({k: v for k, v in updates.items() if v is not DROP})
    return out
