"""The trainer's GPT step of a ``Config``, for memory planning: abstract compiled steps for
XLA's own numbers, or the same steps traced for the instant estimate, one stage / offload /
remat choice at a time. ``zeroflow.memory`` stays the engine's (any model); this is where it
meets configs.

    compiled, setup = compile_config(cfg, num_devices=8, stage=3, offload="none",
                                     update_on="device", remat="full", target="h100")
    est = trace_config(cfg, num_devices=8, stage=3, ...)   # no compile: est.peak_bytes
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import re
from typing import Any

import jax

from zeroflow import backend
from zeroflow.backend import target_mesh
from zeroflow.backend.targets import compute_capability
from zeroflow.engine.padding import unpadded_shapes
from zeroflow.memory.instant import StepEstimate, estimate_traced
from zeroflow.memory.measure import MeasuredMemory, analysed, state_bytes
from zeroflow.memory.on_target import compile_for, stand_in_mesh
from zeroflow.models import abstract_params
from zeroflow.trainer.setup import abstract_batch, build_run
from zeroflow.util import compat
from zeroflow.util.tree import path_str


@dataclasses.dataclass(frozen=True)
class StepSetup:
    """A jitted step with abstract inputs for one stage / offload / remat choice."""

    step: Any
    state: Any
    batch: Any
    plan: Any
    num_params: int
    target: Any = None
    "The abstract GPUs' mesh where the step is planned on CPU stand-ins for them (offloaded)."


def choice_config(
    cfg,
    *,
    num_devices: int,
    stage: int | None = None,
    offload: str | None = None,
    update_on: str | None = None,
    remat: str | None = None,
):
    """``cfg`` with one stage / offload / remat choice on ``num_devices`` data devices."""
    par = cfg.parallel
    offload = par.offload if offload is None else offload
    update_on = (
        (par.update_on if update_on is None else update_on) if offload != "none" else "device"
    )
    return dataclasses.replace(
        cfg,
        model=dataclasses.replace(cfg.model, remat=cfg.model.remat if remat is None else remat),
        parallel=dataclasses.replace(
            par,
            data=num_devices,
            zero_stage=par.zero_stage if stage is None else stage,
            offload=offload,
            update_on=update_on,
        ),
    )


def _first_devices(data: int, cfg):
    """The first devices of this machine, for ``data`` devices times the other axes'."""
    count = data * cfg.parallel.model * cfg.parallel.context
    if jax.device_count() < count:
        raise ValueError(
            f"measuring needs {count} devices, {jax.device_count()} available "
            f"({jax.default_backend()})"
        )
    return jax.devices()[:count]


def abstract_setup(
    cfg,
    *,
    num_devices: int,
    stage: int,
    offload: str,
    update_on: str,
    remat: str,
    target: str | None = None,
    hosts: int = 1,
    compiler_options: dict | None = None,
) -> StepSetup:
    """The trainer's GPT train step of ``cfg`` (``build_run``: same optimizer, precision and
    layer-wise gathering) on the first ``num_devices`` data devices, or on as many abstract
    devices of GPU ``target`` (``zf.target_mesh``), with abstract state and batch: parameters
    are never materialised. An offloaded choice for a target is planned on CPU devices standing
    in for its GPUs, with their traits (``zeroflow.memory.on_target``): abstract GPUs have no
    host memory to keep the offloaded state in. ``hosts``: how many hosts the target's devices
    span; ``compiler_options``: XLA options for the step's compile (``Run.make_step``)."""
    cfg = choice_config(
        cfg, num_devices=num_devices, stage=stage, offload=offload, update_on=update_on, remat=remat
    )
    on_target = None
    if target is not None:
        mesh = target_mesh(
            target,
            data=num_devices,
            model=cfg.parallel.model,
            context=cfg.parallel.context,
            hosts=hosts,
        )
        if offload != "none":
            on_target = mesh
            run = build_run(cfg, with_data=False, mesh=stand_in_mesh(mesh), traits=backend.of(mesh))
        else:
            run = build_run(cfg, with_data=False, mesh=mesh)
    else:
        run = build_run(cfg, with_data=False, devices=_first_devices(num_devices, cfg))
    state = run.abstract_state()
    batch = abstract_batch(cfg, run.plan.batch_sharding)
    shapes = unpadded_shapes(state.master, state.padding.master)
    if state.frozen is not None:  # frozen parameters are parameters too
        shapes = [shapes, unpadded_shapes(state.frozen, state.padding.frozen)]
    num_params = sum(math.prod(x.shape) for x in jax.tree.leaves(shapes))
    return StepSetup(
        step=run.make_step(compiler_options),
        state=state,
        batch=batch,
        plan=run.plan,
        num_params=num_params,
        target=on_target,
    )


def measure_config(cfg, **choice) -> tuple[MeasuredMemory, dict[str, int]]:
    """AOT memory analysis and per-device state bytes (by memory kind) for one choice
    (keywords of ``abstract_setup``)."""
    compiled, setup = compile_config(cfg, **choice)
    return analysed(compiled), state_bytes(setup.state)


def compile_config(cfg, **choice):
    """``(compiled step, StepSetup)`` for one choice (keywords of ``abstract_setup``). For a
    ``target`` with ``model.attention: cudnn`` and no local cuDNN, cuDNN attention is lowered
    for the oldest cuDNN the CUDA plugin accepts (``compat.cudnn_for_target``); the setup is
    made under it too, as a LoRA run's setup traces the loss (its adapters' sites)."""
    with _cudnn_for(cfg, choice.get("target")):
        setup = abstract_setup(cfg, **choice)
        if setup.target is not None:
            return compile_for(setup.step, setup.state, setup.batch, setup.target), setup
        return setup.step.lower(setup.state, setup.batch).compile(), setup


def trace_config(cfg, **choice) -> StepEstimate:
    """The instant answer to ``compile_config``: the same step traced, not compiled
    (``zf.memory.estimate_traced``: its state's bytes, what its backward pass saves and its
    largest temporary, per device)."""
    with _cudnn_for(cfg, choice.get("target")):
        setup = abstract_setup(cfg, **choice)
        return estimate_traced(setup.step, setup.state, setup.batch)


def _cudnn_for(cfg, target: str | None):
    """Where cuDNN attention is lowered for ``target``'s GPUs without a local cuDNN."""
    if target and cfg.model.attention == "cudnn":
        return compat.cudnn_for_target(compute_capability(target))
    return contextlib.nullcontext()


def attention_note(cfg, target: str | None) -> str:
    """One line saying which attention a compiled row of ``cfg`` measured ("" for xla/pallas)."""
    if cfg.model.attention != "cudnn" or target is None:
        return ""

    def named(version: int) -> str:
        return f"{version // 10000}.{version // 100 % 100}"

    version = compat.local_cudnn_version()
    if version is not None:
        return f"cuDNN attention (lowered for this machine's cuDNN {named(version)})"
    return (
        f"cuDNN attention lowered for cuDNN {named(compat.TARGET_CUDNN_VERSION)} (none "
        "installed here); its workspace, sized on a GPU, is not in the peak"
    )


def count_frozen_params(cfg) -> int:
    """Parameters of the GPT of ``cfg`` that ``train.freeze`` freezes (0 without it); with
    LoRA every one (the adapters, a few per cent, are not counted)."""
    shapes, _ = abstract_params(cfg.model)
    if cfg.model.lora.rank > 0:
        return sum(math.prod(x.shape) for x in jax.tree.leaves(shapes))
    if not cfg.train.freeze:
        return 0
    return sum(
        math.prod(x.shape)
        for p, x in jax.tree_util.tree_leaves_with_path(shapes)
        if re.search(cfg.train.freeze, path_str(p))
    )
