"""The trainer's checkpoints: Orbax CheckpointManager under ``run.dir/checkpoints``.

Uses the same portable format as ``zf.save_checkpoint`` so ``parallel.*`` and precision may
change between a run and its resume. Orbax writes each step to a temporary folder and renames
it when complete, and deletes old steps only after a newer one is finalised.

A step that cannot be read is never used and never silently kept as the latest: a resuming
run moves it aside (``checkpoints/200.corrupt``, with one warning line naming the damaged file)
and resumes from the newest readable step, so that step is written afresh when training gets
there again. Readers (export, sample) move nothing: they refuse an unreadable newest step
unless told which step to use. Nothing is created until the first save.

Runs on packed records also save where their data loader is (a Grain iterator, through
Grain's own Orbax handler: one small JSON file per process), and restore it with the state.
"""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp

from zeroflow.checkpoint import CheckpointError, checked_target, portable, rebuild_state
from zeroflow.state import TrainState
from zeroflow.trainer import damage

log = logging.getLogger("zeroflow")


LOADER = "loader"
"Checkpoint item holding the data loader's position (runs with a Grain loader)."
CORRUPT = ".corrupt"
"Suffix of a step folder moved aside because it could not be read."


class UnreadableCheckpoint(CheckpointError):
    """A step whose files are missing or damaged; ``reason`` names the file and the fault."""

    def __init__(self, step: int, reason: str):
        super().__init__(f"checkpoint step {step} is unreadable: {reason}")
        self.step, self.reason = step, reason


class RunCheckpoints:
    def __init__(self, directory: str | Path, keep: int, *, with_loader: bool = False,
                 read_only: bool = False):
        """``read_only``: for readers of a run (export, sample): nothing is created or moved."""
        self.directory = Path(directory).absolute()
        self.read_only = read_only
        options = ocp.CheckpointManagerOptions(max_to_keep=max(keep, 1), create=False,
                                               read_only=read_only, cleanup_tmp_directories=not read_only,
                                               enable_async_checkpointing=False)
        # Handlers named up front, so a fresh process can read item metadata before restoring.
        handlers = {"state": ocp.StandardCheckpointHandler(), "meta": ocp.JsonCheckpointHandler()}
        if with_loader:
            import grain
            handlers[LOADER] = grain.checkpoint.CheckpointHandler()
        self.manager = ocp.CheckpointManager(self.directory, options=options, item_handlers=handlers)
        self._written: set[int] = set()

    def steps(self) -> list[int]:
        return sorted(self.manager.all_steps())

    def save(self, step: int, state: TrainState, meta: dict[str, Any], loader=None) -> None:
        """``loader``: a Grain iterator whose position is saved with the state. A step this
        object already wrote is not written twice; one left by an earlier process is replaced
        (this run's state at that step is the one it resumed towards)."""
        if step in self._written:
            return
        if step in self.manager.all_steps():
            log.warning("replacing checkpoint step %d in %s with this run's", step, self.directory)
            self.manager.delete(step)
        items = dict(state=ocp.args.StandardSave(portable(state)), meta=ocp.args.JsonSave(meta))
        if loader is not None:
            import grain
            items[LOADER] = grain.checkpoint.CheckpointSave(loader)
        self.manager.save(step, args=ocp.args.Composite(**items), force=True)
        self.manager.wait_until_finished()
        self._written.add(step)

    def restore(self, step: int, like: TrainState, loader=None) -> tuple[TrainState, dict[str, Any]]:
        """Step ``step`` on ``like``'s layout. ``UnreadableCheckpoint`` when its files are
        missing or damaged; ``CheckpointError`` when it is readable but for another model."""
        if step not in self.manager.all_steps():
            raise CheckpointError(f"no checkpoint at step {step} in {self.directory} "
                                  f"(steps: {', '.join(map(str, self.steps())) or 'none'})")
        step_dir = self.directory / str(step)
        if problem := damage.missing_or_damaged(step_dir, self.directory):
            raise UnreadableCheckpoint(step, problem)
        damage.quiet_closed_loops()
        try:
            meta_tree = self.manager.item_metadata(step)["state"]
        except Exception as e:  # noqa: BLE001  orbax/tensorstore raise many types
            raise UnreadableCheckpoint(step, damage.describe(e, step_dir, self.directory)) from None
        meta_tree = getattr(meta_tree, "tree", meta_tree)
        target = checked_target(like, meta_tree, f"{self.directory}/{step}")
        items = dict(state=ocp.args.StandardRestore(target, strict=False),
                     meta=ocp.args.JsonRestore())
        if loader is not None:
            if not (step_dir / LOADER).is_dir():
                raise CheckpointError(f"{step_dir} has no data loader position "
                                      "(saved by a run on a token stream?)")
            import grain
            items[LOADER] = grain.checkpoint.CheckpointRestore(loader)
        try:
            restored = self.manager.restore(step, args=ocp.args.Composite(**items))
        except Exception as e:  # noqa: BLE001
            raise UnreadableCheckpoint(step, damage.describe(e, step_dir, self.directory)) from None
        return rebuild_state(restored["state"], like), dict(restored["meta"])

    def restore_latest(self, like: TrainState, loader=None
                       ) -> tuple[TrainState, dict[str, Any]] | None:
        """The newest readable checkpoint on ``like``'s layout, or None when there is none.
        Newer unreadable steps are moved aside, each with a warning. When no step is
        readable nothing is moved and ``CheckpointError`` says what to do.
        ``loader`` (a Grain iterator) is moved to the position saved with it."""
        bad: list[UnreadableCheckpoint] = []
        for step in reversed(self.steps()):
            try:
                restored = self.restore(step, like, loader)
            except UnreadableCheckpoint as e:
                bad.append(e)
                continue
            for e in bad:
                moved = self.move_aside(e.step)
                log.warning("%s; moved it to %s, resuming from step %d", e, damage.shown(
                    moved, self.directory), step)
            return restored
        if bad:
            raise CheckpointError(self.none_readable(bad) + "; to train this run from scratch "
                                  f"move that folder away (mv {self.directory} "
                                  f"{self.directory}.bad) or give another run.dir")
        return None

    def read(self, like: TrainState, step: int | None = None) -> tuple[TrainState, dict[str, Any]]:
        """For readers of a finished or running run: step ``step``, or the newest one, which
        must be readable (an older one is never used in its place without being asked)."""
        steps = self.steps()
        if not steps:
            raise FileNotFoundError(f"no checkpoint in {self.directory}: train the run first")
        if step is not None:
            return self.restore(step, like)
        try:
            return self.restore(steps[-1], like)
        except UnreadableCheckpoint as newest:
            bad = [newest]
            for older in reversed(steps[:-1]):
                try:
                    self.restore(older, like)
                except UnreadableCheckpoint as e:
                    bad.append(e)
                    continue
                raise CheckpointError(
                    f"the newest checkpoint in {self.directory} is unreadable: step "
                    f"{newest.step}: {newest.reason}; pass --step {older} to use the newest "
                    f"readable one, or resume training (it moves step {newest.step} aside and "
                    "saves it again)") from None
            raise CheckpointError(self.none_readable(bad) + "; copy the steps again if they came "
                                  "from elsewhere, or train the run again") from None

    def none_readable(self, bad: list[UnreadableCheckpoint]) -> str:
        return (f"no readable checkpoint in {self.directory}: "
                + "; ".join(f"step {e.step}: {e.reason}" for e in sorted(bad, key=lambda e: e.step)))

    def move_aside(self, step: int) -> Path:
        """Rename an unreadable step to ``<step>.corrupt`` (``.corrupt-2``, ... if taken)."""
        target = self.directory / f"{step}{CORRUPT}"
        n = 1
        while target.exists():
            n += 1
            target = self.directory / f"{step}{CORRUPT}-{n}"
        if jax.process_index() == 0:
            (self.directory / str(step)).rename(target)
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils
            multihost_utils.sync_global_devices(f"zeroflow: moved step {step} aside")
        self.manager.reload()
        return target

    def close(self) -> None:
        self.manager.close()
