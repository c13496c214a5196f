"""XLA:GPU's own estimate of a step's time, read from its latency-hiding scheduler.

When XLA:GPU schedules a program it models every instruction's time on the target GPU (an
analytical cost model: no autotuning, nothing runs) and, with verbose logging of
``latency_hiding_scheduler`` on, prints per scheduled computation ("For computation: NAME"):
"Total cycles" (microseconds in its model) and "Wasted cycles" per collective kind (time the
schedule waits for a collective with nothing to overlap it). A ``while`` body (a ``lax.scan``)
is its own computation and runs its trip count times, so the step's estimate is the entry
computation's plus each loop body's times its trip count (``known_trip_count`` in the HLO).

What it is not: a measurement. It is the scheduler's model of the target (H100 figures for an
H100 target), useful to compare two programs for the same target side by side; kernel choices
that autotuning would make on a real GPU are not in it. A computation with no asynchronous
collective prints no statistics: those loops (a stage 0-2 forward pass, an optimizer update
walked slice by slice) are listed in ``uncosted``; ``parse(..., peak_flops=...)`` costs them
from their matmul flops (see there), otherwise they are left out of ``step_us``.

The logging has to be on before JAX starts (it is read when XLA's logging initialises):
``enable()`` sets it in ``os.environ`` for a process about to start, and the memory CLI starts
itself again with it when asked for a target. ``capture()`` then collects what one compile
prints, keeping it off the terminal.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import math
import os
import re
import sys
import tempfile
import threading

from zeroflow.backend import accelerators
from zeroflow.memory import hlo
from zeroflow.util import xla_log

# Re-exported: the environment is set before jax starts (zeroflow.util.xla_log).
LOG_ENV, enable, enabled = xla_log.LOG_ENV, xla_log.enable, xla_log.enabled

_BLOCK = "Statistics after scheduling:"
_STAT = re.compile(r"\] (Total wasted cycles|Wasted cycles for [\w-]+|Total cycles): ([-\d.e+]+)")


@dataclasses.dataclass(frozen=True)
class Computation:
    """One scheduled computation's statistics, in microseconds of XLA's model."""

    name: str
    trips: int
    "How many times it runs per step (a loop body's trip count; 1 for the entry)."
    total_us: float
    wasted_us: dict
    "Wasted (exposed) time per collective kind, e.g. {'all-gather': 12.5}."
    costed_by: str = "xla"
    "'xla' (the scheduler's statistics), or for a loop it printed nothing for, its matmul flops"
    " at XLA's time per flop in the program's costed loops ('scaled-flops') or at the dense peak"
    " ('peak-flops'); see ``parse``."


@dataclasses.dataclass(frozen=True)
class StepTime:
    """XLA:GPU's estimate of one step (an estimate, not a measurement; see the module doc)."""

    computations: tuple
    uncosted: tuple
    "Loop bodies XLA printed no statistics for (no asynchronous collective in them)."

    @property
    def step_us(self) -> float:
        return sum(c.total_us * c.trips for c in self.computations)

    @property
    def step_ms(self) -> float:
        return self.step_us / 1e3

    def exposed_us(self, kind: str | None = None) -> float:
        """Exposed collective time per step, of one kind ('all-gather', 'reduce-scatter',
        'all-reduce', 'all-to-all', ...) or of all."""
        return sum(
            c.trips * sum(v for k, v in c.wasted_us.items() if kind in (None, k))
            for c in self.computations
        )

    def exposed_by_kind(self) -> dict:
        kinds = sorted({k for c in self.computations for k in c.wasted_us})
        return {k: self.exposed_us(k) for k in kinds if self.exposed_us(k) > 0}

    def mfu(self, model_flops: float, peak_flops: float) -> float:
        """Model flops per second at this step time over the device's peak."""
        return model_flops / (self.step_us * 1e-6) / peak_flops


def loop_trips(hlo_text: str) -> tuple[dict, set]:
    """``({body name: trip count}, {bodies whose count XLA does not know})`` of every ``while``
    in a compiled module's text."""
    trips, unknown = {}, set()
    for line in hlo_text.splitlines():
        body = re.search(r" while\(.*\bbody=%?([\w.\-]+)", line)
        n = re.search(r'known_trip_count"?:\{"n":"(\d+)"', line)
        if body and n:
            trips[body[1]] = int(n[1])
        elif body:
            unknown.add(body[1])
    return trips, unknown


def parse(log_text: str, hlo_text: str, peak_flops: float | None = None) -> StepTime:
    """The step estimate from what a compile printed (``log_text``) and the compiled module's
    text (``compiled.as_text()``), which gives the loops' trip counts. A loop nested in a loop
    runs the product of their counts. With ``peak_flops`` (the GPU's dense bf16 peak), a loop
    XLA printed nothing for (no asynchronous collective inside) is costed from its matmuls'
    flops, at the time per flop XLA's model gave the program's costed loops (the same layers'
    matmuls: a stage-2 forward loop beside its costed backward loop), or at the peak where no
    loop is costed (a lower bound); it stays listed in ``uncosted``."""
    stats = {}  # by computation: the last block printed for it
    for block in log_text.split(_BLOCK)[1:]:
        block = block.split("Statistics before scheduling")[0]
        name = re.search(r"For computation: ([^,\s]+)", block)
        if name is not None:
            values = {k: float(v) for k, v in _STAT.findall(block)}
            prefix = "Wasted cycles for "
            wasted = {k.removeprefix(prefix): v for k, v in values.items() if k.startswith(prefix)}
            stats[name[1]] = (values.get("Total cycles", 0.0), wasted)
    bodies = computations_of(hlo_text)
    runs = hlo.runs(bodies, hlo.entry(hlo_text))
    comps = [
        Computation(name, runs.get(name, 1), total, {k: v for k, v in wasted.items() if v})
        for name, (total, wasted) in stats.items()
    ]
    trips, unknown = loop_trips(hlo_text)
    uncosted = tuple(sorted((set(trips) | unknown) - {c.name for c in comps}))
    if peak_flops and uncosted:
        comps += _cost_by_flops(uncosted, comps, bodies, trips, runs, peak_flops)
    return StepTime(tuple(comps), uncosted)


def _cost_by_flops(uncosted, costed, bodies, trips, runs, peak_flops) -> list:
    """Uncosted loops at their matmul flops, at the microseconds per flop XLA's model gave the
    costed loops of the same program (the same layers' matmuls, 'scaled-flops'), else at the
    GPU's dense peak ('peak-flops', a lower bound)."""
    loops = [
        (c.total_us * c.trips, gemm_flops(bodies, c.name) * c.trips)
        for c in costed
        if c.name in trips
    ]
    us, flops = sum(u for u, f in loops if f), sum(f for _, f in loops)
    per_flop, how = (us / flops, "scaled-flops") if flops else (1e6 / peak_flops, "peak-flops")
    return [
        Computation(name, runs.get(name, 1), gemm_flops(bodies, name) * per_flop, {}, how)
        for name in uncosted
    ]


_DEFINED = re.compile(r"^\s*(?:ROOT )?%([\w.\-]+) = [\w]+\[([\d,]*)\]")
_CALLED = re.compile(r"calls=\{?([%\w.\-, ]+)\}?")


def computations_of(hlo_text: str) -> dict:
    """``{computation name: its lines}`` of a module's text."""
    return hlo.computations(hlo_text)


def gemm_flops(bodies: dict, name: str) -> float:
    """Matmul flops of one run of computation ``name`` and of the fusions it calls (not of
    loops inside it): 2 x output elements x contracted size per ``dot``."""
    shapes = {}
    for lines in bodies.values():
        for line in lines:
            found = _DEFINED.match(line)
            if found:
                shapes[found.group(1)] = [int(d) for d in found.group(2).split(",") if d]
    memo = {}

    def of(comp: str, path: tuple) -> float:
        if comp not in memo:
            total = 0.0
            for line in bodies.get(comp, ()):
                called = _CALLED.search(line)
                if called:  # each call site runs its computation once
                    total += sum(
                        of(c.strip().lstrip("%"), path + (comp,))
                        for c in called.group(1).split(",")
                        if c.strip() not in path
                    )
                if " dot(" in line:
                    total += _dot_flops(line, shapes)
            memo[comp] = total
        return memo[comp]

    return of(name, ())


def _dot_flops(line: str, shapes: dict) -> float:
    out = _DEFINED.match(line)
    lhs = re.search(r" dot\(%([\w.\-]+)", line)
    dims = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", line)
    if not (out and lhs and dims) or lhs.group(1) not in shapes:
        return 0.0
    contracted = math.prod(shapes[lhs.group(1)][int(d)] for d in dims.group(1).split(",") if d)
    return 2.0 * math.prod(int(d) for d in out.group(2).split(",") if d) * contracted


@contextlib.contextmanager
def capture():
    """Collect what XLA prints to the process's stderr (file descriptor 2) inside the block:
    ``with capture() as log: compiled = lowered.compile()``, then ``log.text``. Warnings and
    errors among it are printed again afterwards; XLA's informational lines are dropped."""
    log = _Captured()
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile(mode="w+b") as tmp:
        os.dup2(tmp.fileno(), 2)
        try:
            yield log
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            tmp.seek(0)
            log.text = tmp.read().decode(errors="replace")
    kept = [
        line
        for line in log.text.splitlines()
        if line.startswith(("W", "E", "F"))
        and not line.startswith("WARNING: All log")
        or line.startswith(("Traceback", "  File"))
    ]
    if kept:
        print("\n".join(kept), file=sys.stderr)


_INFO_LINE = re.compile(
    rb"^(I\d{4} |WARNING: All log messages before absl::InitializeLog"
    # XLA's own notes that change nothing of the answer: its rematerialisation pass could not
    # reach a memory limit it sets itself, and a debug frame index it could not resolve.
    rb"|[WE]\d{4} .*(Can't reduce memory use below|Invalid stack_frame_id))"
)


def drop_info_lines() -> None:
    """From now on, XLA's informational lines (``I0000 ...``, which the statistics' log level
    also lets through, from backend start-up for instance) and its notes that change nothing
    of the answer (``_INFO_LINE``) are dropped from this process's stderr; everything else
    passes. For a process started with ``LOG_ENV``."""
    sys.stderr.flush()
    read, write = os.pipe()
    terminal = os.dup(2)
    os.dup2(write, 2)
    os.close(write)

    def pump():
        with os.fdopen(read, "rb") as src, os.fdopen(terminal, "wb", buffering=0) as dst:
            for line in src:
                if not _INFO_LINE.match(line):
                    dst.write(line)

    thread = threading.Thread(target=pump, name="drop-xla-info", daemon=True)
    thread.start()

    def finish():  # the pipe's last writer closes, the pump reads to the end
        sys.stderr.flush()
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 2)
        os.close(devnull)
        thread.join(timeout=5)

    atexit.register(finish)


class _Captured:
    text = ""


NOT_ENABLED = (
    "XLA:GPU's step estimate needs the process started with TF_CPP_MIN_LOG_LEVEL=0 "
    "TF_CPP_VMODULE=latency_hiding_scheduler=1 (XLA reads them at start-up; "
    "zeroflow.memory.schedule.enable(env) sets them for a subprocess)"
)


def peak_bf16_flops(device_kind: str) -> float | None:
    """The dense bf16 peak of a GPU from its device kind ('NVIDIA H100 80GB HBM3'), or None
    (``zeroflow.backend.accelerators``)."""
    return accelerators.peak_flops(device_kind, "bf16")


def timed(compile_fn, text_of=lambda compiled: compiled.as_text(), peak_flops=None):
    """``(compile_fn()'s result, StepTime)``, or a one-line ``RuntimeError`` saying what to set
    when this process was not started with the statistics on, or what to compile for when the
    compile printed none (only XLA:GPU schedules with this model). ``text_of`` gives the
    compiled module's text from the result."""
    if not enabled():
        raise RuntimeError(NOT_ENABLED)
    with capture() as log:
        result = compile_fn()
    if _BLOCK not in log.text:
        if os.environ.get("JAX_COMPILATION_CACHE_DIR") and os.environ.get(
            "JAX_ENABLE_COMPILATION_CACHE", "true"
        ).lower() not in ("0", "false"):
            raise RuntimeError(
                "no schedule statistics were printed: the program may have come from jax's "
                "persistent compilation cache; set JAX_ENABLE_COMPILATION_CACHE=false"
            )
        raise RuntimeError(
            "no schedule statistics were printed: XLA:GPU's estimate needs a "
            "step compiled for GPUs (a zf.target_mesh or GPU devices)"
        )
    return result, parse(log.text, text_of(result), peak_flops)
