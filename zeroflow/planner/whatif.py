"""The instant what-if: the ZeRO formula and a roofline, before anything is compiled. It never
gives a reported figure (XLA's compiles do); it proves a plan cannot fit (``floor_bytes``, the
state kept between steps: no compiled peak is below it) and orders the rest fastest first
(``prior_s``), so that the few compiles a row affords go to the likeliest winners."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from zeroflow.backend.accelerators import peak_flops
from zeroflow.memory.estimate import DTYPE_BYTES
from zeroflow.memory.spec import RunSpec
from zeroflow.planner.choices import Choice

if TYPE_CHECKING:
    from zeroflow.planner.where import Where

HOST_UPDATE_BYTES_PER_S = 20e9
"Host memory traffic a CPU optimizer update sustains per process (ZeRO-Offload's Adam)."
MATMUL_EFFICIENCY = 0.5
"Fraction of the dense peak the roofline assumes for the model's matmuls."
WEIGHT_READS = 3
"Times each micro-batch reads every weight from memory: forward, and twice backward."
UNHIDDEN = 0.1
"Share of an overlapped collective's time the roofline still charges: overlapped transfers"
" compete with the compute for memory bandwidth and SMs, so moving fewer bytes stays better."
RECOMPUTE = {None: 1, "none": 1, "save_dots": 1.05, "offload_dots": 1.05, "full": 4 / 3}
RECOMPUTE["offload_input"] = RECOMPUTE["full"]
"Step flops relative to no remat: full remat (and offload_input, which recomputes as much) runs"
" the forward pass twice (8 instead of 6 flops per parameter and token); save_dots recomputes"
" only what lies between matmuls."


@dataclasses.dataclass(frozen=True)
class WhatIf:
    floor_bytes: float
    "The state the plan keeps on each device between steps: no compiled peak is below it."
    predicted_bytes: float
    "The formula's peak: model states at their largest plus activations where known."
    host_bytes: float
    "Pinned host memory per process: offloaded state and activations."
    prior_s: float
    "The roofline's step time, only to order compiles."
    model_states: float = 0.0
    "The formula's parts of ``predicted_bytes``: model states at their largest, ..."
    activations: float = 0.0
    "... activations per micro-batch, and the update's peak."
    update_bytes: float = 0.0


def what_if(problem, choice: Choice, where: Where, per_process=None) -> WhatIf:
    """The instant figures of ``choice`` at ``where`` (see the module doc) of ``problem``: its
    run (``problem.spec``, a ``RunSpec``), global batch and activations per device, where it
    has a formula for them; ``per_process``: devices sharing a host process, else ``where``'s."""
    per_process = per_process or where.per_process
    run = dataclasses.replace(
        problem.spec,
        num_devices=where.devices,
        stage=choice.stage,
        offload=choice.offload,
        update_on=choice.update_on,
    )
    states = run.model_states(devices_per_process=per_process)
    micro = max(problem.batch_size // (where.devices * choice.grad_accum), 1)
    acts, host_acts = problem.activations(choice, micro)
    return WhatIf(
        floor_bytes=states.between_steps_bytes,
        predicted_bytes=max(states.device.total + acts, states.update_bytes),
        host_bytes=states.host_bytes + host_acts * per_process,
        prior_s=prior_seconds(run, choice, where, host_acts),
        model_states=states.device.total,
        activations=acts,
        update_bytes=states.update_bytes,
    )


def prior_seconds(run: RunSpec, choice: Choice, where: Where, host_acts: float) -> float:
    """Roofline step time: matmuls at ``MATMUL_EFFICIENCY`` of the peak (FP8's with FP8
    matmuls) and each micro-batch's
    reads of the weights, plus the collectives the compute cannot hide (and ``UNHIDDEN`` of
    those it can), plus the PCIe traffic of offloading and the host's update."""
    n, m, links = where.devices, choice.grad_accum, where.links
    params, frozen = run.per_way(run.num_params), run.per_way(run.frozen_params)
    trained = params - frozen
    width = DTYPE_BYTES[run.precision]
    tokens = run.tokens_per_step / n
    peak = choice.fp8_matmuls() and peak_flops(where.device_kind, "fp8") or where.peak_flops
    flops = 6 * params * tokens * RECOMPUTE[choice.remat] / (MATMUL_EFFICIENCY * peak)
    compute = flops + m * WEIGHT_READS * width * params / links.memory
    ring = (n - 1) / n
    link = links.peer if where.hosts <= 1 else links.network
    grads = (1 if choice.quantize_grads else 4) * trained * ring / link
    weights = (1 if choice.quantize_weights else width) * params * ring / link
    if choice.hierarchical and where.hosts > 1:
        weights *= links.network / links.peer
    # Stage 0-1 reduce once per step after the backward pass (exposed); stage 1-2 then gather
    # the updated weights; stage 2 reduce-scatters each micro-batch, stage 3 also gathers
    # every weight twice per micro-batch, both overlapping the compute.
    exposed = {0: 2 * grads, 1: 2 * grads + weights, 2: weights}.get(choice.stage, 0.0)
    hidden = {2: m * grads, 3: m * (grads + 2 * weights)}.get(choice.stage, 0.0)
    comm = exposed + max(0.0, hidden - compute) + UNHIDDEN * min(hidden, compute)
    host = _offload_seconds(run, params, trained, choice, where, width, host_acts)
    return compute + comm + host


def _offload_seconds(run, params, trained, choice, where, width, host_acts) -> float:
    """PCIe traffic of the offloaded state and activations, and the host's update."""
    host = where.links.host
    shard = trained / (where.devices if choice.stage >= 1 else 1)
    state = (4 + run.optimizer_bytes_per_param) * shard
    seconds = 2 * host_acts * choice.grad_accum / host
    if choice.offload == "none":
        return seconds
    if choice.update_on == "device":  # the state streams in for the update and back out
        seconds += 2 * state / host
    else:  # gradients out, new weights in, the update on the host's cores
        seconds += (4 + width) * shard / host
        seconds += 2 * state * where.per_process / HOST_UPDATE_BYTES_PER_S
    if choice.offload == "optimizer+params":  # the weights come in for every micro-batch
        seconds += choice.grad_accum * width * params / host
    return seconds
