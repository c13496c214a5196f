"""One plan compiled by XLA for where it runs: its device peak and host memory (XLA's memory
analysis) and on GPUs XLA:GPU's step estimate (``zeroflow.xla.schedule``). Compiles share one
kernel cache per GPU target and cheap kernel code generation, which change no HLO, schedule or
buffer (docs/planner.md, "Compiles are shared"). XLA:GPU costs no computation without an
asynchronous collective: those loops are costed at their matmul flops at XLA's time per flop
for the program, else for the GPU (``Rates``), else at the dense peak (a lower bound)."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import time

from zeroflow.memory.measure import analysed, device_peak
from zeroflow.planner.choices import XLA_FAILURE_TEXT, Choice
from zeroflow.planner.where import Where
from zeroflow.xla import hlo, schedule
from zeroflow.xla.collectives import collectives, overlap

CODEGEN_OPTIONS = {
    "xla_gpu_disable_gpuasm_optimizations": True,
    "xla_llvm_disable_expensive_passes": True,
}
"Options that change only how XLA:GPU generates kernel code (ptxas at -O0, fewer LLVM passes)."


@dataclasses.dataclass(frozen=True)
class Measured:
    """What XLA's compile of one plan says."""

    peak_bytes: float
    "Device memory per device (XLA's memory analysis, offloaded state left out on XLA:CPU)."
    host_bytes: float
    "XLA's host-memory buffers per device (offloaded state and activations; 0 on XLA:CPU)."
    compile_s: float
    xla_us: float = 0.0
    "Step time of the computations XLA's scheduler costed, in its microseconds."
    uncosted_flops: float = 0.0
    "Matmul flops per step of the loops it printed nothing for."
    own_us_per_flop: float | None = None
    "XLA's time per matmul flop in this program's costed loops."
    exposed_us: dict = dataclasses.field(default_factory=dict)
    "Time the schedule waits on each kind of collective."
    timed: bool = False
    "Whether XLA:GPU's scheduler estimate was read (a GPU compile with its logging on)."
    overlap: dict | None = None
    "``zeroflow.xla.collectives.overlap`` of the compiled step, where asked for."

    def step_ms(self, rates: Rates, where: Where) -> float | None:
        """XLA's step estimate, the loops it did not cost at the best time per flop known."""
        if not self.timed or not (self.xla_us or self.uncosted_flops):
            return None  # not a GPU compile, or XLA printed nothing this could cost
        per_flop, _ = self.flop_rate(rates, where)
        return (self.xla_us + self.uncosted_flops * per_flop) / 1e3

    def step(self, rates: Rates, where: Where, flops: float | None) -> tuple:
        """``(ms, costed by, MFU)`` of XLA's estimate, ``(None, 'what-if', None)`` without one.
        An MFU over 1 says XLA's cost model left work out (custom calls such as cuDNN
        attention): the model's ``flops`` at the dense peak bound the step instead, costed by
        'model-flops', with no MFU."""
        ms = self.step_ms(rates, where)
        if ms is None:
            return None, "what-if", None
        mfu = None if flops is None else flops / where.devices / (ms / 1e3) / where.peak_flops
        if mfu is not None and mfu > 1:
            return ms * mfu, "model-flops", None
        return ms, self.costed_by(rates, where), mfu

    def flop_rate(self, rates: Rates, where: Where) -> tuple[float, str]:
        """(microseconds per flop, how): this program's, the target's, or its peak's."""
        if self.own_us_per_flop is not None:
            return self.own_us_per_flop, "xla"
        known = rates.us_per_flop.get(where.name)
        if known is not None:
            return known, "xla-target"
        return 1e6 / where.peak_flops, "peak"

    def costed_by(self, rates: Rates, where: Where) -> str:
        """'xla': every loop costed by XLA's scheduler or at its own time per flop;
        'xla-target': some at XLA's time per flop for this GPU in another program;
        'peak': some at the dense peak (a lower bound)."""
        return "xla" if not self.uncosted_flops else self.flop_rate(rates, where)[1]


@dataclasses.dataclass
class Rates:
    """XLA's time per matmul flop in costed loops, per GPU target, across compiles."""

    us_per_flop: dict = dataclasses.field(default_factory=dict)


class Compiler:
    """Compiles plans of one problem, sharing kernels and results (see the module doc)."""

    def __init__(self, cache_dir: str, overlaps: bool = False):
        self.cache_dir, self.overlaps = cache_dir, overlaps
        self.rates = Rates()
        self.results: dict = {}
        self.compile_seconds = 0.0
        self.compiles = 0

    def options(self, where: Where) -> dict:
        if not where.is_gpu:
            return {}
        kernels = os.path.join(self.cache_dir, f"{where.name}.kernels")
        return {"xla_gpu_kernel_cache_file": kernels, **CODEGEN_OPTIONS}

    def peak_elsewhere(self, problem, choice: Choice, where: Where) -> tuple[float, str] | None:
        """The smallest peak XLA compiled for ``problem``'s ``choice`` on the same device count
        and hosts of another GPU, with that GPU's name; None where there is none."""
        mine, same = problem_key(problem), (where.devices, where.hosts, False)
        seen = [
            (got.peak_bytes, other.name)
            for (key, other, c), got in self.results.items()
            if (key, c) == (mine, choice)
            and isinstance(got, Measured)
            and other.name != where.name
            and (other.devices, other.hosts, other.local) == same
        ]
        return min(seen, default=None)

    def measure(self, problem, choice: Choice, where: Where) -> Measured | str:
        """XLA's figures for ``choice`` at ``where``, or the one-line reason it did not
        compile."""
        key = (problem_key(problem), where, choice)
        if key not in self.results:
            self.results[key] = self._compile(problem, choice, where)
        return self.results[key]

    def _compile(self, problem, choice: Choice, where: Where) -> Measured | str:
        start = time.perf_counter()
        timed = where.is_gpu and schedule.enabled()
        try:
            with schedule.capture() if timed else contextlib.nullcontext() as log:
                compiled, state = problem.compile(choice, where, self.options(where))
            got = analysed(compiled)
        except Exception as e:  # a plan that cannot compile is a row with its reason
            return failure_reason(e)
        finally:
            self.compiles += 1
            self.compile_seconds += time.perf_counter() - start
        measured = Measured(
            peak_bytes=float(device_peak(got, state)),
            host_bytes=float(got.host_total_bytes),
            compile_s=time.perf_counter() - start,
            overlap=overlap(collectives(compiled)) if self.overlaps else None,
        )
        if not timed or log is None:
            return measured
        est = schedule.parse(log.text, compiled.as_text())
        xla_us, uncosted, own = step_parts(est, compiled.as_text())
        measured = dataclasses.replace(
            measured,
            xla_us=xla_us,
            uncosted_flops=uncosted,
            own_us_per_flop=own,
            exposed_us=est.exposed_by_kind(),
            timed=True,
        )
        # XLA's time per flop for a GPU: the fastest of programs whose loops wait on no host copy
        if own is not None and choice.offload == "none" and choice.remat != "offload_dots":
            self.rates.us_per_flop[where.name] = min(
                self.rates.us_per_flop.get(where.name, own), own
            )
        return measured


def problem_key(problem) -> object:
    """What keeps two problems' compiles of one plan apart: the problem's ``key`` where it has
    one (a config), else the problem itself (a model given as a loss, alive for its search)."""
    return getattr(problem, "key", problem)


def step_parts(est: schedule.StepTime, text: str) -> tuple[float, float, float | None]:
    """``(microseconds XLA's scheduler costed, matmul flops per step of the loops it did not,
    XLA's microseconds per flop in its costed loops less their exposed collectives)`` of the
    compiled module ``text`` and its estimate ``est`` (``schedule.parse`` without a peak: no
    loop costed by flops); the last is None where no costed loop has a matmul."""
    bodies, entry = hlo.computations(text), hlo.entry(text)
    runs, (trips, _) = hlo.runs(bodies, entry), schedule.loop_trips(text)
    loops = [(c, schedule.gemm_flops(bodies, c.name) * c.trips) for c in est.computations]
    loops = [(c, f) for c, f in loops if f and c.name in trips and c.name not in est.uncosted]
    flops = sum(f for _, f in loops)
    compute_us = sum((c.total_us - sum(c.wasted_us.values())) * c.trips for c, _ in loops)
    uncosted = sum(schedule.gemm_flops(bodies, n) * runs.get(n, 1) for n in est.uncosted)
    # Without any collective (one device) XLA prints nothing for the entry computation either:
    # its own matmuls (a vocabulary projection outside the layer loop) are costed by flops too.
    costed = {c.name for c in est.computations} | set(est.uncosted)
    if entry is not None and entry not in costed:
        uncosted += schedule.gemm_flops(bodies, entry)
    return (
        sum(c.total_us * c.trips for c in est.computations),
        uncosted,
        compute_us / flops if flops else None,
    )


def failure_reason(error: Exception) -> str:
    """One line for a plan XLA or the engine refused: XLA's known failures in words, else the
    error's first line."""
    text = str(error)
    for key, reason in XLA_FAILURE_TEXT.items():
        if key in text:
            return reason
    first = text.strip().splitlines()[0] if text.strip() else ""
    if len(first) > 160:  # XLA may append whole shapes: cut at the first
        first = re.split(r"\s\(?\w+\[[\d,]*\]", first, maxsplit=1)[0][:157] + " ..."
    return f"{type(error).__name__}: {first}"
