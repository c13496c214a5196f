"""The table of supported architectures and how a config.json picks one."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

from zeroflow.config.schema import ModelConfig
from zeroflow.hf.convert import RUNTIME_FIELDS, Converter, HFConfig
from zeroflow.hf.gemma import GEMMA2, GEMMA3, GEMMA3_MULTIMODAL
from zeroflow.hf.gpt2 import GPT2
from zeroflow.hf.llama import LLAMA, MISTRAL, QWEN2, QWEN3
from zeroflow.hf.phi3 import PHI3
from zeroflow.hf.reader import HFCheckpointError

CONFIG_FILE = "config.json"
CONVERTERS: dict[str, Converter] = {
    c.architecture: c for c in (LLAMA, MISTRAL, QWEN2, QWEN3, PHI3, GEMMA2, GEMMA3, GPT2)
}
"Architecture name (config.json ``architectures[0]``) -> converter."
READ_ONLY: dict[str, Converter] = {"Gemma3ForConditionalGeneration": GEMMA3}
"Architectures read through another's converter (their text decoder), and saved as that one."
_BY_MODEL_TYPE = {c.model_type: c for c in CONVERTERS.values()}
_BY_MODEL_TYPE[GEMMA3_MULTIMODAL] = GEMMA3


def _supported() -> str:
    return ", ".join([*CONVERTERS, *READ_ONLY])


MOE_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_intermediate_size")
"config.json keys that only mixture-of-experts configs carry."


def _why_not(name: str, raw: dict) -> str:
    """What kind of model an unsupported architecture is, when it is one we know we lack."""
    if "moe" in name.lower() or "mixtral" in name.lower() or any(k in raw for k in MOE_KEYS):
        return (
            ": mixture-of-experts layers are not implemented (zeroflow's GPT has one dense MLP "
            "per layer)"
        )
    if "vision_config" in raw or name.endswith("ForConditionalGeneration"):
        return (
            ": a vision-language model (of those only Gemma3ForConditionalGeneration is read, "
            "its text decoder)"
        )
    return ""


def converter_for(raw: dict, where: str) -> Converter:
    """The converter config.json names (``architectures``, else ``model_type``)."""
    names = raw.get("architectures") or []
    if names:
        converter = CONVERTERS.get(names[0]) or READ_ONLY.get(names[0])
        if converter is None:
            raise HFCheckpointError(
                f"{where}: config.json architectures[0]={names[0]!r} is not supported"
                f"{_why_not(names[0], raw)}; supported: {_supported()}"
            )
        return converter
    model_type = raw.get("model_type")
    if model_type not in _BY_MODEL_TYPE:
        raise HFCheckpointError(
            f"{where}: config.json names no supported architecture (architectures={names}, "
            f"model_type={model_type!r}){_why_not(str(model_type), raw)}; "
            f"supported: {_supported()}"
        )
    return _BY_MODEL_TYPE[model_type]


def config_file(path: str | os.PathLike) -> Path:
    path = Path(path)
    file = path / CONFIG_FILE if path.is_dir() else path
    if not file.is_file():
        raise HFCheckpointError(
            f"no Hugging Face config at {os.fspath(path)!r} (expected a folder "
            f"holding {CONFIG_FILE}, or the file itself)"
        )
    return file


def read_config(path: str | os.PathLike) -> HFConfig:
    """A checkpoint folder's (or a config.json file's) architecture and ModelConfig."""
    file = config_file(path)
    try:
        raw = json.loads(file.read_text())
    except (OSError, ValueError) as e:
        raise HFCheckpointError(f"cannot read {file}: {e}") from None
    if not isinstance(raw, dict):
        raise HFCheckpointError(f"{file} does not hold a JSON object")
    converter = converter_for(raw, os.fspath(file))
    raw = converter.text_config(raw, os.fspath(file))
    return HFConfig(converter.architecture, converter.model_config(raw, os.fspath(file)), raw)


def converter_for_model(cfg: ModelConfig) -> Converter:
    """The first architecture that can express ``cfg`` (to export a model trained from
    scratch): Llama for zeroflow's default GPT, GPT-2 for a learned-position LayerNorm one."""
    reasons = []
    for converter in CONVERTERS.values():
        reason = converter.unsupported(cfg)
        if reason is None:
            return converter
        reasons.append(f"{converter.architecture}: {reason}")
    raise HFCheckpointError(
        "no Hugging Face architecture fits this model (" + "; ".join(reasons) + ")"
    )


def with_run_fields(architecture: ModelConfig, run: ModelConfig) -> ModelConfig:
    """A checkpoint's architecture with the run's own choices (``RUNTIME_FIELDS``)."""
    cfg = dataclasses.replace(architecture, **{f: getattr(run, f) for f in RUNTIME_FIELDS})
    if cfg.positions == "learned" and cfg.seq_len > cfg.max_positions:
        raise HFCheckpointError(
            f"model.seq_len={cfg.seq_len} is longer than the "
            f"{cfg.max_positions} learned positions of {run.init_from}"
        )
    return cfg
