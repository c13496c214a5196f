"""The bounded search of one row (one GPU x device count), as docs/planner.md "How it searches"
tells it: the what-if of every choice (those whose state alone cannot fit, or that XLA is known
to refuse, never compiled), then compiles in the what-if's order until one fits and no open plan
could beat it, a plan over the memory ruling out every plan that needs more. A failed compile is
kept with its reason and not counted against ``max_compiles``; ``MAX_FAILURES`` end the row.
FP8 residuals approximate the gradients, so such a plan waits until the same plan in the compute
dtype is expected not to fit, and never beats it where it fits. FP8 matmuls (asked for) compete
on speed: where one is the pick, the same plan without them is compiled too (XLA's estimate
decides), and they never win a tie."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from zeroflow.memory.estimate import format_bytes
from zeroflow.planner.choices import Choice, Space, enumerate_choices, known_failure, needs_more
from zeroflow.planner.compiling import Compiler, Measured
from zeroflow.planner.whatif import WhatIf, what_if
from zeroflow.planner.where import Where
from zeroflow.util.settings import MAX_FAILED_COMPILES

OPEN, COMPILED, FAILED = "open", "compiled", "failed"
EXPLORE = 1.3
"A plan of an untried stage / offload goes before a tried one up to this much slower (what-if)."
MAX_FAILURES = MAX_FAILED_COMPILES
CANNOT_FIT, SKIPPED, RULED_OUT, NOT_COMPILED = "cannot fit", "skipped", "ruled out", "not compiled"
HELD_BACK = (
    "FP8 residuals: tried only where the same plan in the compute dtype does not fit, which "
    "no compile showed"
)
OTHER_GPU_SPREAD = 0.05
"A peak this far over a GPU's usable memory on another GPU rules the plan out without a compile"
" (XLA:GPU's buffers hardly depend on the GPU: gpt-1b's plans on H100 and A100, within 0.3%)."


@dataclasses.dataclass
class Candidate:
    choice: Choice
    what_if: WhatIf
    status: str = OPEN
    reason: str = ""
    measured: Measured | None = None

    @property
    def got(self) -> Measured:
        if self.measured is None:
            raise ValueError(f"{self.choice.label()} was not compiled")
        return self.measured

    def record(self, got: Measured | str) -> Measured | None:
        """Keep a compile's figures, or the one-line reason it failed (then None)."""
        if isinstance(got, str):
            self.status, self.reason = FAILED, got
            return None
        self.status, self.measured = COMPILED, got
        return got

    def host_bytes(self, per_process: int) -> float:
        """Pinned host memory per process of ``per_process`` devices: XLA's host buffers
        where it reports them, else the what-if's."""
        if self.measured is not None and self.measured.host_bytes:
            return self.measured.host_bytes * per_process
        return self.what_if.host_bytes


@dataclasses.dataclass
class Row:
    """One GPU x device count: every candidate with what became of it, and the best."""

    where: Where
    usable_bytes: float
    candidates: list[Candidate]
    best: Candidate | None = None
    notes: list[str] = dataclasses.field(default_factory=list)
    gpu_notes: tuple[str, ...] = ()
    "What its GPU cannot run (``Space.notes``)."
    scale: float = 1.0
    "The last compile's ratio of XLA's peak to the formula's."

    def compiled(self) -> list[Candidate]:
        return [c for c in self.candidates if c.status == COMPILED]

    def failures(self) -> int:
        return sum(c.status == FAILED for c in self.candidates)

    def fits(self, cand: Candidate) -> bool:
        return cand.measured is not None and cand.measured.peak_bytes <= self.usable_bytes


def candidates_for(problem, where: Where, space: Space, usable: float) -> list[Candidate]:
    """Every choice of ``space`` at ``where`` with its what-if, those that cannot fit or that
    XLA refuses marked."""
    out = []
    for choice in enumerate_choices(
        space, where.devices, problem.batch_size, where.hosts, problem.spec.precision
    ):
        est = what_if(problem, choice, where)
        cand = Candidate(choice, est)
        refused = known_failure(choice, where.is_gpu)
        if est.floor_bytes > usable:
            cand.status = CANNOT_FIT
            cand.reason = (
                f"the state alone needs {format_bytes(est.floor_bytes)} per device by the ZeRO "
                f"formula, over the {format_bytes(usable)} usable"
            )
        elif refused:
            cand.status, cand.reason = SKIPPED, refused
        out.append(cand)
    out.sort(key=lambda c: (c.what_if.prior_s, c.what_if.predicted_bytes))
    return out


def search_row(
    problem,
    where: Where,
    space: Space,
    compiler: Compiler,
    *,
    margin: float,
    max_compiles: int,
    min_compiles: int,
    max_failures: int = MAX_FAILURES,
    on_compile: Callable[[str], None] | None = None,
) -> Row:
    usable = where.memory_bytes * (1 - margin)
    row = Row(where, usable, candidates_for(problem, where, space, usable), gpu_notes=space.notes)
    scale, done = 1.0, 0
    while done < max_compiles and row.failures() < max_failures:
        nxt = _next(row, scale, compiler)
        if nxt is None:
            break
        if _too_big_elsewhere(problem, row, nxt, compiler):
            continue
        got = _compile(problem, row, nxt, compiler, on_compile)
        if got is None:  # failed: reported, not counted (see the module doc)
            continue
        done += 1
        if nxt.what_if.predicted_bytes > 0:
            scale = row.scale = got.peak_bytes / nxt.what_if.predicted_bytes
        if not row.fits(nxt):
            _rule_out_bigger(row, nxt, got.peak_bytes)
        elif done >= min_compiles and _cannot_be_beaten(row, compiler, scale):
            break
    if row.failures() < max_failures:
        _last_resort(problem, row, compiler, on_compile)
        _against_its_twin(problem, row, compiler, on_compile)
    held = _held_back(row)
    for cand in row.candidates:
        if cand.status == OPEN:
            cand.status = NOT_COMPILED
            cand.reason = (
                HELD_BACK if id(cand) in held else "the what-if ranks it below the plans compiled"
            )
    row.best = best_of(row, compiler)
    return row


def _last_resort(problem, row: Row, compiler: Compiler, on_compile) -> None:
    """Where nothing compiled fits (the faster plans tried first may all have missed by a
    little): compile the plainest open plan the formula predicts to fit, the state on the
    device and no ZeRO++ first, else the one it predicts smallest. Plain plans first, as
    XLA:GPU fails on some combinations of host offload and ZeRO++ (8 x L4, Llama 3.1 8B:
    IndexError in its compile)."""
    open_ = _unfailed_kernels(row, _open(row))
    if best_of(row, compiler) is not None or not open_:
        return

    def plainness(c: Candidate) -> tuple:
        extras = sum(on for _, on in c.choice.zeropp_names())
        fits = c.what_if.predicted_bytes <= row.usable_bytes
        return (not fits, fits and c.choice.offload != "none", extras, c.what_if.predicted_bytes)

    _compile(problem, row, min(open_, key=plainness), compiler, on_compile)


def _against_its_twin(problem, row: Row, compiler: Compiler, on_compile) -> None:
    """Where the pick has FP8 matmuls, compile the same plan without them if still open: XLA's
    estimate, not the roofline's, then says whether FP8 is faster."""
    best = best_of(row, compiler)
    twin = best and best.choice.fp8_matmuls() and best.choice.without_fp8_matmuls()
    same = [c for c in row.candidates if c.choice == twin and c.status == OPEN]
    if same:
        _compile(problem, row, same[0], compiler, on_compile)


def _compile(problem, row: Row, cand: Candidate, compiler: Compiler, on_compile):
    """Compile ``cand``: its figures, or None where it failed (its reason kept)."""
    if on_compile:
        on_compile(f"{row.where.title}: {cand.choice.label()}")
    return cand.record(compiler.measure(problem, cand.choice, row.where))


def _open(row: Row) -> list[Candidate]:
    """The open candidates the search may compile now: not those held back (``_held_back``)."""
    held = _held_back(row)
    return [c for c in row.candidates if c.status == OPEN and id(c) not in held]


def _held_back(row: Row) -> set[int]:
    """The candidates (ids) with FP8 residuals whose same plan in the compute dtype, in this
    row, may fit: compiled and fitting, or open and predicted to fit (the formula scaled by
    the last compile's ratio), or skipped or failed (no memory said it cannot fit)."""
    by_choice = {c.choice: c for c in row.candidates}
    twins = [(c, by_choice.get(c.choice.in_compute_dtype())) for c in row.candidates]
    return {
        id(c) for c, twin in twins if c.choice.fp8_residuals() and twin and not _over(row, twin)
    }


def _over(row: Row, cand: Candidate) -> bool:
    """Whether ``cand`` is expected not to fit: compiled over the memory, ruled out, its state
    alone too big, or (open) predicted over by the scaled formula."""
    if cand.status == COMPILED:
        return not row.fits(cand)
    if cand.status == OPEN:
        return cand.what_if.predicted_bytes * row.scale > row.usable_bytes
    return cand.status in (RULED_OUT, CANNOT_FIT)


def _likely(row: Row, scale: float) -> list[Candidate]:
    """Open candidates the formula, scaled by the last compile's ratio, predicts to fit."""
    return [c for c in _open(row) if c.what_if.predicted_bytes * scale <= row.usable_bytes]


def _next(row: Row, scale: float, compiler: Compiler) -> Candidate | None:
    """The fastest open candidate the formula (scaled) predicts to fit, preferring, within
    ``EXPLORE`` of it, one whose stage and offload no compile has tried yet (the what-if's
    near-ties are for XLA to break); where none is predicted to fit and nothing compiled fits,
    the one the formula predicts smallest. Plans of an attention kernel that failed to compile
    come last."""
    open_ = _unfailed_kernels(row, _open(row))
    kept = {id(c) for c in open_}
    likely = [c for c in _likely(row, scale) if id(c) in kept]
    if likely:
        tried = {_family(c.choice) for c in row.candidates if c.status in (COMPILED, FAILED)}
        near = [c for c in likely if c.what_if.prior_s <= likely[0].what_if.prior_s * EXPLORE]
        fresh = [c for c in near if _family(c.choice) not in tried]
        return (fresh or likely)[0]
    if open_ and best_of(row, compiler) is None:  # the one likeliest to fit
        return min(open_, key=lambda c: c.what_if.predicted_bytes)
    return None


def _unfailed_kernels(row: Row, cands: list[Candidate]) -> list[Candidate]:
    """``cands`` less those of an attention kernel a compile of this row failed with, unless
    that leaves none."""
    failed = {c.choice.attention for c in row.candidates if c.status == FAILED}
    return [c for c in cands if c.choice.attention not in failed] or cands


def _family(choice: Choice) -> tuple:
    return (choice.stage, choice.offload, choice.update_on)


def _rule_out_bigger(row: Row, than: Candidate, peak: float, on: str = "") -> None:
    """Every open plan needing at least the memory of ``than``, whose peak was ``peak``."""
    why = f"needs at least the {format_bytes(peak)} XLA compiled for {than.choice.label()}{on}"
    for cand in row.candidates:
        if cand.status == OPEN and (cand is than or needs_more(cand.choice, than.choice)):
            cand.status, cand.reason = RULED_OUT, why


def _too_big_elsewhere(problem, row: Row, cand: Candidate, compiler: Compiler) -> bool:
    """Rule ``cand`` out, and every plan needing more, where XLA compiled it for another GPU
    of the same device count with a peak ``OTHER_GPU_SPREAD`` over this row's usable memory."""
    seen = compiler.peak_elsewhere(problem, cand.choice, row.where)
    if seen is None or seen[0] <= row.usable_bytes * (1 + OTHER_GPU_SPREAD):
        return False
    _rule_out_bigger(row, cand, seen[0], f" on {seen[1]}")
    return True


def step_seconds(cand: Candidate, compiler: Compiler, where: Where) -> float:
    """XLA's step estimate where there is one, else the what-if's."""
    ms = cand.measured.step_ms(compiler.rates, where) if cand.measured else None
    return cand.what_if.prior_s if ms is None else ms / 1e3


def best_of(row: Row, compiler: Compiler) -> Candidate | None:
    """The fitting plan with the shortest step, on a tie one without FP8 matmuls; never one
    with FP8 residuals whose same plan in the compute dtype fits."""
    fits = {c.choice: c for c in row.compiled() if row.fits(c)}
    fitting = [
        c
        for c in fits.values()
        if c.choice.in_compute_dtype() not in fits or not c.choice.fp8_residuals()
    ]
    key = lambda c: (  # noqa: E731
        step_seconds(c, compiler, row.where),
        c.choice.fp8_matmuls(),
        c.got.peak_bytes,
    )
    return min(fitting, key=key, default=None)


def _cannot_be_beaten(row: Row, compiler: Compiler, scale: float) -> bool:
    """Whether no open candidate likely to fit could beat the best, at the most favourable
    ratio of XLA's step to the what-if's seen in this row."""
    best = best_of(row, compiler)
    open_ = _likely(row, scale)
    if best is None or not open_:
        return best is not None
    seconds = lambda c: step_seconds(c, compiler, row.where)  # noqa: E731
    ratio = min(
        (seconds(c) / c.what_if.prior_s for c in row.compiled() if c.what_if.prior_s > 0),
        default=1.0,
    )
    return min(c.what_if.prior_s for c in open_) * ratio >= seconds(best)
