"""``estimate_step``: a train step's peak per device in an instant, from its traced program.

No compile and no model of the network: the state's bytes are the ZeRO layout's own (its
shardings), and what the step adds on top is read from the jaxpr JAX traces for it
(``zeroflow.memory.traced``): the values the backward pass saves under the loss's own remat
policy, the gradients as they are made, and the largest temporary at the step's fullest.
``measure_step`` compiles the same step and reads XLA's figure; docs/memory.md gives how far
apart the two land.
"""

from __future__ import annotations

import dataclasses

import jax

from zeroflow.memory.measure import abstract_step, state_bytes
from zeroflow.memory.traced import aval_bytes, sharding_share, walk


@dataclasses.dataclass(frozen=True)
class StepEstimate:
    """Per-device bytes of a traced train step at its fullest (all estimates, no compile)."""

    state_bytes: float
    "The train state on the device: weights, gradients' master, optimizer state (exact)."
    batch_bytes: float
    "This device's rows of the batch."
    saved_bytes: float
    "Live besides state and batch when the step is fullest: the activations the backward "
    "pass saved, the gradients made so far, gathered weights."
    temporary_bytes: float
    "The operation at the peak: its results and its own working set."
    host_bytes: float = 0.0
    "State kept in host memory (offloaded), per device."
    at: str = ""
    "Where the peak is: the operation's path through calls and loops."

    @property
    def peak_bytes(self) -> float:
        return self.state_bytes + self.batch_bytes + self.saved_bytes + self.temporary_bytes


def estimate_traced(step, state, batch) -> StepEstimate:
    """``StepEstimate`` of a ``zf.make_train_step`` for abstract ``state`` and ``batch``
    (``ShapeDtypeStruct``s with shardings, as ``measure`` takes them): traced, not compiled.
    The state is donated, so the new state is written over the old one."""
    jaxpr = step.trace(state, batch).jaxpr.jaxpr
    state_leaves, batch_leaves = jax.tree.leaves(state), jax.tree.leaves(batch)
    leaves = state_leaves + batch_leaves
    if len(leaves) != len(jaxpr.invars):
        raise RuntimeError(
            f"the traced step takes {len(jaxpr.invars)} arrays, the state and batch hold "
            f"{len(leaves)}"
        )
    shares = [sharding_share(x.sharding, x.shape) for x in leaves]
    homes = [sharding_share(x.sharding, x.shape, in_device_memory=True) for x in leaves]
    walked = walk(
        jaxpr,
        shares,
        reusable=range(len(state_leaves)),
        overlap=_on_gpus(leaves),
        in_homes=homes,
    )
    kinds = state_bytes(state)
    batch_shares = shares[len(state_leaves) :]
    return StepEstimate(
        state_bytes=float(kinds.get("device", 0)),
        batch_bytes=float(sum(aval_bytes(x) * s for x, s in zip(batch_leaves, batch_shares))),
        saved_bytes=walked.saved,
        temporary_bytes=walked.temporary,
        host_bytes=float(kinds.get("pinned_host", 0)),
        at=walked.at,
    )


def _on_gpus(leaves) -> bool:
    """Whether the step runs on GPUs (real or a ``zf.target_mesh``'s abstract ones), whose
    compiler overlaps collectives with computation."""
    for x in leaves:
        devices = getattr(getattr(x, "sharding", None), "device_set", None)
        if devices:
            return next(iter(devices)).platform in ("gpu", "cuda", "rocm")
    return False


def estimate_step(loss_fn, params, batch, tx, plan, prec, **options) -> StepEstimate:
    """The instant answer to ``measure_step``: the same arguments (any JAX loss; abstract
    ``params`` and global ``batch``; ``model_state`` / ``rng`` / ``trainable`` as
    ``zf.init_train_state`` takes them; ``grad_accum``, ``gather_per_layer`` and more of
    ``make_train_step``'s keywords), the step traced rather than compiled. Its ``peak_bytes``
    is per device."""
    step, state, placed, _ = abstract_step(loss_fn, params, batch, tx, plan, prec, **options)
    return estimate_traced(step, state, placed)
