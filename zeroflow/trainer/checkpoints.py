"""The trainer's checkpoints: Orbax CheckpointManager under ``run.dir/checkpoints``.

Uses the same portable format as ``zf.save_checkpoint`` so ``parallel.*`` and precision may
change between a run and its resume. Orbax writes each step to a temporary folder and renames
it when complete, and deletes old steps only after a newer one is finalised.

A step that cannot be read is never used and never silently kept as the latest: a resuming
run moves it aside (``checkpoints/200.corrupt``, with one warning line naming the damaged file)
and resumes from the newest readable step, so that step is written afresh when training gets
there again. Readers (export, sample) move nothing: they refuse an unreadable newest step
unless told which step to use. Nothing is created until the first save.

Every step also gets its digests (``zeroflow.engine.checkpoint_digests``: size and SHA-256 of each
file, written last and atomically) and its ``meta`` says so; a restore or a reader checks them
before reading, and a step whose files are not what was saved (one flipped bit is enough) is
treated exactly as an unreadable one. Steps saved before digests existed load, said to be
unverified.

Runs on packed records also save where their data loader is (a Grain iterator, through
Grain's own Orbax handler: one small JSON file per process), and restore it with the state.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp

from zeroflow.engine import checkpoint_digests
from zeroflow.engine.checkpoint import CheckpointError, checked_target, portable, rebuild_state
from zeroflow.engine.state import TrainState
from zeroflow.trainer import damage, retention
from zeroflow.trainer.pending_save import PendingSave

log = logging.getLogger("zeroflow")


LOADER = "loader"
"Checkpoint item holding the data loader's position (runs with a Grain loader)."
CORRUPT = ".corrupt"
"Suffix of a step folder moved aside because it could not be read."
DIVERGED = ".diverged"
"Suffix of a step folder moved aside because its weights gave a diverging step."
DIGESTS = "digests"
"Key of a step's meta naming its manifest: a step saved with digests must have them."
PROCESSES = "processes"
"Key of a step's meta: how many processes saved it (each wrote and hashed its own files)."


def checkpoints_dir(cfg, run_dir: Path) -> Path:
    """Where a run's checkpoints are: ``checkpoint.dir``, or ``run.dir/checkpoints``."""
    return Path(cfg.checkpoint.dir) if cfg.checkpoint.dir else Path(run_dir) / "checkpoints"


class DiskFull(OSError):
    """No space left for a checkpoint; the message says how much it needs and how much is free."""


NOT_WRITABLE = (errno.EACCES, errno.EPERM, errno.EROFS)
"A folder the process may not write to: read-only, or another user's."

SLOW_WAIT_S = 1.0
"A save that waits this long for the one before it is said in a warning (else at INFO)."

READ_ATTEMPTS = 3
"How often a reader lists the steps again when the ones it listed were deleted under it."


OUT_OF_ROOM = {
    errno.ENOSPC: ("No space left on device", "no space left on device", "free some space"),
    errno.EFBIG: (
        "File too large",
        "a file larger than the file-size limit allows (ulimit -f, or the file system's)",
        "raise the file-size limit",
    ),
}
"errno: (how the OS or TensorStore words it, what we say, what to do)."


def _out_of_room(error: BaseException | None) -> int | None:
    """ENOSPC or EFBIG when a write failed for want of room, through the exception's chain
    (TensorStore reports them as text: 'OUT_OF_RANGE: ... File too large')."""
    while error is not None:
        for code, (words, _, _) in OUT_OF_ROOM.items():
            if getattr(error, "errno", None) == code or words in str(error):
                return code
        error = error.__cause__ or error.__context__
    return None


def _nbytes(tree) -> int:
    return sum(int(getattr(x, "nbytes", 0)) for x in jax.tree.leaves(tree))


FAULT_BYTES = 1024
"Room for one process's digest fault when the processes compare their checks."


def _first_of_all(fault: str) -> str:
    """The first non-empty ``fault`` among every process's (each checked its own files): all
    processes then treat the step alike."""
    import numpy as np
    from jax.experimental import multihost_utils

    mine = np.zeros(FAULT_BYTES, np.uint8)
    encoded = fault.encode()[:FAULT_BYTES]
    mine[: len(encoded)] = np.frombuffer(encoded, np.uint8)
    for row in np.asarray(multihost_utils.process_allgather(mine)).reshape(-1, FAULT_BYTES):
        if row.any():
            return bytes(row).rstrip(b"\0").decode(errors="replace")
    return ""


class UnreadableCheckpoint(CheckpointError):
    """A step whose files are missing or damaged; ``reason`` names the file and the fault."""

    def __init__(self, step: int, reason: str, *, unfinished: bool = False):
        super().__init__(f"checkpoint step {step} is unreadable: {reason}")
        self.step, self.reason, self.unfinished = step, reason, unfinished


class RunCheckpoints:
    def __init__(
        self,
        directory: str | Path,
        keep: int,
        *,
        with_loader: bool = False,
        read_only: bool = False,
        allow_unverified: bool = False,
        keep_every: int = 0,
        async_save: bool = False,
    ):
        """``read_only``: for readers of a run (export, sample): nothing is created or moved.
        ``allow_unverified`` (``checkpoint.allow_unverified``): load a step without digests even
        where other steps of the run have them. ``keep``, ``keep_every``: which steps are kept
        (``zeroflow.trainer.retention``). ``async_save``: ``save`` returns once the state is in
        host memory, the files and digests are written in the background
        (``zeroflow.trainer.pending_save``)."""
        self.directory = Path(directory).absolute()
        self.read_only, self.allow_unverified = read_only, allow_unverified
        self.keep, self.keep_every, self.async_save = max(keep, 1), keep_every, async_save
        self.pending: PendingSave | None = None
        self.save_failed = False
        self.when_complete: Callable[[], None] | None = None
        "Called (on the training thread) once a save is complete with its digests."
        options = ocp.CheckpointManagerOptions(
            max_to_keep=None,  # retention is ours, applied once the newest step is verified
            create=False,
            read_only=read_only,
            save_interval_steps=0 if read_only else 1,
            cleanup_tmp_directories=not read_only,
            enable_async_checkpointing=async_save and not read_only,
        )
        if not read_only and jax.process_index() == 0:
            retention.remove_leftovers(self.directory)
        if read_only:
            damage.quiet_read_only_notes()
        # Handlers named up front, so a fresh process can read item metadata before restoring.
        handlers = {"state": ocp.StandardCheckpointHandler(), "meta": ocp.JsonCheckpointHandler()}
        if with_loader:
            import grain

            handlers[LOADER] = grain.checkpoint.CheckpointHandler()
        self.manager = ocp.CheckpointManager(
            self.directory, options=options, item_handlers=handlers
        )
        self._written: set[int] = set()

    def steps(self) -> list[int]:
        """The numbered steps, once the save in flight (if any) is complete."""
        self.finish()
        return sorted(self.manager.all_steps())

    def save(self, step: int, state: TrainState, meta: dict[str, Any], loader=None) -> None:
        """``loader``: a Grain iterator whose position is saved with the state. A step this
        object already wrote is not written twice; one left by an earlier process is replaced
        (this run's state at that step is the one it resumed towards). With ``async_save`` it
        returns once the state is in host memory; a save still in flight is waited for first
        (the wait is logged with its seconds)."""
        if step in self._written:
            return
        self.finish(next_step=step)
        if step in self.manager.all_steps():
            log.warning("replacing checkpoint step %d in %s with this run's", step, self.directory)
            self.manager.delete(step)
        saved = portable(state)
        items = dict(
            state=ocp.args.StandardSave(saved),
            meta=ocp.args.JsonSave(
                {**meta, DIGESTS: checkpoint_digests.MANIFEST, PROCESSES: jax.process_count()}
            ),
        )
        if loader is not None:
            import grain

            items[LOADER] = grain.checkpoint.CheckpointSave(loader)
        damage.quiet_writer_threads()
        nbytes = _nbytes(saved)
        try:
            self.manager.save(step, args=ocp.args.Composite(**items), force=True)
        except Exception as e:
            raise self._save_failed(step, nbytes, e) from None
        self._written.add(step)
        self.pending = PendingSave(step, nbytes, lambda: self._complete(step))
        if not self.async_save:
            self.finish()

    def _complete(self, step: int) -> None:
        """Off the training thread: the step's files written, then its digests (process 0
        hashes them, last, once the folder is complete), then the retention rules applied."""
        self.manager.wait_until_finished()
        process, count = jax.process_index(), jax.process_count()
        if process != 0:  # each process hashes the files it wrote; process 0 merges the parts
            checkpoint_digests.write_part(self.directory / str(step), process, count)
            return
        checkpoint_digests.write_manifest(self.directory / str(step), count)
        present = [int(p.name) for p in self.directory.iterdir() if p.name.isdigit()]
        retention.delete_steps(
            self.directory, retention.to_delete(present, step, self.keep, self.keep_every)
        )

    def finish(self, next_step: int | None = None) -> None:
        """Wait for the save in flight, if any; raise its error in one line (a full disk: the
        half-written step removed). ``next_step``: the save that waits, for the log."""
        pending, self.pending = self.pending, None
        if pending is None:
            return
        waited = pending.wait()
        if next_step is not None and waited > 0:
            level = logging.WARNING if waited >= SLOW_WAIT_S else logging.INFO
            log.log(
                level,
                "checkpoint step %d waited %.1f s for step %d's save to finish writing%s",
                next_step,
                waited,
                pending.step,
                " (saves come faster than the disk takes them: raise checkpoint.every)"
                if level == logging.WARNING
                else "",
            )
        if pending.error is not None:
            self._written.discard(pending.step)
            raise self._save_failed(pending.step, pending.nbytes, pending.error) from None
        self.manager.reload()
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils

            multihost_utils.sync_global_devices(f"zeroflow: step {pending.step} saved, digested")
        if self.when_complete is not None:
            self.when_complete()

    def _save_failed(self, step: int, nbytes: int, error: BaseException) -> BaseException:
        """The one-line error for a failed save (the half-written step removed), or ``error``."""
        self.save_failed = True
        code = _out_of_room(error)
        if code is not None:
            return self._disk_full(step, nbytes, code)
        if isinstance(error, OSError) and error.errno in NOT_WRITABLE:
            self._remove_half_written(step, quiet_s=0.2)
            return self.not_writable(error.strerror or str(error), step)
        return error

    def check_writable(self) -> None:
        """Before training: a ``checkpoints/`` the run cannot write to (read-only, another
        user's) is one line now, not a failed save after the steps it trained."""
        if self.read_only or jax.process_index() != 0:
            return
        # A folder not made yet (checkpoint.dir elsewhere): its nearest existing parent.
        folder = next(p for p in (self.directory, *self.directory.parents) if p.exists())
        probe = folder / f".zeroflow-write-test-{os.getpid()}"
        try:
            probe.mkdir()
            probe.rmdir()
        except OSError as e:
            if e.errno not in NOT_WRITABLE:
                raise
            raise self.not_writable(e.strerror or str(e)) from None

    def not_writable(self, why: str, step: int | None = None) -> PermissionError:
        what = f"cannot save checkpoint step {step}" if step is not None else "cannot save"
        return PermissionError(
            f"{self.directory} is not writable ({why}): the run {what} there; make it "
            "writable and run the same command to resume from its newest readable step"
        )

    def _disk_full(self, step: int, needed: int, code: int) -> DiskFull:
        """The error for a save that ran out of room (``code``: ENOSPC or EFBIG), after removing
        what it left half-written (the earlier steps are untouched)."""
        self._remove_half_written(step)
        free = shutil.disk_usage(self.directory).free
        _, what, remedy = OUT_OF_ROOM[code]
        error = DiskFull(
            f"{what} for checkpoint step {step} in "
            f"{self.directory}: it needs about {needed:,} bytes, {free:,} bytes are "
            f"free; {remedy} (or lower checkpoint.keep) and run the same "
            f"command to resume from step {max(self.manager.all_steps(), default=0)}"
        )
        error.errno = code
        return error

    def _remove_half_written(self, step: int, quiet_s: float = 1.0, give_up_s: float = 30.0):
        """Removes step ``step``'s partial folders until none has reappeared for ``quiet_s``.
        The first write that fails ends the save, but the others of the same save are not
        cancelled: tensorstore's threads can still finish a file (the OCDBT manifest) into the
        temporary folder after the error has reached us, which would recreate it after a single
        removal."""

        def leftovers() -> list[Path]:
            found = list(self.directory.glob(f"{step}.orbax-checkpoint-tmp*"))
            if (self.directory / str(step)).is_dir() and step not in self._written:
                found.append(self.directory / str(step))
            return found

        start = last_seen = time.monotonic()
        while time.monotonic() - last_seen < quiet_s and time.monotonic() - start < give_up_s:
            if found := leftovers():
                for path in found:
                    shutil.rmtree(path, ignore_errors=True)
                last_seen = time.monotonic()
            time.sleep(0.05)

    def restore(
        self, step: int, like: TrainState, loader=None
    ) -> tuple[TrainState, dict[str, Any]]:
        """Step ``step`` on ``like``'s layout. ``UnreadableCheckpoint`` when its files are
        missing or damaged; ``CheckpointError`` when it is readable but for another model."""
        self.finish()
        if step not in self.manager.all_steps():
            raise CheckpointError(
                f"no checkpoint at step {step} in {self.directory} "
                f"(steps: {', '.join(map(str, self.steps())) or 'none'})"
            )
        step_dir = self.directory / str(step)
        try:
            return self._restore(step, step_dir, like, loader)
        except OSError as e:  # a file this user may not read (or the disk failing under it)
            where = damage.shown(Path(e.filename), self.directory) if e.filename else step_dir
            raise UnreadableCheckpoint(
                step, f"{where} cannot be read ({e.strerror or e}): check its permissions"
            ) from None

    def _restore(self, step: int, step_dir: Path, like: TrainState, loader):
        if problem := damage.missing_or_damaged(step_dir, self.directory):
            raise UnreadableCheckpoint(step, problem)
        verified = self._verify(step, step_dir)
        if not verified and not self.allow_unverified and self.has_digested_steps():
            raise UnreadableCheckpoint(
                step,
                f"{damage.shown(step_dir, self.directory)} has no digests while other steps of "
                "this run have them (its manifest was removed, or it was copied in from "
                "elsewhere), so its files cannot be checked; set checkpoint.allow_unverified=true "
                "to load it anyway",
            )
        if not self.read_only:
            self._check_processes(step, step_dir)
        damage.quiet_closed_loops()
        try:
            meta_tree = self.manager.item_metadata(step)["state"]
        except Exception as e:
            raise UnreadableCheckpoint(step, damage.describe(e, step_dir, self.directory)) from None
        meta_tree = getattr(meta_tree, "tree", meta_tree)
        target = checked_target(like, meta_tree, f"{self.directory}/{step}")
        items = dict(
            state=ocp.args.StandardRestore(target, strict=False), meta=ocp.args.JsonRestore()
        )
        if loader is not None:
            if not (step_dir / LOADER).is_dir():
                raise CheckpointError(
                    f"{step_dir} has no data loader position (saved by a run on a token stream?)"
                )
            import grain

            items[LOADER] = grain.checkpoint.CheckpointRestore(loader)
        try:
            restored = self.manager.restore(step, args=ocp.args.Composite(**items))
        except Exception as e:
            raise UnreadableCheckpoint(step, damage.describe(e, step_dir, self.directory)) from None
        if not verified:
            log.warning(
                "checkpoint step %d in %s has no digests (%s): loaded unverified",
                step,
                self.directory,
                "checkpoint.allow_unverified=true"
                if self.allow_unverified and self.has_digested_steps()
                else "saved before zeroflow recorded them",
            )
        return rebuild_state(restored["state"], like), dict(restored["meta"])

    def _check_processes(self, step: int, step_dir: Path) -> None:
        """A trainer resumes only a step saved by as many processes as it has: each process
        wrote, hashed and positioned its data for its own part (``CheckpointError``, not an
        unreadable step: nothing is moved aside). Checked once the step is verified, so a
        damaged meta falls back to the older step instead. Readers (export, sample) read any
        step whole, in one process. Steps saved before the count was recorded are not checked."""
        meta = json.loads((step_dir / "meta" / "metadata").read_text("utf-8"))
        saved_by, here = meta.get(PROCESSES), jax.process_count()
        if saved_by is None or saved_by == here:
            return
        raise CheckpointError(
            f"checkpoint step {step} in {self.directory} was saved by a run of {saved_by} "
            f"process{'es' if saved_by != 1 else ''} and this run has {here}: each process "
            f"saved and digested its own part, so resume it with {saved_by} "
            f"(python -m zeroflow.launch --processes {saved_by}), or export its weights "
            "(python -m zeroflow.export) and start a new run from them"
        )

    def has_digested_steps(self) -> bool:
        """Whether any step of the run, kept or moved aside, was saved with digests: then a
        step without them lost them (or never was this run's) and is not loaded unverified."""
        for entry in self.directory.iterdir():
            if not entry.name.split(".")[0].split("-")[0].isdigit() or not entry.is_dir():
                continue
            if (entry / checkpoint_digests.MANIFEST).is_file():
                return True
            try:
                meta = json.loads((entry / "meta" / "metadata").read_text("utf-8"))
            except (OSError, ValueError):
                continue
            if isinstance(meta, dict) and DIGESTS in meta:
                return True
        return False

    def _verify(self, step: int, step_dir: Path) -> bool:
        """Whether the step's files were checked against its digests (False: it has none, as
        steps saved before digests existed); ``UnreadableCheckpoint`` when one differs."""
        expected = DIGESTS in json.loads((step_dir / "meta" / "metadata").read_text("utf-8"))
        count = 1 if self.read_only else jax.process_count()
        fault = ""
        try:  # with several processes each checks the files it wrote, all at once
            verified = checkpoint_digests.verify(
                step_dir,
                expected=expected,
                process=jax.process_index() if count > 1 else None,
                process_count=count,
            )
        except checkpoint_digests.DigestMismatch as e:
            verified, fault = True, f"{damage.shown(e.path, self.directory)} {e.fault}"
        if count > 1:
            fault = _first_of_all(fault)
        if fault:
            raise UnreadableCheckpoint(
                step, fault, unfinished=fault.endswith(checkpoint_digests.UNFINISHED)
            )
        return verified

    def restore_latest(
        self, like: TrainState, loader=None
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
            for unreadable in bad:
                log.warning(
                    "%s; %s, resuming from step %d",
                    unreadable,
                    self._set_aside(unreadable.step),
                    step,
                )
            return restored
        if bad and all(e.unfinished for e in bad):
            # Only saves that were stopped before they finished (a kill while one was in
            # flight): the run never had a finished checkpoint, so it starts again from step 0.
            for unfinished in bad:
                log.warning(
                    "%s; %s, starting from step 0", unfinished, self._set_aside(unfinished.step)
                )
            return None
        if bad:
            raise CheckpointError(
                self.none_readable(bad) + "; to train this run from scratch "
                f"move that folder away (mv {self.directory} "
                f"{self.directory}.bad) or give another run.dir"
            )
        return None

    def read(self, like: TrainState, step: int | None = None) -> tuple[TrainState, dict[str, Any]]:
        """For readers of a finished or running run: step ``step``, or the newest readable one
        (when newer steps are unreadable, one warning line says which and why; nothing is
        moved). A running trainer deletes old steps as it saves new ones: a step that vanishes
        while it is read is no fault of the run, and the steps are listed again."""
        if not self.steps():
            raise FileNotFoundError(f"no checkpoint in {self.directory}: train the run first")
        if step is not None:
            return self.restore(step, like)
        for _ in range(READ_ATTEMPTS):
            self.manager.reload()
            restored, bad, vanished = self._newest_readable(like)
            if restored is not None:
                return restored
            if not vanished:
                break
        raise CheckpointError(
            self.none_readable(bad) + "; copy the steps again if they came "
            "from elsewhere, or train the run again"
        )

    def _newest_readable(self, like: TrainState):
        """``(restored or None, unreadable steps, whether a step vanished while being read)``."""
        bad: list[UnreadableCheckpoint] = []
        vanished = False
        for candidate in reversed(self.steps()):
            try:
                restored = self.restore(candidate, like)
            except UnreadableCheckpoint as e:
                if not (self.directory / str(candidate)).exists():
                    vanished = True  # deleted by the running trainer after it was listed
                    continue
                bad.append(e)
                continue
            if bad:
                log.warning(
                    "%s; using step %d, the newest readable one (resuming the run moves "
                    "the unreadable steps aside and saves them again)",
                    "; ".join(str(e) for e in bad),
                    candidate,
                )
            return restored, bad, vanished
        return None, bad, vanished

    def none_readable(self, bad: list[UnreadableCheckpoint]) -> str:
        return f"no readable checkpoint in {self.directory}: " + "; ".join(
            f"step {e.step}: {e.reason}" for e in sorted(bad, key=lambda e: e.step)
        )

    def _set_aside(self, step: int) -> str:
        """Move an unreadable step aside; where the folder cannot be changed (a read-only
        ``checkpoints/``), leave it and say so: the older step is used either way."""
        try:
            return f"moved it to {damage.shown(self.move_aside(step), self.directory)}"
        except OSError as e:
            return (
                f"could not move it aside ({e.strerror or e}: {damage.shown(self.directory, self.directory)} "
                "is not writable), so it stays; make the folder writable to let the run save there"
            )

    def move_aside(self, step: int, suffix: str = CORRUPT) -> Path:
        """Rename a step that must not be used (unreadable: ``<step>.corrupt``; diverged:
        ``<step>.diverged``; ``-2``, ... added if taken). Orbax lists numbered folders only,
        so the step is gone for every later restore, and a save at that step writes it anew."""
        self.finish()
        target = self.directory / f"{step}{suffix}"
        n = 1
        while target.exists():
            n += 1
            target = self.directory / f"{step}{suffix}-{n}"
        if jax.process_index() == 0:
            (self.directory / str(step)).rename(target)
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils

            multihost_utils.sync_global_devices(f"zeroflow: moved step {step} aside")
        self.manager.reload()
        self._written.discard(step)
        return target

    def close(self) -> None:
        """Wait for the save in flight (its error raised here), then close."""
        try:
            self.finish()
        except BaseException:
            self.save_failed = True
            raise
        finally:
            if self.save_failed:  # reported already: Orbax would raise the same failure again
                with contextlib.suppress(Exception):
                    self.manager.close()
            else:
                self.manager.close()
