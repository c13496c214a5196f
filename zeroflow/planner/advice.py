"""Where nothing fits: changes that can make a config fit (docs/planner.md, "Where nothing
fits"), each compiled in its most memory-frugal plain plan (the what-if's smallest, no ZeRO++:
advice should be the simplest change that works)."""

from __future__ import annotations

import dataclasses

from zeroflow.config.io import apply_overrides
from zeroflow.memory.estimate import format_bytes
from zeroflow.planner import where as places
from zeroflow.planner.choices import Choice, Space
from zeroflow.planner.compiling import Compiler
from zeroflow.planner.problems import ConfigProblem
from zeroflow.planner.search import SKIPPED, Row, candidates_for
from zeroflow.planner.whatif import what_if

LORA_RANK = 16
"Adapter rank the LoRA advice compiles with (a common choice; memory hardly depends on it)."
LORA = (f"model.lora.rank={LORA_RANK}",)
LORA_ADVICE = (
    (LORA, "LoRA adapters"),
    ((*LORA, "model.lora.quantize=nf4"), "LoRA adapters, base weights in 4-bit NormalFloat"),
)
"The LoRA advice: its config keys and what the row calls it."
MORE_DEVICES = (2, 4, 8, 16, 32, 64, 128, 256)
MORE_DEVICE_COMPILES = 2
PLAIN = (("none", "device"),)


@dataclasses.dataclass(frozen=True)
class Advice:
    what: str
    overrides: list[str]
    peak_bytes: float | None
    "XLA's compiled peak (None: from the formula only, ``predicted_bytes``)."
    predicted_bytes: float
    fits: bool
    failure: str = ""
    "Why its compile failed (an error, not a peak over the memory); '' where it compiled."

    def line(self) -> str:
        keys = f" ({' '.join(self.overrides)})" if self.overrides else ""
        if self.failure:  # whether it fits is unknown: say why, not "does not fit"
            return f"{self.what}: did not compile{keys}: {self.failure}"
        figure = f"ZeRO formula {format_bytes(self.predicted_bytes)}"
        if self.peak_bytes is not None:
            figure = f"XLA peak {format_bytes(self.peak_bytes)}"
        verdict = "fits" if self.fits else "does not fit"
        return f"{self.what}: {figure} per device, {verdict}{keys}"

    def as_json(self) -> dict:
        return {
            "what": self.what,
            "overrides": self.overrides,
            "xla_peak_bytes": None if self.peak_bytes is None else round(self.peak_bytes),
            "predicted_bytes": round(self.predicted_bytes),
            "fits": self.fits,
            "failure": self.failure or None,
        }


def advise(problem: ConfigProblem, row: Row, space: Space, compiler: Compiler) -> list[Advice]:
    where, usable, out = row.where, row.usable_bytes, []
    # The advice stays in the compute dtype: FP8 residuals are the search's last resort per
    # plan (zeroflow.planner.search), not a change of what is computed to suggest here.
    space = dataclasses.replace(space, zeropp=False, remat_dtypes=("compute",))
    if problem.cfg.model.lora.rank == 0:
        for keys, what in LORA_ADVICE:
            out += _lora(problem, keys, what, row, space, compiler)
    offload = dataclasses.replace(space, offloads=(("optimizer+params", "host"),))
    choice = _frugal(problem, where, offload, usable)
    if choice is not None:
        out.append(_compiled(problem, choice, where, compiler, usable, "everything offloaded"))
    return out + _more_devices(problem, where, space, usable, compiler)


def _frugal(problem, where, space: Space, usable: float) -> Choice | None:
    cands = [c for c in candidates_for(problem, where, space, usable) if c.status != SKIPPED]
    # On a tie the plainer remat: full moves nothing over PCIe.
    best = min(
        cands, key=lambda c: (c.what_if.predicted_bytes, c.choice.remat != "full"), default=None
    )
    return None if best is None else best.choice


def _compiled(problem, choice, where, compiler: Compiler, usable: float, what: str) -> Advice:
    got = compiler.measure(problem, choice, where)
    predicted = what_if(problem, choice, where).predicted_bytes
    overrides = problem.overrides(choice, where.devices)
    if isinstance(got, str):
        return Advice(what, overrides, None, predicted, False, failure=got)
    return Advice(what, overrides, got.peak_bytes, predicted, got.peak_bytes <= usable)


def _lora(problem, keys, what: str, row: Row, space: Space, compiler) -> list[Advice]:
    """``keys`` applied to the config, compiled in its frugal plain plan on the device."""
    lora = ConfigProblem(apply_overrides(problem.cfg, list(keys)), problem.name)
    # The adapters' own state is small: the frozen base weights decide, on the device.
    # zf.lora finds where each weight is read by tracing the loss on fp32 shapes, which
    # cuDNN attention refuses, so LoRA is planned with XLA's attention.
    kernels = tuple(dict.fromkeys("xla" if a == "cudnn" else a for a in space.attentions))
    lora_space = dataclasses.replace(space, offloads=PLAIN, attentions=kernels)
    choice = _frugal(lora, row.where, lora_space, row.usable_bytes)
    if choice is None:
        return []
    advice = _compiled(lora, choice, row.where, compiler, row.usable_bytes, what)
    return [dataclasses.replace(advice, overrides=[*keys, *advice.overrides])]


def _more_devices(problem, where, space: Space, usable: float, compiler) -> list[Advice]:
    """The fewest devices whose frugal plain plan the formula expects to fit, compiled; if XLA
    disagrees, the next count too (``MORE_DEVICE_COMPILES`` at most)."""
    if where.local:
        return []
    plain = dataclasses.replace(space, offloads=PLAIN)
    out = []
    for count in MORE_DEVICES:
        if count <= where.devices or count > problem.batch_size:
            continue
        wider = places.target(where.name, count, where.memory_bytes)
        choice = _frugal(problem, wider, plain, usable)
        if choice is None or what_if(problem, choice, wider).predicted_bytes > usable:
            continue
        out.append(_compiled(problem, choice, wider, compiler, usable, f"{count} devices"))
        if out[-1].fits or len(out) == MORE_DEVICE_COMPILES:
            break
    return out[-1:]
