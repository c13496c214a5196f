"""CLIP's vision tower (``CLIPVisionModel``): a pre-norm ViT with a class token.

Published CLIP checkpoints name its tensors ``vision_model.*``; transformers 5 saves a
``CLIPVisionModel`` without the prefix. Both are read (``key_prefixes``).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from typing import Any

from zeroflow.hf.convert import get, refuse
from zeroflow.hf.encoder_convert import EncoderConverter, activation, block_fields
from zeroflow.hf.tensors import TensorMap, tensor_map
from zeroflow.models.encoders import VISION, EncoderConfig

_T = (1, 0)
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
"The normalisation CLIP's image processor applies (preprocessor_config.json's default)."


def norm_rows(ours: str, hf: str, size: int) -> list[TensorMap]:
    return [
        tensor_map(f"{ours}/scale", f"{hf}.weight", [[size]]),
        tensor_map(f"{ours}/bias", f"{hf}.bias", [[size]]),
    ]


def block_rows(cfg: EncoderConfig, names: Mapping[str, str]) -> list[TensorMap]:
    """The stacked block's rows; ``names`` gives the Hugging Face key of each sublayer
    (``query``, ``key``, ``value``, ``out``, ``fc1``, ``fc2``, ``norm1``, ``norm2``)."""
    e, h, d, m = cfg.hidden, cfg.num_heads, cfg.head_dim, cfg.mlp_dim
    rows = []
    for name in ("query", "key", "value"):
        # [heads * head_dim, embed] -> view [heads, head_dim, embed] -> [embed, heads, head_dim]
        rows += [
            tensor_map(
                f"layers/attn/{name}/kernel", f"{names[name]}.weight", [[h, d], [e]], (2, 0, 1)
            ),
            tensor_map(f"layers/attn/{name}/bias", f"{names[name]}.bias", [[h, d]]),
        ]
    rows += [
        tensor_map("layers/attn/out/kernel", f"{names['out']}.weight", [[e], [h, d]], (1, 2, 0)),
        tensor_map("layers/attn/out/bias", f"{names['out']}.bias", [[e]]),
    ]
    for name, out, inp in (("fc1", m, e), ("fc2", e, m)):
        rows += [
            tensor_map(f"layers/mlp/{name}/kernel", f"{names[name]}.weight", [[out], [inp]], _T),
            tensor_map(f"layers/mlp/{name}/bias", f"{names[name]}.bias", [[out]]),
        ]
    return (
        rows
        + norm_rows("layers/norm1", names["norm1"], e)
        + norm_rows("layers/norm2", names["norm2"], e)
    )


@dataclasses.dataclass(frozen=True)
class ClipVision(EncoderConverter):
    architecture: str = "CLIPVisionModel"
    model_type: str = "clip_vision_model"
    key_prefixes: tuple[str, ...] = ("vision_model.",)
    ignored: re.Pattern = re.compile(r"(^|\.)position_ids$")

    def encoder_config(self, raw: Mapping[str, Any], where: str) -> EncoderConfig:
        image, patch = get(raw, "image_size", where), get(raw, "patch_size", where)
        if image % patch:
            raise refuse(where, "patch_size", patch, f"a divisor of image_size={image}")
        return EncoderConfig(
            modality=VISION,
            activation=activation(raw, where, "quick_gelu"),
            norm_eps=get(raw, "layer_norm_eps", where, float, 1e-5),
            image_size=image,
            patch_size=patch,
            channels=get(raw, "num_channels", where, default=3),
            **block_fields(raw, where),
        )

    def tensor_maps(self, cfg: EncoderConfig) -> list[TensorMap]:
        e, c, p = cfg.hidden, cfg.channels, cfg.patch_size
        layer = "vision_model.encoder.layers.{i}"
        names = {n: f"{layer}.self_attn.{n[0]}_proj" for n in ("query", "key", "value")}
        names.update(
            out=f"{layer}.self_attn.out_proj",
            fc1=f"{layer}.mlp.fc1",
            fc2=f"{layer}.mlp.fc2",
            norm1=f"{layer}.layer_norm1",
            norm2=f"{layer}.layer_norm2",
        )
        return [
            # Conv2d weight [embed, channels, p, p] -> [channels, p, p, embed]
            tensor_map(
                "patch_embed",
                "vision_model.embeddings.patch_embedding.weight",
                [[e], [c], [p], [p]],
                (1, 2, 3, 0),
            ),
            tensor_map("class_embed", "vision_model.embeddings.class_embedding", [[e]]),
            tensor_map(
                "positions",
                "vision_model.embeddings.position_embedding.weight",
                [[cfg.num_patches + 1], [e]],
            ),
            *norm_rows("pre_norm", "vision_model.pre_layrnorm", e),
            *norm_rows("post_norm", "vision_model.post_layernorm", e),
            *block_rows(cfg, names),
        ]

    def preprocessing(self, raw: Mapping[str, Any]) -> dict[str, Any]:
        return {
            "image_size": raw.get("image_size"),
            "channels": raw.get("num_channels", 3),
            "mean": list(CLIP_MEAN),
            "std": list(CLIP_STD),
            "layout": "NCHW",
        }


CLIP_VISION = ClipVision()
