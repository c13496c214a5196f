"""What makes a training step diverge, and the run's health record.

A step diverges when
- its loss is not finite;
- its gradients are not finite and no dynamic loss scale explains it (the update was skipped);
- a dynamic loss scale skipped ``precision.max_consecutive_skips`` updates in a row;
- its loss exceeds ``train.spike_factor`` times the median of the last ``train.spike_window``
  losses (once ``MIN_HISTORY`` of them are known);
- its gradient norm (before clipping) exceeds ``train.max_grad_norm``.

The loss a step reports is the loss of the weights *before* its update: the weights saved at
step ``s`` are first tried by step ``s + 1``. So a checkpoint is healthy when every step up to
and including the one after it was clean, and a divergence first seen at step ``f`` condemns the
checkpoint at ``f - 1`` (its weights gave the diverging loss) and leaves those up to ``f - 2``
healthy (``rollback_target``). Every checkpoint is saved after the steps before it were checked;
the verdict of the step after it comes once the checkpoint is written, and a condemned one is
moved aside (``checkpoints/<step>.diverged``), which is what makes the verdict last.

``Health`` is what the detection and the recovery carry from step to step (the recent losses,
the rollbacks so far, the learning-rate factor they set, how far the data has been moved on);
it is saved in every checkpoint's ``meta`` so a resumed run judges and recovers exactly as the
uninterrupted one would have.
"""

from __future__ import annotations

import dataclasses
import math
import statistics

from zeroflow.autocast.precision import Precision
from zeroflow.config.schema import TrainConfig

MIN_HISTORY = 3
"Losses the running median needs before a spike is judged (the first steps are not judged)."
META_KEY = "health"
"Key of a checkpoint's ``meta`` holding its ``Health``."


@dataclasses.dataclass(frozen=True)
class Health:
    recent_losses: tuple[float, ...] = ()
    "The last ``train.spike_window`` finite training losses, oldest first."
    rollbacks: int = 0
    "Rollbacks the run has made to reach this point."
    lr_factor: float = 1.0
    "What the rollbacks multiplied the learning-rate schedule by."
    data_offset: int = 0
    "Training batches skipped so far: step ``s`` (0-based) trains on batch ``s + data_offset``."

    def after(self, loss: float, window: int) -> Health:
        """This record with a clean step's ``loss`` added to the recent losses."""
        kept = (*self.recent_losses, float(loss))[-window:] if window > 0 else ()
        return dataclasses.replace(self, recent_losses=kept)

    def to_meta(self) -> dict:
        return {META_KEY: {**dataclasses.asdict(self), "recent_losses": list(self.recent_losses)}}

    @classmethod
    def from_meta(cls, meta: dict) -> Health:
        """The record in a checkpoint's ``meta``; a fresh one for checkpoints saved without."""
        saved = meta.get(META_KEY)
        if not isinstance(saved, dict):
            return cls()
        return cls(
            recent_losses=tuple(float(x) for x in saved.get("recent_losses", ())),
            rollbacks=int(saved.get("rollbacks", 0)),
            lr_factor=float(saved.get("lr_factor", 1.0)),
            data_offset=int(saved.get("data_offset", 0)),
        )


@dataclasses.dataclass(frozen=True)
class Divergence:
    step: int
    "The step whose metrics showed it (1-based)."
    first_bad: int
    "The first step of the trouble (earlier than ``step`` for a run of skipped updates)."
    reason: str
    "What went wrong, naming the setting that judged it."
    hint: str
    "What a person might change."
    loss: float
    grad_norm: float


class TrainingDiverged(RuntimeError):
    """A divergence the run stopped on: ``train.on_divergence=stop``, or no rollback left."""


class Diverged(Exception):
    """Raised inside the training loop; the loop stops or rolls back (``train.on_divergence``)."""

    def __init__(self, divergence: Divergence):
        super().__init__(divergence.reason)
        self.divergence = divergence


LOWER_LR = "Try a lower train.lr or precision.params=bf16/fp32"


def diagnose(
    step: int, m: dict[str, float], health: Health, train: TrainConfig, prec: Precision
) -> Divergence | None:
    """The divergence the metrics ``m`` of ``step`` show, or None when the step is clean."""
    loss, grad_norm = m["loss"], m["grad_norm"]

    def found(reason: str, hint: str = LOWER_LR, first_bad: int = step) -> Divergence:
        return Divergence(step, first_bad, reason, hint, loss, grad_norm)

    if not math.isfinite(loss):
        return found(
            f"loss is {loss} (the forward pass itself is non-finite, which loss scaling cannot "
            "cause)"
        )
    if m["skipped"] and not prec.dynamic:
        return found(
            f"non-finite gradients with finite loss {loss:.4g} and no dynamic loss scaling "
            f"(precision.loss_scale={prec.loss_scale}); the update was skipped"
        )
    skips = int(m["consecutive_skips"])
    if skips >= prec.max_consecutive_skips:
        return found(
            f"{skips} steps in a row skipped for non-finite gradients "
            f"(precision.max_consecutive_skips={prec.max_consecutive_skips}); the loss scale is "
            f"{m['loss_scale']:g} (precision.min_scale={prec.min_scale:g}) and the gradients "
            "are still non-finite",
            hint="Try precision.params=bf16 or a lower train.lr",
            first_bad=step - skips + 1,
        )
    return _spike(found, loss, grad_norm, bool(m["skipped"]), health, train)


def _spike(found, loss: float, grad_norm: float, skipped: bool, health: Health, train):
    """A loss far above the recent median, or a gradient norm above the bound (a skipped
    update's norm is the loss scale's overflow, not the model's)."""
    recent = health.recent_losses[-train.spike_window :]  # the window may have shrunk on resume
    if train.spike_factor > 0 and len(recent) >= MIN_HISTORY:
        median = statistics.median(recent)
        if loss > train.spike_factor * median:
            return found(
                f"loss {loss:.4g} is over train.spike_factor={train.spike_factor:g} times the "
                f"median {median:.4g} of the last {len(recent)} losses",
                hint="Try a lower train.lr, or a higher train.spike_factor if such spikes are "
                "expected",
            )
    if train.max_grad_norm > 0 and not skipped and grad_norm > train.max_grad_norm:
        return found(
            f"gradient norm {grad_norm:.4g} exceeds train.max_grad_norm={train.max_grad_norm:g}",
            hint="Try a lower train.lr, or a higher train.max_grad_norm if such norms are expected",
        )
    return None


def rollback_target(steps: list[int], first_bad: int) -> int:
    """The newest healthy checkpoint among ``steps`` for a divergence whose first bad step is
    ``first_bad``: the newest at or before ``first_bad - 2``; 0 (the initial state) when none."""
    return max((s for s in steps if s <= first_bad - 2), default=0)


class Monitor:
    """Judges each finished step of a run in order; ``health`` is the record after the last
    clean one (what a checkpoint saved now carries)."""

    def __init__(self, health: Health, train: TrainConfig, prec: Precision):
        self.health, self.train, self.prec = health, train, prec

    def check(self, step: int, m: dict[str, float]) -> None:
        """Raise ``Diverged`` for a diverging step; otherwise add its loss to the record."""
        found = diagnose(step, m, self.health, self.train, self.prec)
        if found is not None:
            raise Diverged(found)
        self.health = self.health.after(m["loss"], self.train.spike_window)
