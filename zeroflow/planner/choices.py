"""The plans the planner searches: a ``Choice`` is a ZeRO stage, where the optimizer state lives
and its update runs, a remat policy and the dtype of what it saves, a micro-batch split, an
attention kernel, the ZeRO++ options and, asked for, FP8 matmuls. What may combine is the
engine's rule (``zeroflow.engine.plan_rules``), never re-derived here; on one device a stage
whose program equals a lower one's is dropped, and plans XLA is known to refuse are skipped
with its reason."""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Iterable, Sequence

import jax

from zeroflow.autocast.fp8 import FP8_COMPUTE_CAPABILITY, device_problem
from zeroflow.autocast.precision import DTYPES
from zeroflow.backend import targets
from zeroflow.backend.mesh import planning_mesh
from zeroflow.engine.plan import ZeroPlan
from zeroflow.engine.plan_rules import batch_split_problem, plan_problems
from zeroflow.util.settings import FP8_REMATS

UPDATE_ON = ("device", "host")

OFFLOAD_PAIRS = (
    ("none", "device"),
    *itertools.product(("optimizer", "optimizer+params"), UPDATE_ON),
)
"(offload, update_on): where the fp32 state lives and where its update runs."
REMAT_MEMORY = {"none": 4, "save_dots": 3, "offload_dots": 2, "full": 1, "offload_input": 0}
"Device memory a remat policy keeps, ranked (offload_dots keeps on the device what full keeps,"
" and its copies' buffers; offload_input keeps less than full: the layer inputs are on the host)."
OFFLOAD_MEMORY = {("none", "device"): 2, ("optimizer", "device"): 1, ("optimizer", "host"): 1}
"Device memory of where the state lives, ranked where the order is certain (see needs_more)."


@dataclasses.dataclass(frozen=True)
class Choice:
    """One plan. ``remat`` / ``attention`` / ``remat_dtype`` None: the model's own (a model
    given as a loss function decides those itself). ``remat_dtype``: what the remat policy
    keeps its saved activations in, 'compute' or 'fp8' (``model.remat_dtype``). ``autocast``
    'fp8': FP8 matmuls (``precision.autocast``); None: the problem's own precision."""

    stage: int
    offload: str = "none"
    update_on: str = "device"
    grad_accum: int = 1
    remat: str | None = None
    attention: str | None = None
    quantize_weights: str | None = None
    quantize_grads: str | None = None
    hierarchical: bool = False
    remat_dtype: str | None = None
    autocast: str | None = None

    def fp8_matmuls(self) -> bool:
        return self.autocast == "fp8"

    def fp8_residuals(self) -> bool:
        return self.remat_dtype == "fp8"

    def in_compute_dtype(self) -> Choice:
        return dataclasses.replace(self, remat_dtype="compute")

    def without_fp8_matmuls(self) -> Choice:
        """The same plan with the problem's own matmuls, its weights gathered unquantized."""
        qw = None if self.quantize_weights == "fp8" else self.quantize_weights
        return dataclasses.replace(self, autocast=None, quantize_weights=qw)

    def label(self) -> str:
        """A short name for tables: 'stage 3, opt->host, full, 2 micro, cudnn, qwZ'."""
        parts = [f"stage {self.stage}"]
        if self.offload != "none":
            short = {"optimizer": "opt", "optimizer+params": "opt+params"}[self.offload]
            parts.append(f"{short} on host, update on {self.update_on}")
        if self.remat is not None:
            parts.append(f"remat {self.remat}" + (" in fp8" if self.fp8_residuals() else ""))
        parts.append(f"{self.grad_accum} micro" if self.grad_accum > 1 else "1 micro")
        if self.attention is not None:
            parts.append(self.attention)
        parts += ["fp8 matmuls"] if self.fp8_matmuls() else []
        parts += [name for name, on in self.zeropp_names() if on]
        return ", ".join(parts)

    def zeropp_names(self) -> list[tuple[str, bool]]:
        qw = "fp8 gathers" if self.quantize_weights == "fp8" else "qwZ"
        return [
            (qw, self.quantize_weights is not None),
            ("qgZ", self.quantize_grads is not None),
            ("hpZ", self.hierarchical),
        ]

    def as_json(self) -> dict:
        return dataclasses.asdict(self)

    def plan_settings(self) -> dict:
        """The ``ZeroPlan`` keywords of this choice (its hosts are the mesh's)."""
        keys = ("stage", "offload", "update_on", "quantize_weights", "quantize_grads")
        return {k: getattr(self, k) for k in (*keys, "hierarchical")}


@dataclasses.dataclass(frozen=True)
class Space:
    """What to search. Empty ``remats`` / ``attentions``: the model's own."""

    stages: Sequence[int] = (0, 1, 2, 3)
    offloads: Sequence[tuple[str, str]] = OFFLOAD_PAIRS
    remats: Sequence[str | None] = (None,)
    remat_dtypes: Sequence[str] = ("compute", "fp8")
    "What saved activations may be kept in, beside each remat policy given; 'fp8' only with a"
    " policy that saves something (FP8_REMATS)."
    attentions: Sequence[str | None] = (None,)
    grad_accums: Sequence[int] | None = None
    "None: every split of the per-device batch into equal micro-batches."
    zeropp: bool = True
    "Also try ZeRO++'s quantized gathers (qwZ) and reductions (qgZ), and hpZ across hosts."
    notes: tuple[str, ...] = ()
    "What was left out of this GPU's space and why (cuDNN for a head dim it refuses), a line each."
    fp8_matmuls: bool = False
    "Also try FP8 matmuls, with FP8 weight gathers in place of qwZ: an opt-in, as they round"
    " every large matmul's operands (``with_fp8`` drops it where the GPU has no FP8 cores)."


def micro_splits(batch_size: int, devices: int) -> list[int]:
    """Every ``grad_accum`` that splits ``batch_size`` into equal micro-batches over
    ``devices`` (the engine's own batch rule decides)."""
    splits = range(1, batch_size // devices + 1)
    return [g for g in splits if batch_split_problem(batch_size, g, devices) is None]


def _zeropp_options(
    stage: int, offload: str, devices: int, hosts: int, zeropp: bool, autocast: str | None
) -> Iterable[tuple]:
    """(qwZ, qgZ, hpZ) settings to try: at stage 3 on two or more devices (on one, nothing is
    gathered or reduced); hpZ across hosts without offload (the engine's rules). With FP8
    matmuls the weights are gathered in FP8 instead of int8: the matmul casts the gathered
    weight to exactly those bytes, so the gather adds no rounding of its own."""
    if not zeropp or stage != 3 or devices == 1:
        return [(None, None, False)]
    hpz = [False, True] if hosts > 1 and offload == "none" else [False]
    gathers = "fp8" if autocast == "fp8" else "int8"
    return itertools.product([None, gathers], [None, "int8"], hpz)


def enumerate_choices(
    space: Space, devices: int, batch_size: int, hosts: int, compute_dtype: str
) -> list[Choice]:
    """Every choice of ``space`` the engine accepts for ``devices`` data devices on ``hosts``
    hosts, the batch split evenly; on one device, one stage per distinct decision."""
    splits = list(space.grad_accums or micro_splits(batch_size, devices))
    splits = [g for g in splits if batch_split_problem(batch_size, g, devices) is None]
    out, matmuls = [], [None, "fp8"] if space.fp8_matmuls else [None]
    for stage, (offload, update_on), autocast in itertools.product(
        space.stages, space.offloads, matmuls
    ):
        if devices == 1 and first_equal_stage(stage, offload, update_on, compute_dtype) < stage:
            continue
        zeropp = _zeropp_options(stage, offload, devices, hosts, space.zeropp, autocast)
        for qw, qg, hp in zeropp:
            problems = plan_problems(stage, offload, update_on, qw, 256, hp, qg, hosts)
            if problems or (hp and compute_dtype == "fp32"):
                continue
            for remat, attention, g in itertools.product(space.remats, space.attentions, splits):
                for dtype in remat_dtypes_of(remat, space.remat_dtypes):
                    quantized = (qw, qg, hp, dtype, autocast)
                    out.append(Choice(stage, offload, update_on, g, remat, attention, *quantized))
    return out


def with_fp8(space: Space, where) -> Space:
    """``space`` less FP8 matmuls where ``where``'s GPUs have no FP8 tensor cores, the reason
    kept as a note."""
    why = fp8_refusal(where) if space.fp8_matmuls else None
    if why is None:
        return space
    why += "; planned without them"
    return dataclasses.replace(space, fp8_matmuls=False, notes=(*space.notes, why))


def fp8_refusal(where) -> str | None:
    """Why ``where``'s GPUs cannot run FP8 matmuls (older than Ada), else None; this machine's
    devices as the trainer checks them (XLA:CPU computes with the float8 types)."""
    if where.local:
        return device_problem(jax.devices()[0])
    major, minor = targets.compute_capability(where.name)
    if (major, minor) >= FP8_COMPUTE_CAPABILITY:
        return None
    return (
        f"FP8 matmuls need FP8 tensor cores (compute capability 8.9 or newer: L4, H100, H200; "
        f"{where.name} is sm_{major}{minor})"
    )


def check_fp8_rows(rows, fp8: bool, config_problem: str | None = None) -> None:
    """FP8 matmuls asked for where the config refuses them or no row's GPUs can run them: one
    line."""
    if not fp8:
        return
    refusals = [config_problem] if config_problem else [fp8_refusal(w) for w in rows]
    if all(refusals):
        raise ValueError(f"--fp8 (fp8=True): {refusals[0]}; leave it out or change that")


def remat_dtypes_of(remat: str | None, dtypes: Sequence[str]) -> list[str | None]:
    """The dtypes of ``dtypes`` a plan of ``remat`` may keep its saved activations in: the
    model's own where the remat is (None), FP8 only where the policy saves something."""
    if remat is None:
        return [None]
    return [d for d in dtypes if d != "fp8" or remat in FP8_REMATS]


def first_equal_stage(stage: int, offload: str, update_on: str, compute_dtype: str) -> int:
    """The lowest stage whose program equals ``stage``'s on one device: every split is whole
    there, so stages differ only in what the engine keeps (whether the state holds a
    compute-dtype copy of the weights)."""

    def keeps(s: int) -> bool:
        plan = ZeroPlan(planning_mesh(1), stage=s, offload=offload, update_on=update_on)
        return plan.keeps_compute_copy(DTYPES[compute_dtype])

    return next(s for s in range(stage + 1) if keeps(s) == keeps(stage))


NO_SCHEDULE = (
    "XLA:GPU's scheduler cannot schedule remat offload_dots at stages 0-1 (INTERNAL: "
    "FindAndExtractBestNodeAvailable failed to find a node to schedule)"
)
XLA_FAILURE_TEXT = {"FindAndExtractBestNodeAvailable": NO_SCHEDULE}
"A compile error holding the key is reported as the value."


def known_failure(choice: Choice, gpu: bool) -> str | None:
    """XLA's reason where it is known to refuse ``choice`` (skipped, not compiled)."""
    return NO_SCHEDULE if gpu and choice.remat == "offload_dots" and choice.stage <= 1 else None


def needs_more(a: Choice, b: Choice) -> bool:
    """Whether ``a`` needs at least the device memory ``b`` needs, knob by knob: a plan that
    did not fit rules out every plan that needs more. Only orders that hold for every model
    are used (a lower stage, less remat, bigger micro-batches, the state on the device);
    anything else (ZeRO++, another attention kernel, FP8 matmuls) is not compared. FP8
    residuals need less than the compute dtype's at the same remat, never more."""
    same = ("attention", "quantize_weights", "quantize_grads", "hierarchical", "autocast")
    if any(getattr(a, k) != getattr(b, k) for k in same) or (a.remat is None) != (b.remat is None):
        return False
    pair_a, pair_b = (a.offload, a.update_on), (b.offload, b.update_on)
    ranked = pair_a in OFFLOAD_MEMORY and pair_b in OFFLOAD_MEMORY
    if pair_a != pair_b and not (ranked and OFFLOAD_MEMORY[pair_a] > OFFLOAD_MEMORY[pair_b]):
        return False
    if a.fp8_residuals() and not b.fp8_residuals():
        return False
    if (
        a.remat is not None
        and b.remat is not None
        and REMAT_MEMORY[a.remat] < REMAT_MEMORY[b.remat]
    ):
        return False
    return a.stage <= b.stage and a.grad_accum <= b.grad_accum
