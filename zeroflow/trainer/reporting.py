"""What a run reports: a rich progress bar, ``metrics.jsonl``, optional TensorBoard events."""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import jax
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

# Dense bf16 peak FLOP/s per device, for the MFU estimate (vendor datasheets, no sparsity).
PEAK_FLOPS = {"H100": 989e12, "H200": 989e12, "H800": 989e12, "A100": 312e12, "A10G": 125e12,
              "L4": 121e12, "V100": 125e12, "TPU v4": 275e12, "TPU v5 lite": 197e12, "TPU v5e": 197e12,
              "TPU v5p": 459e12, "TPU v6": 918e12}


def device_peak_flops(device: jax.Device | None = None) -> float | None:
    kind = (device or jax.devices()[0]).device_kind
    for name, flops in PEAK_FLOPS.items():
        if name.lower() in kind.lower():
            return flops
    return None


class Reporter:
    """Owns the progress bar and the metric sinks; only process 0 writes."""

    def __init__(self, run_dir: Path, total_steps: int, start_step: int, *, progress: bool,
                 tensorboard: bool, flops_per_token: float, num_devices: int):
        self.is_main = jax.process_index() == 0
        self.peak = device_peak_flops()
        self.flops_per_token = flops_per_token
        self.num_devices = num_devices
        self.console = Console(stderr=True)
        self.jsonl = open(run_dir / "metrics.jsonl", "a") if self.is_main else None
        self.tb = None
        if tensorboard and self.is_main:
            from tensorboardX import SummaryWriter  # optional dependency: pip install zeroflow[tensorboard]
            self.tb = SummaryWriter(str(run_dir / "tb"))
        self.progress = None
        if progress and self.is_main:
            self.progress = Progress(TextColumn("[bold]train"), BarColumn(bar_width=16), MofNCompleteColumn(),
                                     TextColumn("{task.fields[stats]}"), TimeRemainingColumn(),
                                     console=self.console, transient=False)
            self.task = self.progress.add_task("train", total=total_steps, completed=start_step, stats="")
            self.progress.start()

    def mfu(self, tokens_per_s: float) -> float | None:
        if not self.peak:
            return None
        return self.flops_per_token * tokens_per_s / (self.peak * self.num_devices)

    def step(self, step: int, m: dict[str, Any], log_line: bool) -> None:
        """``m``: host floats for one finished step (1-based ``step``)."""
        if self.progress is not None:
            mfu = m.get("mfu")
            stats = (f"loss {m['loss']:.3f} {m['tokens_per_s']:,.0f} tok/s {m['step_time'] * 1e3:.0f} ms"
                     f" scale {m['loss_scale']:g} MFU " + (f"{mfu:.1%}" if mfu is not None else "n/a"))
            self.progress.update(self.task, completed=step, stats=stats)
        if log_line:
            self.write(step, m)

    def write(self, step: int, m: dict[str, Any]) -> None:
        if not self.is_main:
            return
        row = {"step": step, **{k: _plain(v) for k, v in m.items()}}
        self.jsonl.write(json.dumps(row) + "\n")
        self.jsonl.flush()
        if self.tb is not None:
            for k, v in row.items():
                if k != "step" and isinstance(v, (int, float)) and v is not None:
                    self.tb.add_scalar(k, v, step)

    def print(self, message: str) -> None:
        if self.is_main:
            (self.progress.console if self.progress else self.console).print(message, highlight=False)

    def close(self) -> None:
        if self.progress is not None:
            self.progress.stop()
        if self.jsonl:
            self.jsonl.close()
        if self.tb is not None:
            self.tb.close()


def _plain(v):
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)
    return v
