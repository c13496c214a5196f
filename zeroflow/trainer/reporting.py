"""What a run reports: ``metrics.jsonl``, the sinks ``run.*`` asks for (TensorBoard events by
default, W&B, trackio: ``zeroflow.trainer.loggers``), ``plot.png`` redrawn at an evaluation
when it is over a minute old, and at the end (``zeroflow.trainer.plot``), and on the terminal a rich progress bar, or (progress off, or output not a terminal) a plain line every
``train.log_every`` steps. What a person reads (step lines, evaluations, the final summary)
goes to stdout, whole when piped and cut only between its items in a terminal narrower than
it (``zeroflow.util.lines``); warnings and errors go to stderr.

A resumed run first drops the rows of ``metrics.jsonl`` past the step it resumed from (they
were logged by the interrupted run and are about to be logged again), then records the resume
as ``{"event": "resume", "resumed_from_step": ..., "dropped_rows": ...}``: each step appears
at most once however often a run was interrupted.

A rollback (``train.on_divergence=rollback``) drops the rows past the step it goes back to in the
same way and records itself as ``{"event": "rollback", "rollback": n, "from_step", "to_step",
"batches_skipped", "lr_factor", ...}``. A resume drops the rollback rows its checkpoint had not
yet seen (numbered past the checkpoint's count): the resumed run makes them again.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from pathlib import Path
from typing import Any

import jax
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
from rich.table import Column

from zeroflow.config.schema import Config
from zeroflow.memory.spec import RunSpec
from zeroflow.trainer import loggers
from zeroflow.trainer.plot import write_plot
from zeroflow.trainer.run_folder import writing
from zeroflow.util import lines

log = logging.getLogger("zeroflow")


METRICS = "metrics.jsonl"
PLOT_EVERY_S = 60.0
"The least time between two redraws of ``plot.png`` at evaluations (the end always redraws)."


ROLLBACK = "rollback"
"The ``event`` of a rollback's row."
BAR_COLUMNS = len("train") + 16 + 1 + len("-:--:--") + 4
"The bar's columns but its figures: the label, the bar, the '/' of step/total, the time left and "
"a space between each two (the step numbers' digits are added to it)."


def trim_metrics(path: Path, step: int, rollbacks: int | None = None) -> int:
    """Drop the rows of ``path`` past ``step`` (and a line cut short by a kill), and with
    ``rollbacks`` the rollback rows numbered past it, atomically; returns how many were
    dropped."""
    if not path.exists():
        return 0
    kept, dropped = [], 0
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            dropped += 1
            continue
        if _undone(row, step, rollbacks):
            dropped += 1
        else:
            kept.append(line + "\n")
    if dropped:
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text("".join(kept), encoding="utf-8")
        os.replace(tmp, path)
    return dropped


def _undone(row, step: int, rollbacks: int | None) -> bool:
    """Whether ``row`` records what happened after the state of ``step`` with ``rollbacks``."""
    if not isinstance(row, dict):
        return False
    if isinstance(row.get("step"), int) and row["step"] > step:
        return True
    return (
        rollbacks is not None
        and row.get("event") == ROLLBACK
        and isinstance(row.get(ROLLBACK), int)
        and row[ROLLBACK] > rollbacks
    )


class Reporter:
    """Owns the progress bar and the metric sinks; only process 0 writes."""

    def __init__(
        self,
        run_dir: Path,
        total_steps: int,
        start_step: int,
        *,
        progress: bool,
        cfg: Config,
        spec: RunSpec,
        num_devices: int,
        resumed: bool = False,
        rollbacks: int = 0,
    ):
        """``spec``: the run described once (``zeroflow.memory.spec``), whose FLOPs per token
        and target's dense peak the MFU reads; ``num_devices``: every device of the mesh.
        ``rollbacks``: the rollbacks the start state has made (the run's checkpoint's)."""
        self.is_main = jax.process_index() == 0
        self.peak = spec.peak_flops
        self.flops_per_token = spec.flops_per_token
        self.num_devices = num_devices
        self.total_steps = total_steps
        self.out = Console(soft_wrap=True, highlight=False)  # stdout, whatever its width
        self.run_dir = run_dir
        self.jsonl = None
        self.sinks: list = []
        self.plot = cfg.run.plot and self.is_main
        self.drawn_at: float | None = None  # time.monotonic() of the last redraw
        self.rows_since_draw = 0
        if self.is_main:
            dropped = trim_metrics(run_dir / METRICS, start_step, rollbacks)
            self.jsonl = open(run_dir / METRICS, "a", encoding="utf-8")
            if resumed or dropped:
                self._row(
                    {"event": "resume", "resumed_from_step": start_step, "dropped_rows": dropped}
                )
            self.sinks = loggers.open_sinks(cfg, run_dir, start_step, resumed)
        self.progress = None
        bar = Console(stderr=True)
        # Only when both streams are terminals: while the bar is shown, rich routes stdout
        # through it, which would take the step lines away from a redirected stdout.
        if progress and self.is_main and bar.is_terminal and self.out.is_terminal:
            self.progress = Progress(
                TextColumn("[bold]train"),
                BarColumn(bar_width=16),
                MofNCompleteColumn(),
                # whole figures that fit (_bar_stats); never wrapped inside one
                TextColumn(
                    "{task.fields[stats]}", table_column=Column(no_wrap=True, overflow="ellipsis")
                ),
                TimeRemainingColumn(),
                console=bar,
                transient=False,
            )
            self.task = self.progress.add_task(
                "train", total=total_steps, completed=start_step, stats=""
            )
            self.progress.start()

    def mfu(self, tokens_per_s: float) -> float | None:
        if not self.peak:
            return None
        return self.flops_per_token * tokens_per_s / (self.peak * self.num_devices)

    def step(self, step: int, m: dict[str, Any], log_line: bool) -> None:
        """``m``: host floats for one finished step (1-based ``step``)."""
        if self.progress is not None:
            self.progress.update(self.task, completed=step, stats=self._bar_stats(m))
        if log_line or step == 1:  # the first step always: the plot starts at the first loss
            self.write(step, m)
        if log_line and self.progress is None:
            self.print(step_line(step, self.total_steps, m))

    def _bar_stats(self, m: dict[str, Any]) -> str:
        """The bar's figures that fit beside its other columns in the terminal: whole items,
        the first ones, so that none is cut and the bar keeps its width."""
        assert self.progress is not None
        mfu = m.get("mfu")
        items = [
            f"loss {m['loss']:.3f}",
            f"{m['tokens_per_s']:,.0f} tok/s",
            f"{m['step_time'] * 1e3:.0f} ms",
            f"scale {m['loss_scale']:g}",
            "MFU " + (f"{mfu:.1%}" if mfu is not None else "n/a"),
        ]
        room = self.progress.console.width - BAR_COLUMNS - 2 * len(str(self.total_steps))
        return lines.fit("  ".join(items), max(room, 1))[0]

    def write(self, step: int, m: dict[str, Any]) -> None:
        if not self.is_main:
            return
        row = {"step": step, **{k: _plain(v) for k, v in m.items()}}
        self._row(row)
        numbers = {
            k: v
            for k, v in row.items()
            if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool)
        }
        for sink in self.sinks:
            sink.log(numbers, step)
        if "eval_loss" in row and self._plot_is_stale():
            self.draw()

    def rollback(self, to_step: int, row: dict[str, Any]) -> None:
        """Go back to ``to_step``: its later rows are dropped (they are trained again),
        TensorBoard hides its later events, and ``row`` (the rollback's) is recorded."""
        if self.progress is not None:
            self.progress.update(self.task, completed=to_step)
        if not self.is_main or self.jsonl is None:
            return
        self.jsonl.close()
        trim_metrics(self.run_dir / METRICS, to_step)
        self.jsonl = open(self.run_dir / METRICS, "a", encoding="utf-8")
        self._row({"event": ROLLBACK, **{k: _plain(v) for k, v in row.items()}})
        for sink in self.sinks:
            sink.rewind(to_step)

    def draw(self, report: bool = True) -> None:
        """Redraw ``plot.png`` (when ``run.plot``); a plot that fails is reported (``report``),
        not raised."""
        if not self.plot:
            return
        self.drawn_at, self.rows_since_draw = time.monotonic(), 0
        try:
            write_plot(self.run_dir)
        except Exception as e:
            if report:
                log.warning(f"could not draw {self.run_dir / 'plot.png'}: {e}")

    def _plot_is_stale(self) -> bool:
        """Redraw at an evaluation when the picture is over ``PLOT_EVERY_S`` old (or there is
        none yet): a drawing takes about half a second, which a run with frequent evaluations
        should not pay at each one."""
        return self.drawn_at is None or time.monotonic() - self.drawn_at >= PLOT_EVERY_S

    def _row(self, row: dict[str, Any]) -> None:
        if self.jsonl is None:  # only the main process writes metrics.jsonl
            return
        with writing(self.run_dir / METRICS):
            self.jsonl.write(json.dumps(row) + "\n")
            self.jsonl.flush()
        self.rows_since_draw += 1

    def print(self, message: str) -> None:
        """A line for the person running it, on stdout (above the bar while one is shown):
        whole when piped, cut between its items in a terminal narrower than it
        (``zeroflow.util.lines``)."""
        if not self.is_main:
            return
        # through the bar's console while it is shown, which keeps the bar below
        console = self.out if self.progress is None else self.progress.console
        for line in lines.fit(message, console.width if console.is_terminal else None):
            console.print(line, markup=False, highlight=False, soft_wrap=True)

    def close(self, failing: bool = False) -> None:
        """Stop the bar, close the files and draw the plot a last time. ``failing``: the run is
        ending on an error, which is the one line to read: a plot that fails too (a full disk
        fails both) is not reported beside it."""
        if self.progress is not None:
            self.progress.stop()
        if self.jsonl:
            try:
                self.jsonl.close()
            except OSError:  # the write that failed first is the error reported
                if not failing:
                    raise
            if self.rows_since_draw or self.drawn_at is None:  # else the picture is current
                self.draw(report=not failing)
        for sink in self.sinks:
            try:
                with writing(Path(getattr(sink, "folder", self.run_dir))):
                    sink.close()
            except OSError:  # as above: a full disk fails every sink, the first is reported
                if not failing:
                    raise


def step_line(step: int, total: int, m: dict[str, Any]) -> str:
    """The plain progress line: ``step 10/200  loss 2.3456  lr 3.0e-04  ...``."""
    parts = [f"step {step}/{total}", f"loss {m['loss']:.4f}"]
    if "lr" in m:
        parts.append(f"lr {m['lr']:.1e}")
    if "tokens_per_s" in m:
        parts.append(f"{m['tokens_per_s']:,.0f} tok/s")
    if "step_time" in m:
        parts.append(f"{m['step_time'] * 1e3:.0f} ms/step")
    if m.get("mfu") is not None:
        parts.append(f"MFU {m['mfu']:.1%}")
    return "  ".join(parts)


def _plain(v):
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)
    return v
