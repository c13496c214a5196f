"""XLA:GPU's own estimate of a step's time, read from its latency-hiding scheduler.

With verbose logging of ``latency_hiding_scheduler`` on, XLA:GPU prints per scheduled
computation the "Total cycles" of its cost model (microseconds; nothing runs) and the "Wasted
cycles" per collective kind (waits with nothing to overlap them); a ``while`` body runs its trip
count times. An estimate for comparing programs for one target, not a measurement: see
docs/gpu_compile.md ("Estimated step time") for what it leaves out (``uncosted`` loops). The
logging has to be on before jax starts: ``enable()`` sets it for a process about to start;
``capture()`` collects what one compile prints, keeping it off the terminal.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import functools
import math
import os
import re
import sys
import tempfile
import threading
import types

from zeroflow.util import xla_log
from zeroflow.xla import hlo

# Re-exported: the environment is set before jax starts (zeroflow.util.xla_log).
LOG_ENV, enable, enabled = xla_log.LOG_ENV, xla_log.enable, xla_log.enabled

_BLOCK = "Statistics after scheduling:"
_MODULE = re.compile(r"^HloModule ([\w.\-]+)", re.M)
_ASYNC_COMPUTE = re.compile(r" (?:fusion|call)-start\(")
"An asynchronous computation that is not a collective or a copy (its start)."
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
    "Loop bodies XLA printed no statistics for (no asynchronous collective in them), and the"
    " computations its figure for is a placeholder (an asynchronous fusion; see ``parse``)."

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
    loop is costed (a lower bound); it stays listed in ``uncosted``. So does a computation that
    starts an asynchronous fusion (newer XLA:GPU runs a loop's dynamic slice on the side):
    XLA's latency estimator has no model of those and charges each its fixed 5,000-cycle
    placeholder, a computation's whole estimate for a 2 KB copy: such a computation keeps the
    collective waits XLA's schedule exposes, and its matmuls are costed as an uncosted loop's.
    Statistics of other modules (XLA schedules some fusions as modules of their own while it
    compiles the step) are not the step's and are left out."""
    module = _MODULE.search(hlo_text)
    stats = {}  # by computation: the last block printed for it
    for block in log_text.split(_BLOCK)[1:]:
        block = block.split("Statistics before scheduling")[0]
        name = re.search(r"For computation: ([^,\s]+)(?:, module ([\w.\-]+))?", block)
        if name is not None and not (module and name[2] and name[2] != module[1]):
            values = {k: float(v) for k, v in _STAT.findall(block)}
            prefix = "Wasted cycles for "
            wasted = {k.removeprefix(prefix): v for k, v in values.items() if k.startswith(prefix)}
            stats[name[1]] = (values.get("Total cycles", 0.0), wasted)
    bodies = hlo.computations(hlo_text)
    runs = hlo.runs(bodies, hlo.entry(hlo_text))
    placeholder = {n for n in stats if any(map(_ASYNC_COMPUTE.search, bodies.get(n, ())))}
    comps = []
    for comp, (total, printed) in stats.items():
        waits = {k: v for k, v in printed.items() if v}
        # A placeholder's computation keeps its exposed collectives; its compute is costed below.
        total = sum(waits.values()) if comp in placeholder else total
        comps.append(Computation(comp, runs.get(comp, 1), total, waits))
    trips, unknown = loop_trips(hlo_text)
    uncosted = tuple(sorted((set(trips) | unknown) - {c.name for c in comps} | placeholder))
    if peak_flops and uncosted:
        costed = [c for c in comps if c.name not in placeholder]
        by_flops = {
            c.name: c for c in _cost_by_flops(uncosted, costed, bodies, trips, runs, peak_flops)
        }
        comps = [_plus(c, by_flops.pop(c.name, None)) for c in comps] + list(by_flops.values())
    return StepTime(tuple(comps), uncosted)


def _plus(waits: Computation, compute: Computation | None) -> Computation:
    """A placeholder's computation: its exposed collectives, plus its matmuls costed by flops."""
    if compute is None:
        return waits
    return dataclasses.replace(
        compute, total_us=waits.total_us + compute.total_us, wasted_us=waits.wasted_us
    )


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


_CALLED = re.compile(r"calls=\{?([%\w.\-, ]+)\}?")
_DOT = re.compile(r" dot\(%([\w.\-]+).*lhs_contracting_dims=\{([\d,]*)\}")


def gemm_flops(bodies: dict, name: str) -> float:
    """Matmul flops of one run of computation ``name`` and of the fusions it calls (not of
    loops inside it): 2 x output elements x contracted size per ``dot``."""
    lines = [m for comp in bodies.values() for m in map(hlo.INSTRUCTION.match, comp) if m]
    dims = {m["name"]: hlo.type_tree(m["type"]) for m in lines}
    dims = {k: t[1] for k, t in dims.items() if isinstance(t, tuple)}  # arrays' dimensions

    @functools.cache
    def of(comp: str) -> float:
        total = 0.0
        for line in bodies.get(comp, ()):
            called, dot, out = _CALLED.search(line), _DOT.search(line), hlo.INSTRUCTION.match(line)
            if called:  # each call site runs its computation once
                total += sum(of(c.strip().lstrip("%")) for c in called[1].split(","))
            if dot and out and dot[1] in dims and out["name"] in dims:
                contracted = math.prod(dims[dot[1]][int(d)] for d in dot[2].split(",") if d)
                total += 2.0 * math.prod(dims[out["name"]]) * contracted
        return total

    return of(name)


@contextlib.contextmanager
def capture():
    """Collect what XLA prints to the process's stderr (file descriptor 2) inside the block:
    ``with capture() as log: compiled = lowered.compile()``, then ``log.text``. Warnings and
    errors among it are printed again afterwards; XLA's informational lines are dropped."""
    log = types.SimpleNamespace(text="")
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


NOT_ENABLED = (
    "XLA:GPU's step estimate needs the process started with TF_CPP_MIN_LOG_LEVEL=0 "
    "TF_CPP_VMODULE=latency_hiding_scheduler=1 (XLA reads them at start-up; "
    "zeroflow.xla.schedule.enable(env) sets them for a subprocess)"
)


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
