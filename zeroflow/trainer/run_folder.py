"""What a run folder already holds, checked before a run writes anything to it.

A run folder (``run.dir``) belongs to one model: its checkpoints only load into that model, and
``sample`` / ``export`` read its ``config.yaml`` to rebuild it. A run started in the folder with
another model stops here, with one line, before the folder is changed. The settings that may
change between a run and its resume (``parallel.*``, precision, ``train.*``, the run-time model
fields) are not compared; a changed learning-rate schedule is announced.

One trainer at a time: ``claim(run_dir)`` holds an OS lock (``fcntl.flock`` on
``trainer.lock``) for the run's life. The kernel releases it when the process ends however it
ends (kill -9 included), so a lock is never stale; a second trainer refuses in one line naming
the first's pid. Readers (``sample``, ``export``) take no lock. Until the run has started (its
first checkpoint is saved), a failure undoes what the run wrote: a folder it created is removed, and in an
existing folder the files it added are removed and ``config.yaml`` / ``metrics.jsonl`` put back.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import fcntl
import json
import logging
import os
import shutil
from pathlib import Path

from zeroflow.config.io import ConfigError, load_config
from zeroflow.config.schema import Config
from zeroflow.trainer.checkpoints import OUT_OF_ROOM
from zeroflow.trainer.optim import lr_schedule
from zeroflow.util import interrupts
from zeroflow.util.paths import path_problem

log = logging.getLogger("zeroflow")

CONFIG_FILE = "config.yaml"
LOCK_FILE = "trainer.lock"
RESTORED_ON_FAILURE = (CONFIG_FILE, "metrics.jsonl")
"Files a run rewrites before it starts: put back as they were when it fails before starting."
RESUMABLE_MODEL_FIELDS = ("seq_len", "remat", "remat_dtype", "attention", "dropout", "lora.dropout")
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
        raise ConfigError(
            f"{path} (written by the run already in this folder) cannot be read: "
            f"{e}; restore it, or give another run.dir"
        ) from None


def model_differences(previous: Config, cfg: Config) -> list[str]:
    """``"model.embed_dim is 128 there, 64 here"`` for each field that makes another model."""
    out = [
        f"model.{key} is {old!r} there, {new!r} here"
        for key, old, new in _field_pairs(previous.model, cfg.model)
        if key not in RESUMABLE_MODEL_FIELDS and old != new
    ]
    if previous.data.tokenizer != cfg.data.tokenizer:
        out.append(
            f"data.tokenizer is {previous.data.tokenizer!r} there, {cfg.data.tokenizer!r} here"
        )
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
        raise ConfigError(
            f"{run_dir} holds a run of another model: {differences[0]}{more}; "
            "resume it with its own settings (see its config.yaml), or give "
            "another run.dir"
        )


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
    what = ", ".join(
        f"train.{k} {getattr(previous.train, k)} -> {getattr(cfg.train, k)}" for k in changed
    )
    log.warning(
        "%s: the learning-rate schedule follows the new settings, so the rate after "
        "update %d changes from %.2e to %.2e",
        what,
        applied,
        old,
        new,
    )


class RunFolderInUse(ValueError):
    """Another trainer holds the run folder."""


def check_is_folder(run_dir: Path) -> None:
    """``run.dir`` must be a folder, or not exist yet (checked before any work)."""
    if (problem := path_problem(run_dir)) and "too long" in problem:
        raise ValueError(f"run.dir {str(run_dir)[:120]}...: {problem}; give a shorter path")
    for path in (run_dir, *run_dir.parents):
        if path.exists() and not path.is_dir():
            where = "is" if path == run_dir else f"is inside {path}, which is"
            raise NotADirectoryError(
                f"run.dir {run_dir} {where} a file, not a folder; give "
                "a folder (it is created when missing)"
            )
        if path.exists():
            return


def _not_writable(run_dir: Path, error: OSError) -> PermissionError:
    return PermissionError(
        f"run.dir {run_dir} is not writable ({error.strerror or error}): a "
        "trainer writes its checkpoints and metrics there; make it writable "
        "or give another run.dir (sample and export only read it)"
    )


def _make_folder(run_dir: Path) -> list[Path]:
    """Create ``run_dir`` and missing parents; returns those created, outermost first."""
    missing = [p for p in (run_dir, *run_dir.parents) if not p.exists()][::-1]
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        if e.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
            raise _not_writable(run_dir, e) from None
        raise
    return missing


@contextlib.contextmanager
def writing(path: Path):
    """A write to ``path`` that fails for want of room (a full disk, the file-size limit) ends
    in one line naming the file and what to do, instead of the OS's bare ``[Errno 28]``."""
    try:
        yield
    except OSError as e:
        if e.errno not in OUT_OF_ROOM:
            raise
        _, what, remedy = OUT_OF_ROOM[e.errno]
        path = Path(e.filename) if e.filename else path
        try:
            free = f"; {shutil.disk_usage(path.parent).free:,} bytes are free there"
        except OSError:
            free = ""
        error = OSError(f"{what} writing {path}{free}; {remedy} and run the same command")
        error.errno = e.errno
        raise error from None


def _holder(lock: Path) -> str:
    try:
        text = lock.read_text(encoding="utf-8").strip()
    except OSError:
        text = ""
    return f"pid {text}" if text.isdigit() else "a process that has not written its pid yet"


def _lock(run_dir: Path) -> int:
    """An open descriptor of ``run_dir/trainer.lock``, exclusively locked, holding our pid."""
    path = run_dir / LOCK_FILE
    while True:
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            if e.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
                raise _not_writable(run_dir, e) from None
            raise
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise RunFolderInUse(
                f"run.dir {run_dir} is in use by another trainer ({_holder(path)}"
                "); wait for it to finish or stop it, or give another run.dir "
                "(sample and export may read it meanwhile)"
            ) from None
        try:  # the holder before us may have removed the file between our open and our lock
            same = os.stat(path).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            same = False
        if same:
            try:
                with writing(path):
                    os.ftruncate(fd, 0)
                    os.write(fd, f"{os.getpid()}\n".encode())
            except BaseException:  # no lock left behind by a run that never started
                with contextlib.suppress(OSError):
                    path.unlink()
                os.close(fd)
                raise
            return fd
        os.close(fd)


class Claim:
    """A run folder held by this trainer (``claim``); ``started()`` once its first checkpoint is
    saved (before that a failed run has nothing to resume from, and is undone)."""

    def __init__(self, run_dir: Path, created: list[Path]):
        self.run_dir, self.created, self.armed = run_dir, created, True
        self.entries = {p.name for p in run_dir.iterdir()}
        self.saved = {
            name: (run_dir / name).read_bytes()
            for name in RESTORED_ON_FAILURE
            if (run_dir / name).is_file()
        }

    def started(self) -> None:
        self.armed = False

    def undo(self) -> None:
        """Put the folder back as it was before the run (it failed before starting)."""
        if self.created:
            shutil.rmtree(self.created[0], ignore_errors=True)
            return
        for entry in self.run_dir.iterdir():
            if entry.name not in self.entries and entry.name != LOCK_FILE:
                shutil.rmtree(entry) if entry.is_dir() else entry.unlink()
        for name, data in self.saved.items():
            if (self.run_dir / name).read_bytes() != data:
                tmp = self.run_dir / f"{name}.tmp"
                tmp.write_bytes(data)
                os.replace(tmp, self.run_dir / name)


@contextlib.contextmanager
def claim(run_dir: Path, *, holder: bool = True):
    """Hold ``run_dir`` for a run (``holder``: this process takes the lock and undoes a failed
    start; the others of a multi-process run do neither)."""
    check_is_folder(run_dir)
    if not holder:
        yield None
        return
    created = _make_folder(run_dir)
    try:
        fd = _lock(run_dir)
    except BaseException:
        for folder in reversed(created):
            with contextlib.suppress(OSError):
                folder.rmdir()
        raise
    held = Claim(run_dir, created)

    def undo_start() -> None:
        if held.armed:
            held.undo()

    def unlock() -> None:
        with contextlib.suppress(OSError):
            (run_dir / LOCK_FILE).unlink()

    def stopped() -> None:
        undo_start()
        unlock()

    try:
        # A signal that ends the process at once (Ctrl-C before the first step) skips the
        # handlers below: it is undone the same way.
        with interrupts.undone_if_stopped(stopped):
            yield held
    except BaseException:
        undo_start()
        raise
    finally:
        unlock()
        os.close(fd)


def final_eval_recorded(run_dir: Path, step: int) -> bool:
    """Whether ``metrics.jsonl`` holds an evaluation at ``step`` (a run killed during its final
    evaluation has none)."""
    try:
        lines = (run_dir / RESTORED_ON_FAILURE[1]).read_text(encoding="utf-8").splitlines()
    except FileNotFoundError:
        return False
    for line in lines:
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if isinstance(row, dict) and row.get("step") == step and "eval_loss" in row:
            return True
    return False
