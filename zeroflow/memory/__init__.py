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
backward pass saves and its largest temporary); ``measure*`` and ``compile_step`` ask XLA, by compiling,
and are the step's peak (``measure`` a compiled step's ``memory_analysis()``, ``measure_step``
compile and read it, ``step_time`` XLA:GPU's own step-time estimate of that compile). A step's
peak is XLA's: its compile (for abstract GPUs too, ``zf.target_mesh``) is the only model of its
fusion, layouts and buffer reuse that holds across XLA versions.

``python -m zeroflow.memory --config X --devices N --device-memory 80GB`` prints every stage x
offload x remat choice and names the cheapest that fits (the trainer's side of planning, a
Config's GPT step, is ``zeroflow.trainer.planning``). See docs/memory.md.
"""

from zeroflow.memory.collectives import Collective, collectives, overlap, traffic
from zeroflow.memory.estimate import (
    MemoryEstimate,
    ModelStates,
    activations,
    count_gpt_params,
    estimate,
    estimate_config,
    format_bytes,
    hierarchical_copy_bytes,
    offloaded_activations,
    parse_bytes,
)
from zeroflow.memory.instant import StepEstimate, estimate_step, estimate_traced
from zeroflow.memory.measure import (
    MeasuredMemory,
    compile_step,
    compile_step_timed,
    measure,
    measure_step,
    state_bytes,
    step_time,
)
from zeroflow.memory.schedule import StepTime

__all__ = [
    # From parameter counts, no compile
    "MemoryEstimate",
    "ModelStates",
    "activations",
    "count_gpt_params",
    "estimate",
    "estimate_config",
    # From the traced step, no compile
    "StepEstimate",
    "estimate_step",
    "estimate_traced",
    "hierarchical_copy_bytes",
    "offloaded_activations",
    # From XLA's compile
    "MeasuredMemory",
    "StepTime",
    "compile_step",
    "compile_step_timed",
    "measure",
    "measure_step",
    "state_bytes",
    "step_time",
    # Collectives in a compiled program
    "Collective",
    "collectives",
    "overlap",
    "traffic",
    # Units
    "format_bytes",
    "parse_bytes",
]
