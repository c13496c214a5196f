"""The trainer's optimizer: warmup + cosine schedule, AdamW (moments in fp32, 8 bits or bf16:
``train.optimizer``) with decay masked off norms and biases, global-norm clipping. All optax."""

from __future__ import annotations

import optax

from zeroflow import optim
from zeroflow.config.schema import TrainConfig

ADAMW = {"adamw": optax.adamw, "adamw_8bit": optim.adamw_8bit, "adamw_bf16": optim.adamw_bf16}
"``train.optimizer`` -> the AdamW factory (the same arguments as ``optax.adamw``)."


def lr_schedule(cfg: TrainConfig, factor: float = 1.0) -> optax.Schedule:
    """The configured schedule, times ``factor`` (what a run's rollbacks lowered it by)."""
    warmup = min(cfg.warmup_steps, max(cfg.steps - 1, 0))
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0,
        peak_value=cfg.lr * factor,
        warmup_steps=warmup,
        decay_steps=max(cfg.steps, warmup + 1),
        end_value=cfg.lr * factor * cfg.min_lr_ratio,
    )


def make_optimizer(
    cfg: TrainConfig, decay_mask, lr_factor: float = 1.0
) -> optax.GradientTransformation:
    """``decay_mask``: pytree of bools (or a function of params) where weight decay applies;
    ``lr_factor`` scales the learning-rate schedule. The optimizer state's structure does not
    depend on it, so a checkpoint restores under any factor."""
    parts = [optax.clip_by_global_norm(cfg.grad_clip)] if cfg.grad_clip > 0 else []
    schedule = lr_schedule(cfg, lr_factor)
    parts.append(
        ADAMW[cfg.optimizer](
            schedule, b1=cfg.b1, b2=cfg.b2, weight_decay=cfg.weight_decay, mask=decay_mask
        )
    )
    return optax.chain(*parts)
