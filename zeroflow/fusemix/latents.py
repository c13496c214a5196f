"""The run's latents: the paired dataset encoded once by each frozen encoder into the cache
(``zeroflow.fusemix.cache``), with everything that decides the latents recorded."""

from __future__ import annotations

import hashlib
from pathlib import Path

import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from zeroflow import hf
from zeroflow.config.schema import Config
from zeroflow.fusemix import cache, digits
from zeroflow.fusemix.model import IMAGE, TEXT
from zeroflow.models.encoders import mean_pool


def cache_folder(cfg: Config) -> Path:
    return Path(cfg.fusemix.cache or Path(cfg.run.dir) / "latents")


def _identity(
    enc: hf.HFEncoder, preprocessing: dict, pooling: str, cfg: Config, pairs: digits.Pairs
) -> dict:
    return {
        "encoder": {"architecture": enc.architecture, "sha256": enc.identity},
        "preprocessing": preprocessing,
        "pooling": pooling,
        "dtype": cfg.fusemix.encode_dtype,
        "dataset": {"name": pairs.name, "rows": len(pairs.captions), "sha256": pairs.digest},
    }


def image_latents(cfg: Config, pairs: digits.Pairs, mesh, progress: bool) -> np.ndarray:
    """The image encoder's pooled output (or mean hidden state) of every image ([N, hidden]
    float32 memmap)."""
    fm = cfg.fusemix
    module, params, enc = hf.load_encoder(
        fm.image_encoder, fm.encode_dtype, shardings=NamedSharding(mesh, P())
    )
    pre = {**enc.preprocessing, "resize": "nearest", "grey": "every channel"}
    pixels = digits.image_inputs(
        pairs.images, pre["image_size"], pre["mean"], pre["std"], pre["channels"]
    )

    def encode(p, batch):
        out = module.apply({"params": p}, batch["pixel_values"])
        pooled = out["hidden"].mean(1) if fm.image_pooling == "mean" else out["pooled"]
        return pooled.astype(jnp.float32)

    return cache.encode_to_cache(
        cache_folder(cfg) / IMAGE,
        _identity(enc, pre, fm.image_pooling, cfg, pairs),
        encode,
        params,
        {"pixel_values": pixels},
        enc.encoder.hidden,
        batch_size=fm.encode_batch,
        mesh=mesh,
        label="image latents",
        progress=progress,
    )


def text_latents(cfg: Config, pairs: digits.Pairs, mesh, progress: bool) -> np.ndarray:
    """The text encoder's [CLS] state or token mean of every caption ([N, hidden] float32)."""
    fm = cfg.fusemix
    module, params, enc = hf.load_encoder(
        fm.text_encoder, fm.encode_dtype, shardings=NamedSharding(mesh, P())
    )
    tokenizer = hf.load_tokenizer(fm.text_encoder)
    ids, mask = digits.text_inputs(
        pairs.captions, tokenizer, fm.max_text_len, int(enc.raw.get("pad_token_id") or 0)
    )
    pre = {
        **enc.preprocessing,
        "max_text_len": fm.max_text_len,
        "tokenizer_sha256": hashlib.sha256(Path(tokenizer.name).read_bytes()).hexdigest(),
    }

    def encode(p, batch):
        hidden = module.apply({"params": p}, batch["input_ids"], batch["attention_mask"])["hidden"]
        if fm.text_pooling == "mean":
            return mean_pool(hidden, batch["attention_mask"]).astype(jnp.float32)
        return hidden[:, 0].astype(jnp.float32)

    return cache.encode_to_cache(
        cache_folder(cfg) / TEXT,
        _identity(enc, pre, fm.text_pooling, cfg, pairs),
        encode,
        params,
        {"input_ids": ids, "attention_mask": mask},
        enc.encoder.hidden,
        batch_size=fm.encode_batch,
        mesh=mesh,
        label="text latents",
        progress=progress,
    )
