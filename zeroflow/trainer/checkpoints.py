"""The trainer's checkpoints: Orbax CheckpointManager under ``run.dir/checkpoints``.

Uses the same portable format as ``zf.save_checkpoint`` so ``parallel.*`` and precision may
change between a run and its resume. Orbax writes each step to a temporary folder and renames
it when complete, and deletes old steps only after a newer one is finalised. A latest
checkpoint that cannot be read falls back to the one before it, with a warning.

Runs on packed records also save where their data loader is (a Grain iterator, through
Grain's own Orbax handler: one small JSON file per process), and restore it with the state.
"""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import orbax.checkpoint as ocp

from zeroflow.checkpoint import CheckpointError, checked_target, portable, rebuild_state
from zeroflow.state import TrainState

log = logging.getLogger("zeroflow")


LOADER = "loader"
"Checkpoint item holding the data loader's position (runs with a Grain loader)."


class RunCheckpoints:
    def __init__(self, directory: str | Path, keep: int, *, with_loader: bool = False):
        self.directory = Path(directory).absolute()
        options = ocp.CheckpointManagerOptions(max_to_keep=max(keep, 1), create=True,
                                               enable_async_checkpointing=False)
        # Handlers named up front, so a fresh process can read item metadata before restoring.
        handlers = {"state": ocp.StandardCheckpointHandler(), "meta": ocp.JsonCheckpointHandler()}
        if with_loader:
            import grain
            handlers[LOADER] = grain.checkpoint.CheckpointHandler()
        self.manager = ocp.CheckpointManager(self.directory, options=options, item_handlers=handlers)

    def steps(self) -> list[int]:
        return sorted(self.manager.all_steps())

    def save(self, step: int, state: TrainState, meta: dict[str, Any], loader=None) -> None:
        """``loader``: a Grain iterator whose position is saved with the state."""
        if step in self.manager.all_steps():
            return
        items = dict(state=ocp.args.StandardSave(portable(state)), meta=ocp.args.JsonSave(meta))
        if loader is not None:
            import grain
            items[LOADER] = grain.checkpoint.CheckpointSave(loader)
        self.manager.save(step, args=ocp.args.Composite(**items), force=True)
        self.manager.wait_until_finished()

    def _restore_step(self, step: int, like: TrainState, loader=None):
        meta_tree = self.manager.item_metadata(step)["state"]
        meta_tree = getattr(meta_tree, "tree", meta_tree)
        target = checked_target(like, meta_tree, f"{self.directory}/{step}")
        items = dict(state=ocp.args.StandardRestore(target, strict=False),
                     meta=ocp.args.JsonRestore())
        if loader is not None:
            if not (self.directory / str(step) / LOADER).is_dir():
                raise CheckpointError(f"{self.directory}/{step} has no data loader position "
                                      "(saved by a run on a token stream?)")
            import grain
            items[LOADER] = grain.checkpoint.CheckpointRestore(loader)
        restored = self.manager.restore(step, args=ocp.args.Composite(**items))
        return rebuild_state(restored["state"], like), dict(restored["meta"])

    def restore_latest(self, like: TrainState, loader=None
                       ) -> tuple[TrainState, dict[str, Any]] | None:
        """The newest readable checkpoint on ``like``'s layout, or None when there is none.
        ``loader`` (a Grain iterator) is moved to the position saved with it."""
        steps = self.steps()
        for i, step in enumerate(reversed(steps)):
            try:
                return self._restore_step(step, like, loader)
            except CheckpointError:
                raise  # readable but for another model: falling back would silently mix runs
            except Exception as e:  # noqa: BLE001  orbax/tensorstore raise many types
                older = steps[-i - 2] if i + 1 < len(steps) else None
                reason = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:200]
                log.warning("checkpoint step %d in %s is unreadable (%s); %s", step, self.directory,
                            reason, f"falling back to step {older}" if older is not None else "no older one")
        if steps:
            raise CheckpointError(f"no readable checkpoint in {self.directory} (steps {steps})")
        return None

    def close(self) -> None:
        self.manager.close()
