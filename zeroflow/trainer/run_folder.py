"""What a run folder already holds, checked before a run writes anything to it.

A run folder (``run.dir``) belongs to one model: its checkpoints only load into that model, and
``sample`` / ``export`` read its ``config.yaml`` to rebuild it. A run started in the folder with
another model stops here, with one line, before the folder is changed. The settings that may
change between a run and its resume (``parallel.*``, precision, ``train.*``, the run-time model
fields) are not compared; a changed learning-rate schedule is announced.
"""
from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

from zeroflow.config import Config
from zeroflow.config_io import ConfigError, load_config
from zeroflow.trainer.optim import lr_schedule

log = logging.getLogger("zeroflow")

CONFIG_FILE = "config.yaml"
RESUMABLE_MODEL_FIELDS = ("seq_len", "remat", "attention", "dropout", "lora.dropout")
"Model fields a resume may change: they do not change the parameters."
SCHEDULE_FIELDS = ("steps", "lr", "warmup_steps", "min_lr_ratio")


def previous_config(run_dir: Path) -> Config | None:
    """The config the folder's last run wrote, or None for a new folder."""
    path = run_dir / CONFIG_FILE
    if not path.exists():
        return None
    try:
        return load_config(path)
    except ConfigError as e:
        raise ConfigError(f"{path} (written by the run already in this folder) cannot be read: "
                          f"{e}; restore it, or give another run.dir") from None


def model_differences(previous: Config, cfg: Config) -> list[str]:
    """``"model.embed_dim is 128 there, 64 here"`` for each field that makes another model."""
    out = [f"model.{key} is {old!r} there, {new!r} here"
           for key, old, new in _field_pairs(previous.model, cfg.model)
           if key not in RESUMABLE_MODEL_FIELDS and old != new]
    if previous.data.tokenizer != cfg.data.tokenizer:
        out.append(f"data.tokenizer is {previous.data.tokenizer!r} there, "
                   f"{cfg.data.tokenizer!r} here")
    return out


def _field_pairs(old, new, prefix: str = ""):
    """``(dotted name, old value, new value)`` of every field, nested sections entered."""
    for f in dataclasses.fields(new):
        a, b = getattr(old, f.name), getattr(new, f.name)
        if dataclasses.is_dataclass(b):
            yield from _field_pairs(a, b, f"{prefix}{f.name}.")
        else:
            yield f"{prefix}{f.name}", a, b


def check_same_model(run_dir: Path, previous: Config | None, cfg: Config) -> None:
    """ConfigError (one line) when ``cfg`` describes another model than the folder's run."""
    if previous is None:
        return
    differences = model_differences(previous, cfg)
    if differences:
        more = f" (+{len(differences) - 1} more)" if len(differences) > 1 else ""
        raise ConfigError(f"{run_dir} holds a run of another model: {differences[0]}{more}; "
                          "resume it with its own settings (see its config.yaml), or give "
                          "another run.dir")


def announce_schedule_change(previous: Config | None, cfg: Config, applied: int) -> None:
    """One warning when a resume changes the learning rate the next update gets: raising
    ``train.steps`` stretches the cosine decay to the new length (the chosen behaviour: the
    schedule is always the configured one, so a resumed run equals a run started with it)."""
    if previous is None or applied <= 0:
        return
    changed = [k for k in SCHEDULE_FIELDS if getattr(previous.train, k) != getattr(cfg.train, k)]
    if not changed:
        return
    old, new = float(lr_schedule(previous.train)(applied)), float(lr_schedule(cfg.train)(applied))
    if abs(new - old) <= 1e-6 * max(abs(old), abs(new), 1e-30):
        return
    what = ", ".join(f"train.{k} {getattr(previous.train, k)} -> {getattr(cfg.train, k)}"
                     for k in changed)
    log.warning("%s: the learning-rate schedule follows the new settings, so the rate after "
                "update %d changes from %.2e to %.2e", what, applied, old, new)
