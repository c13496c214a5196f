"""Memory planning: the ZeRO paper's model-state accounting, and what XLA says.

    from zeroflow import memory
    est = memory.estimate_step(loss_fn, params, batch, tx, plan, prec)   # traced: est.peak_bytes
    got, peak = memory.measure_step(loss_fn, params, batch, tx, plan, prec)  # XLA's compile
    got = memory.measure(step, state, batch)                            # AOT memory_analysis()
    memory.overlap(memory.collectives(compiled))   # async collectives with compute in between
    t = memory.step_time(loss_fn, params, batch, tx, plan, prec)  # XLA:GPU's estimate (target mesh)
    est = memory.estimate(num_params=7.5e9, num_devices=64, stage=2)   # model states ~ 16.6e9

Two verbs: ``estimate*`` is the instant what-if, no compile (``estimate`` the ZeRO paper's
model states from a parameter count, ``estimate_config`` a trainer config's with the GPT's
activation formula, ``estimate_step`` any JAX loss's step from its traced program: what its
backward pass saves and its largest temporary); ``measure*`` and ``compile_step`` ask XLA, by
compiling, and are the step's peak (``measure`` a compiled step's ``memory_analysis()``,
``measure_step`` compile and read it, ``step_time`` XLA:GPU's own step-time estimate of that
compile). A step's peak is XLA's: its compile (for abstract GPUs too, ``zf.target_mesh``) is
the only model of its fusion, layouts and buffer reuse that holds across XLA versions.
``collectives``, ``overlap``, ``traffic``, ``Collective`` and ``StepTime`` are read from a
compiled step by ``zeroflow.xla`` and named here too.

``python -m zeroflow.memory --config X --devices N --device-memory 80GB`` prints every stage x
offload x remat choice and names the cheapest that fits (the trainer's side of planning, a
Config's GPT step, is ``zeroflow.trainer.planning``). See docs/memory.md.
"""

from typing import TYPE_CHECKING

from zeroflow.util import lazy as _lazy

if TYPE_CHECKING:  # what a type checker and an editor see: the names __getattr__ resolves
    from zeroflow.memory.estimate import MemoryEstimate as MemoryEstimate
    from zeroflow.memory.estimate import ModelStates as ModelStates
    from zeroflow.memory.estimate import estimate as estimate
    from zeroflow.memory.estimate import format_bytes as format_bytes
    from zeroflow.memory.estimate import hierarchical_copy_bytes as hierarchical_copy_bytes
    from zeroflow.memory.estimate import parse_bytes as parse_bytes
    from zeroflow.memory.instant import StepEstimate as StepEstimate
    from zeroflow.memory.instant import estimate_step as estimate_step
    from zeroflow.memory.instant import estimate_traced as estimate_traced
    from zeroflow.memory.measure import MeasuredMemory as MeasuredMemory
    from zeroflow.memory.measure import compile_step as compile_step
    from zeroflow.memory.measure import compile_step_timed as compile_step_timed
    from zeroflow.memory.measure import measure as measure
    from zeroflow.memory.measure import measure_step as measure_step
    from zeroflow.memory.measure import state_bytes as state_bytes
    from zeroflow.memory.measure import step_time as step_time
    from zeroflow.memory.spec import RunSpec as RunSpec
    from zeroflow.xla.collectives import Collective as Collective
    from zeroflow.xla.collectives import collectives as collectives
    from zeroflow.xla.collectives import overlap as overlap
    from zeroflow.xla.collectives import traffic as traffic
    from zeroflow.xla.schedule import StepTime as StepTime

_NAMES = {
    "zeroflow.memory.estimate": "MemoryEstimate ModelStates estimate format_bytes "
    "hierarchical_copy_bytes parse_bytes",
    "zeroflow.memory.instant": "StepEstimate estimate_step estimate_traced",
    "zeroflow.memory.measure": "MeasuredMemory compile_step compile_step_timed measure "
    "measure_step state_bytes step_time",
    "zeroflow.memory.spec": "RunSpec",
    # what XLA says about a compiled step: read in the layer below (zeroflow.xla), named here
    "zeroflow.xla.collectives": "Collective collectives overlap traffic",
    "zeroflow.xla.schedule": "StepTime",
}
_WHERE = {name: module for module, names in _NAMES.items() for name in names.split()}
"Where each public name lives (imported the first time it is read)."

GPT_NAMES = {
    name: "zeroflow.models.spec"
    for name in ("activations", "count_gpt_params", "estimate_config", "offloaded_activations")
}
"""The trainer GPT's figures, named here for the callers of ``zf.memory``: they read the model's
own init, which lives in the models layer above this one. No module of this package imports
them; tests/test_import_graph.py allows these names and no other upward one."""

_WHERE.update(GPT_NAMES)

_lazy.install(__name__, _WHERE)

__all__ = sorted(_WHERE)
