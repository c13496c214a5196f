"""Where a run's metrics go besides ``metrics.jsonl``: TensorBoard event files (on by default,
``run.tensorboard``), Weights & Biases (``run.wandb``: ``offline`` or ``online``) and trackio
(``run.trackio``, local-first). Each is a sink with ``log(row, step)`` and ``close()``; only
process 0 makes them. W&B and trackio are optional installs: asking for one that is not
installed stops the run before it starts, naming the extra to install.
"""

from __future__ import annotations

import dataclasses
import importlib
import sys
from pathlib import Path
from typing import Any, Protocol

from zeroflow.config.schema import Config

TB_DIR = "tb"
"TensorBoard's folder inside the run folder."


class Sink(Protocol):
    def log(self, row: dict[str, float], step: int) -> None: ...
    def rewind(self, step: int) -> None: ...
    def close(self) -> None: ...


def _require(module: str, extra: str):
    try:
        return importlib.import_module(module)
    except ImportError:
        raise ImportError(
            f"run.{extra} needs the {module} package: pip install 'zeroflow[{extra}]'"
        ) from None


def _summary_writer_class():
    """tensorboardX's ``SummaryWriter``, imported without torch. tensorboardX imports torch,
    when it is installed, only to accept torch tensors, which a run never logs (its scalars are
    Python floats), and that import takes 2-4 s of every run's start. While tensorboardX loads,
    ``import torch`` fails as if torch were absent; a later one imports it as usual."""
    masked = "torch" not in sys.modules  # else already paid for
    if masked:
        sys.modules["torch"] = None  # type: ignore[assignment]  # None makes ``import torch`` fail
    try:
        from tensorboardX import SummaryWriter
    finally:
        if masked:
            del sys.modules["torch"]
    return SummaryWriter


class TensorBoardSink:
    def __init__(self, run_dir: Path, start_step: int, resumed: bool):
        self.folder = str(run_dir / TB_DIR)
        # purge_step: TensorBoard hides the events past the resumed step.
        self.writer = _summary_writer_class()(
            self.folder, purge_step=start_step + 1 if resumed else None
        )

    def log(self, row: dict[str, float], step: int) -> None:
        for k, v in row.items():
            self.writer.add_scalar(k, v, step)
        self.writer.flush()

    def rewind(self, step: int) -> None:
        """A rollback to ``step``: a new event file whose purge hides the later events."""
        self.writer.close()
        self.writer = _summary_writer_class()(self.folder, purge_step=step + 1)

    def close(self) -> None:
        self.writer.close()


class WandbSink:
    def __init__(self, cfg: Config, run_dir: Path, resumed: bool):
        wandb = _require("wandb", "wandb")
        # The run's id is its folder's name, so a resumed run goes on in the same W&B run.
        self.run = wandb.init(
            project=cfg.run.project,
            name=run_dir.name,
            id=_run_id(run_dir),
            dir=str(run_dir),
            mode=cfg.run.wandb,
            config=dataclasses.asdict(cfg),
            resume="allow" if resumed else None,
        )

    def log(self, row: dict[str, float], step: int) -> None:
        self.run.log(row, step=step)

    def rewind(self, step: int) -> None:
        """Nothing: this service keeps what was logged; the steps trained again after a
        rollback are logged again at their steps."""

    def close(self) -> None:
        self.run.finish()


class TrackioSink:
    def __init__(self, cfg: Config, run_dir: Path, resumed: bool):
        trackio = _require("trackio", "trackio")
        self.run = trackio.init(
            project=cfg.run.project,
            name=run_dir.name,
            config=dataclasses.asdict(cfg),
            resume="allow" if resumed else "never",
            auto_log_cpu=False,
        )

    def log(self, row: dict[str, float], step: int) -> None:
        self.run.log(row, step=step)

    def rewind(self, step: int) -> None:
        """Nothing: this service keeps what was logged; the steps trained again after a
        rollback are logged again at their steps."""

    def close(self) -> None:
        self.run.finish()


def _run_id(run_dir: Path) -> str:
    return "".join(c if c.isalnum() or c in "-_" else "-" for c in run_dir.resolve().name)


def check_installed(cfg: Config) -> None:
    """Fail before anything is trained when an asked-for logger is not installed."""
    if cfg.run.wandb != "off":
        _require("wandb", "wandb")
    if cfg.run.trackio:
        _require("trackio", "trackio")


def open_sinks(cfg: Config, run_dir: Path, start_step: int, resumed: bool) -> list[Any]:
    """The sinks ``cfg.run`` asks for (call on process 0 only)."""
    sinks: list[Sink] = []
    if cfg.run.tensorboard:
        sinks.append(TensorBoardSink(run_dir, start_step, resumed))
    if cfg.run.wandb != "off":
        sinks.append(WandbSink(cfg, run_dir, resumed))
    if cfg.run.trackio:
        sinks.append(TrackioSink(cfg, run_dir, resumed))
    return sinks
