"""What a run does when a step diverges (``zeroflow.trainer.divergence``): stop, or roll back.

Either way the checkpoints the divergence condemns (the one whose weights gave the diverging
step, and any later) are moved aside as ``checkpoints/<step>.diverged``, so that neither the
message nor a resume ever points at them.

A rollback (``train.on_divergence=rollback``) restores the newest healthy checkpoint (or the
initial state when none is left), moves the data on past every batch the run had drawn when
it diverged (the token streams' batch index, or the packed records' Grain loader, restored
with the checkpoint and then advanced), multiplies the learning-rate schedule by
``train.rollback_lr_factor``, and trains on. What it did is the run's ``Health`` (saved in the
next checkpoint's meta) and a ``metrics.jsonl`` row. Everything it does follows from the
restored checkpoint and the steps trained since, so a run killed in the middle of a recovery
and resumed makes the same rollback again and ends where the uninterrupted run ends.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import Any

from zeroflow.engine.state import TrainState
from zeroflow.trainer import damage
from zeroflow.trainer.checkpoints import DIVERGED, RunCheckpoints, UnreadableCheckpoint
from zeroflow.trainer.divergence import Divergence, Health, TrainingDiverged, rollback_target
from zeroflow.trainer.reporting import Reporter
from zeroflow.trainer.setup import Run

log = logging.getLogger("zeroflow")


@dataclasses.dataclass
class Position:
    """Where a run is: its (possibly rebuilt) run, state, health record and data loader."""

    run: Run
    state: TrainState | None
    health: Health
    loader: Any = None
    "The packed records' Grain iterator (None for token streams)."


def recover(
    found: Divergence,
    at: Position,
    checkpoints: RunCheckpoints,
    reporter: Reporter,
    fresh_loader: Callable[[], Any],
) -> Position:
    """The position to train on from after ``found``, or ``TrainingDiverged`` (one line naming
    the newest healthy checkpoint) when the run stops. ``at.state`` is dropped before the
    restore, so the diverged and the restored state are never in memory together.
    ``fresh_loader()``: the data loader at its start, for a rollback to the initial state."""
    train = at.run.cfg.train
    target = rollback_target(checkpoints.steps(), found.first_bad)
    condemned = [s for s in checkpoints.steps() if s > target]
    moved = [checkpoints.move_aside(s, DIVERGED) for s in condemned]
    healthy = f"step {target} in {checkpoints.directory}" if target else "none"
    aside = "".join(
        f" (step {s}, whose weights gave this step, moved to "
        f"{damage.shown(path, checkpoints.directory)})"
        for s, path in zip(condemned, moved)
    )
    if train.on_divergence == "stop" or at.health.rollbacks >= train.max_rollbacks:
        action = (
            "stopped without saving (train.on_divergence=stop)"
            if train.on_divergence == "stop"
            else f"gave up after {at.health.rollbacks} rollback"
            f"{'' if at.health.rollbacks == 1 else 's'} "
            f"(train.max_rollbacks={train.max_rollbacks})"
        )
        raise TrainingDiverged(
            f"step {found.step}: {found.reason}; {action}. Newest healthy checkpoint: "
            f"{healthy}{aside}. {found.hint}"
        )
    return _roll_back(found, at, target, checkpoints, reporter, fresh_loader)


def _roll_back(
    found: Divergence,
    at: Position,
    target: int,
    checkpoints: RunCheckpoints,
    reporter: Reporter,
    fresh_loader: Callable[[], Any],
) -> Position:
    run = at.run.with_lr_factor(at.health.lr_factor * at.run.cfg.train.rollback_lr_factor)
    at.state = None
    target, restored = _restore_healthy(run, target, checkpoints, at.loader)
    if restored is not None:
        loader, (state, meta) = at.loader, restored
        saved = Health.from_meta(meta)
    else:
        loader = fresh_loader()
        state, saved = run.init_state(), Health()
    # Step s (0-based) draws batch s + data_offset: the diverged step drew the one before
    # ``reached``, and the restored step's next batch is ``target + saved.data_offset``.
    reached = found.step + at.health.data_offset
    skipped = reached - (target + saved.data_offset)
    if loader is not None:
        for _ in range(skipped):
            next(loader)
    health = dataclasses.replace(
        saved,
        rollbacks=at.health.rollbacks + 1,
        lr_factor=run.lr_factor,
        data_offset=reached - target,
    )
    reporter.rollback(
        target,
        {
            "rollback": health.rollbacks,
            "from_step": found.step,
            "to_step": target,
            "batches_skipped": skipped,
            "lr_factor": health.lr_factor,
            "loss": found.loss,
            "grad_norm": found.grad_norm,
            "reason": found.reason,
        },
    )
    lowered = f", learning rate x{health.lr_factor:g}" if health.lr_factor != 1 else ""
    reporter.print(
        f"step {found.step}: {found.reason}; rolled back to step {target}"
        f"{' (the initial state)' if target == 0 else ''} (rollback "
        f"{health.rollbacks} of at most {run.cfg.train.max_rollbacks}), skipping {skipped} "
        f"batches{lowered}"
    )
    return Position(run=run, state=state, health=health, loader=loader)


def _restore_healthy(run: Run, newest: int, checkpoints: RunCheckpoints, loader):
    """``(step, (state, meta))`` of the newest readable checkpoint at or before ``newest``
    (an unreadable one is moved aside with a warning, as a resume does), or ``(0, None)``
    when none is left: the run goes back to its initial state."""
    for step in reversed([s for s in checkpoints.steps() if s <= newest]):
        try:
            return step, checkpoints.restore(step, run.abstract_state(), loader)
        except UnreadableCheckpoint as e:
            moved = checkpoints.move_aside(e.step)
            log.warning("%s; moved it to %s", e, damage.shown(moved, checkpoints.directory))
    return 0, None
