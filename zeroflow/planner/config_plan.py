"""The planner's search for a trainer config (what ``python -m zeroflow.planner`` runs): the
config's GPT, its remat policies and attention kernels searched beside the engine's choices,
and advice for the rows where nothing fits."""

from __future__ import annotations

from collections.abc import Sequence

import jax

from zeroflow.backend import targets
from zeroflow.memory.estimate import REMATS
from zeroflow.planner.advice import advise
from zeroflow.planner.choices import OFFLOAD_PAIRS, Space
from zeroflow.planner.configs import ConfigProblem
from zeroflow.planner.library import Progress, rows_of, run
from zeroflow.planner.results import Plan
from zeroflow.planner.where import Where

ATTENTIONS = ("xla", "cudnn", "pallas")


def space_for(
    cfg, where: Where, *, stages, remats, attentions, zeropp: bool, grad_accums=None
) -> Space:
    """The config's search space at ``where``: on GPUs the config's attention and cuDNN's
    unless given; on XLA:CPU no cuDNN, and no activation offload (its host memory is the
    device's, so offload_dots is save_dots there)."""
    if where.is_gpu:
        kernels = list(attentions or dict.fromkeys([cfg.model.attention, "cudnn"]))
        kept = list(remats)
    else:
        own = "xla" if cfg.model.attention == "cudnn" else cfg.model.attention
        kernels = [a for a in (attentions or [own]) if a != "cudnn"] or ["xla"]
        kept = [r for r in remats if r != "offload_dots"]
    return Space(
        stages=tuple(stages),
        offloads=OFFLOAD_PAIRS,
        remats=tuple(kept),
        attentions=tuple(kernels),
        grad_accums=grad_accums,
        zeropp=zeropp,
    )


def _check(values: Sequence[str], allowed: Sequence[str], name: str) -> None:
    for v in values:
        if v not in allowed:
            raise ValueError(f"unknown {name} {v!r}; choose from {', '.join(allowed)}")


def plan_config(
    cfg,
    *,
    name: str,
    gpus: Sequence[str] | None = None,
    devices: Sequence[int] | None = None,
    margin: float = 0.1,
    device_memory: int | None = None,
    max_compiles: int = 3,
    min_compiles: int = 2,
    stages: Sequence[int] = (0, 1, 2, 3),
    remats: Sequence[str] = REMATS,
    attentions: Sequence[str] | None = None,
    zeropp: bool = True,
    grad_accums: Sequence[int] | None = None,
    cache_dir: str | None = None,
    progress: Progress | None = None,
) -> tuple[Plan, list[str]]:
    """``(plan, lines to print before its table)`` for ``cfg`` on each GPU x device count
    (this machine's devices without ``gpus``)."""
    _check(remats, REMATS, "remat")
    _check(attentions or (), ATTENTIONS, "attention")
    _check([str(s) for s in stages], ["0", "1", "2", "3"], "stage")
    if gpus:
        targets.use_cpu_for_targets()
    rows = rows_of(gpus, devices, device_memory)
    said = []
    if not gpus:
        said.append(
            f"No --gpus given: planning for this machine's devices ({jax.device_count()} x "
            f"{jax.default_backend()}, {rows[0].device_kind}); name GPUs with --gpus h100,a100,l4"
        )
    problem = ConfigProblem(cfg, name)

    def space(where: Where) -> Space:
        return space_for(
            cfg,
            where,
            stages=stages,
            remats=remats,
            attentions=attentions,
            zeropp=zeropp,
            grad_accums=grad_accums,
        )

    plan = run(
        problem,
        rows,
        space,
        margin=margin,
        max_compiles=max_compiles,
        min_compiles=min_compiles,
        progress=progress,
        cache_dir=cache_dir,
    )
    for row in plan.rows:
        if row.best is None:
            plan.advice[row.where.title] = advise(problem, row, space(row.where), plan.compiler)
    return plan, said
