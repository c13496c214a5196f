"""The compiled train step's peak memory per device, estimated from shapes (nothing compiled).

``estimate_step`` adds up named terms, each a kind of buffer the step holds at its peak:

- ``model_states``: the state arrays in device memory (compute weights, fp32 master and
  optimizer state, as the plan shards and offloads them) and the batch: the step's arguments;
- ``whole_weights``: fp32 compute at stages 1-2 keeps no compute copy, so each step gathers the
  whole weights from the master shards for the forward and backward pass;
- ``gradients``: the gradients the backward pass leaves, fp32, whole where they are
  all-reduced (stage 0, stage 1 with accumulation) and 1/N where they are reduce-scattered on
  use; in the compute dtype where nothing sums them (one data device, one micro-batch:
  ``native_gradients``); none for frozen weights (``trainable=``), which are stored once in
  the compute dtype (part of ``model_states``) and keep no master copy or optimizer state;
  a stack a scan reads one layer at a time gets its gradient buffer whole, up front;
- ``activations``: for a loss that loops over a stack of layers (a ``lax.scan``), what the
  backward pass keeps from the forward pass in device memory (the residuals of ``jax.vjp`` of
  the loss on one device's micro-batch, the weights themselves excluded), a remat's
  recomputation being part of ``layer_in_flight``; for any other loss, the most its forward
  and backward pass hold at once, as XLA fuses them (``zeroflow.memory.liveness``: residuals
  as XLA keeps them, cotangents, layout copies and recomputation). Residuals a remat policy
  offloads (remat 'offload_dots') are ``host_activations``, not part of the device peak;
- ``layer_in_flight``: the unit being differentiated: one scanned layer (``gather_per_layer``)
  or the largest weight otherwise, as fetched for use plus its whole fp32 local gradient
  before that is reduced;
- ``widened``: XLA:CPU up to jaxlib 0.10 only (``Traits.widens_half_dots``): it multiplies
  half-precision matrices in fp32 and converts a stored half-precision layer stack once,
  outside the loop (GPUs, and XLA:CPU from 0.11, use bf16/fp16 directly; stage 3 without a
  compute copy stores no such stack);
- ``update``: while the optimizer runs, along the step's own ``UpdatePath``: the gradients,
  the update direction optax builds (one fp32 array per master shard; on one GPU fused into
  each leaf's update, except a loop's outputs, ``_update_loops``) and, streamed, one
  parameter's master and optimizer state brought in from the host and made anew beside it,
  with the gradients not yet read (brought in whole: all of the state); on the host, only the
  gradients waiting for their copy to the host.

The peak is ``model_states + max(backward, update)`` with ``backward = whole_weights +
gradients + activations + layer_in_flight + widened``. docs/memory.md compares it with
``memory_analysis()`` for every stage, offload and remat choice.

Every choice the step makes is read from the step itself, for the plan with the traits of the
backend compiled for: its ``StepLayout`` (state shardings, the update path), its routes, and
``Traits`` for what the compiler does with them; never a platform name or a stage number.
"""

from __future__ import annotations

import dataclasses
import itertools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import Literal
from jax.sharding import PartitionSpec as P

from zeroflow import backend as backends
from zeroflow.autocast.precision import Precision
from zeroflow.backend.mesh import CONTEXT, DATA
from zeroflow.engine import frozen as frozen_weights
from zeroflow.engine.grads.local import native_gradients
from zeroflow.engine.grads.routes import Fetch, Reduce, fetches_whole, is_route, step_routes
from zeroflow.engine.plan import ZeroPlan
from zeroflow.engine.state import abstract_master, init_train_state
from zeroflow.engine.step import step_layout
from zeroflow.engine.update import UpdatePath, owners
from zeroflow.memory.residuals import (
    held_bytes,
    largest_residual,
    micro_batch,
    residual_bytes,
    scanned_leaves,
)
from zeroflow.util import jaxprs
from zeroflow.util.tree import is_under, path_str

F32 = 4


@dataclasses.dataclass(frozen=True)
class PeakEstimate:
    """Bytes per device of each term (see the module docstring), of the three moments that can
    set the peak (start and end of the backward pass, the optimizer update; each excluding the
    model states), and the peak."""

    model_states: float
    host_state: float
    "The state in pinned host memory (offload), per device: not part of the device peak."
    gathered_weights: float
    gradients: float
    activations: float
    layer_in_flight: float
    widened: float
    backward_start: float
    backward_end: float
    update: float
    host_activations: float = 0.0
    "Activations offloaded to pinned host memory for the backward pass, per device."
    update_path: UpdatePath | None = None
    "Where the step runs the optimizer update (its ``StepLayout.update_path``): what ``update``"
    " counts. Not a term."

    @property
    def peak_bytes(self) -> float:
        return self.model_states + max(self.backward_start, self.backward_end, self.update)

    @property
    def phase(self) -> str:
        """The moment that sets the peak: "backward_start", "backward_end" or "update"."""
        moments = {
            "backward_start": self.backward_start,
            "backward_end": self.backward_end,
            "update": self.update,
        }
        return max(moments, key=moments.__getitem__)

    def terms(self) -> dict[str, float]:
        return {
            f.name: getattr(self, f.name)
            for f in dataclasses.fields(self)
            if f.name != "update_path"
        }


def _local_elements(shape, sharding) -> int:
    return math.prod(sharding.shard_shape(tuple(shape)) if sharding is not None else shape)


def _compiled_for(plan: ZeroPlan, platform: str | None) -> ZeroPlan:
    """``plan`` with the traits of the platform its step is compiled for (``estimate_step``'s
    ``backend``; None: the mesh's own), so that every choice below reads them from the plan."""
    if platform is None or plan.traits.platform == platform:
        return plan
    return dataclasses.replace(plan, traits=backends.for_platform(platform))


@dataclasses.dataclass(frozen=True)
class _Leaves:
    """The per-leaf facts the terms add up, one entry per parameter leaf (flatten order)."""

    shapes: list
    whole: list
    "Elements of the leaf on one device with ``data`` unsplit (tensor-parallel splits kept)."
    routes: list
    "The step's ``Route`` of each leaf."
    trains: tuple
    "Whether the leaf trains (``trainable=``)."
    stacked: list
    "Whether the step uses the leaf one layer's slice at a time (``_stacked``)."

    @property
    def layer_stack(self) -> list[tuple[float, tuple, bool]]:
        """``(whole, shape, trains)`` of each leaf used one slice at a time."""
        return [
            (w, shape, t)
            for w, shape, st, t in zip(self.whole, self.shapes, self.stacked, self.trains)
            if st
        ]

    def over_stack(self, values) -> float:
        """The sum of ``values`` (one per leaf) over the leaves used one slice at a time."""
        return sum(v for v, st in zip(values, self.stacked) if st)


@dataclasses.dataclass(frozen=True)
class _Widths:
    """Bytes per element of the weights and gradients as the backend compiled for holds them."""

    compute: int
    "The compute dtype's."
    widening: bool
    "Half-precision matmuls run in fp32 on converted copies (XLA:CPU up to jaxlib 0.10)."
    wide_collectives: bool
    "A unit's half-precision weights (or gradients) cross devices through fp32 copies (XLA:CPU,"
    " every version)."

    @property
    def fetched(self) -> int:
        """A weight fetched for its use."""
        return F32 if self.widening or self.wide_collectives else self.compute


def _widths(plan: ZeroPlan, prec: Precision) -> _Widths:
    width = jnp.dtype(prec.compute_dtype).itemsize
    half = width < 4
    return _Widths(
        compute=width,
        widening=half and plan.traits.widens_half_dots,
        wide_collectives=(half and plan.traits.widens_half_precision and plan.data_size > 1),
    )


@dataclasses.dataclass(frozen=True)
class _Backward:
    """The backward pass's terms (``_backward``)."""

    in_flight: float
    widened: float
    reused: float
    "Bytes of the donated half-precision stack that the stack's gradients are written into."
    start: float
    end: float


def estimate_step(
    loss_fn,
    params,
    batch,
    tx,
    plan: ZeroPlan,
    prec: Precision,
    *,
    grad_accum: int = 1,
    gather_per_layer: str | None = None,
    backend: str | None = None,
    recompute_bytes: float = 0.0,
    model_state=None,
    rng=None,
    trainable=None,
) -> PeakEstimate:
    """The peak of ``zf.make_train_step(loss_fn, tx, plan, prec, grad_accum, gather_per_layer=)``
    per device, from the abstract fp32 ``params`` and the global ``batch`` (arrays or
    ``ShapeDtypeStruct``s). ``plan`` may be on a ``zf.planning_mesh`` (no devices needed).
    ``backend``: the platform the step is compiled for, "gpu" or "cpu" (default: the mesh's,
    or this machine's for a planning mesh); "cpu" adds XLA:CPU's fp32 copies of
    half-precision weights and drops the offload copies (host memory is device memory there).
    ``recompute_bytes``: under remat, what one layer's forward pass makes again in the backward
    pass (``remat_recompute_bytes`` derives it; 0 when unknown).
    ``model_state`` / ``rng``: what the state will carry (``zf.init_train_state``'s arguments of
    those names, arrays or ShapeDtypeStructs); the loss is then called with them as keywords.
    ``trainable``: as for ``zf.init_train_state``; a frozen leaf costs its compute-dtype bytes
    (1/N at stage 3) and nothing else.

    The choices are the step's own: its ``StepLayout`` (the update path included) and routes,
    for the plan with the traits of ``backend``."""
    plan = _compiled_for(plan, backend)
    master = abstract_master(params)
    layout = step_layout(master, tx, plan, prec, trainable=trainable)
    micro = micro_batch(batch, plan.batch_split, grad_accum, plan.context_size)
    extras = {k: v for k, v in (("model_state", model_state), ("rng", rng)) if v is not None}
    leaves = _leaf_facts(
        loss_fn, master, micro, extras, layout, plan, prec, gather_per_layer, grad_accum
    )
    widths = _widths(plan, prec)
    native = native_gradients(plan, grad_accum)
    stored, state_arrays = _stored_state(master, tx, plan, prec, layout)
    gathered = _gathered_whole(leaves, plan, prec, widths)
    grads = _gradient_bytes(leaves, plan, grad_accum, widths)
    # Traced for the backend compiled for: a remat policy may offload only where host memory
    # is a memory of its own (``zeroflow.models.gpt.offload_policy``).
    with backends.tracing_for(plan.traits):
        host_activations = (
            residual_bytes(
                loss_fn,
                master,
                micro,
                prec,
                gather_per_layer,
                extras,
                memory="host",
                trainable=leaves.trains,
            )
            / plan.model_size
        )
        if leaves.layer_stack:
            activations = residual_bytes(
                loss_fn,
                master,
                micro,
                prec,
                gather_per_layer,
                extras,
                memory="device",
                trainable=leaves.trains,
            )
        else:
            # No loop over layers: what the forward and backward pass hold at their fullest,
            # recomputation included (``recompute_bytes`` is then ignored).
            activations = held_bytes(
                loss_fn, master, micro, prec, gather_per_layer, extras, trainable=leaves.trains
            )
            recompute_bytes = 0.0
        activations /= plan.model_size
    backward = _backward(
        leaves,
        plan,
        prec,
        widths,
        native=native,
        gathered=gathered,
        grads=grads,
        activations=activations,
        recompute_bytes=recompute_bytes,
    )
    update = _update_bytes(
        frozen_weights.split(master, layout.layouts)[0],
        stored,
        layout.state,
        tx,
        leaves.routes,
        plan,
        layout.update_path,
        native,
        grads=[g for g, t in zip(grads, leaves.trains) if t],
        free=_dead_compute_bytes(leaves, plan, prec, widths, backward.reused),
    )
    return PeakEstimate(
        model_states=_argument_bytes(state_arrays, batch, plan.data_size, model_state),
        host_state=_state_bytes(state_arrays, "pinned_host"),
        gathered_weights=sum(gathered),
        gradients=sum(grads),
        activations=activations,
        layer_in_flight=backward.in_flight,
        widened=backward.widened,
        backward_start=backward.start,
        backward_end=backward.end,
        update=update,
        host_activations=host_activations,
        update_path=layout.update_path,
    )


def _leaf_facts(
    loss_fn,
    master,
    micro,
    extras,
    layout,
    plan: ZeroPlan,
    prec: Precision,
    gather_per_layer,
    grad_accum: int,
) -> _Leaves:
    """The ``_Leaves`` of ``master`` under the step's ``layout``: the step's routes, and which
    leaves the loss's scans (or ``gather_per_layer``) use one slice at a time."""
    routes = jax.tree.leaves(
        step_routes(layout.layouts, plan, prec, gather_per_layer, grad_accum),
        is_leaf=is_route,
    )
    shapes = [x.shape for x in jax.tree.leaves(master)]
    compute_sh = jax.tree.leaves(plan.compute_shardings(master, memory_kind=None))
    whole = [
        _local_elements(s, sh.update(spec=_without_data(sh.spec)))
        for s, sh in zip(shapes, compute_sh)
    ]
    # (whole half-precision weights are fetched on use where collectives widen: fetches_whole)
    stacked = _stacked(
        loss_fn,
        master,
        micro,
        extras,
        routes,
        gather_per_layer,
        fetches_whole(plan, prec.compute_dtype),
    )
    return _Leaves(
        shapes=shapes,
        whole=whole,
        routes=routes,
        trains=tuple(jax.tree.leaves(layout.trainable)),
        stacked=stacked,
    )


def _gathered_whole(leaves: _Leaves, plan: ZeroPlan, prec: Precision, widths: _Widths) -> list:
    """Per leaf, the bytes of whole weights the step makes for the forward and backward pass."""
    # Weights stored split but used whole with no compute copy (fp32 at stages 1-2) are
    # gathered from the master; a frozen fp32 weight is stored whole there: nothing to gather.
    from_master = plan.gathers_whole_weights and not plan.keeps_compute_copy(prec.compute_dtype)
    gathered = [
        F32 * w if (from_master and r.dim is not None and not r.frozen) else 0.0
        for w, r in zip(leaves.whole, leaves.routes)
    ]
    if plan.offloads_params:  # weights outside the streamed stack are copied in whole
        gathered = [
            g + (widths.compute * w if r.fetch is not Fetch.PER_LAYER else 0.0)
            for g, w, r in zip(gathered, leaves.whole, leaves.routes)
        ]
    return gathered


def _gradient_bytes(leaves: _Leaves, plan: ZeroPlan, grad_accum: int, widths: _Widths) -> list:
    """Per leaf, the bytes of the gradient the backward pass leaves (none for a frozen leaf)."""
    # Gradients leave the backward pass in fp32, except where nothing sums them: they stay as
    # the backward pass makes them until the update reads them (native_gradients), in the
    # weights' dtype unless reduced on use (fp32 stand-ins).
    native = native_gradients(plan, grad_accum)
    # With accumulation, an fp32 sum beside each micro-batch's own gradients, which stay in the
    # compute dtype (their widening fuses into the sum) unless reduce-scattered first. XLA:CPU
    # computes half precision in fp32 and keeps the gradients so.
    made = [
        F32 if widths.widening or r.reduce in (Reduce.ON_USE, Reduce.AFTER) else widths.compute
        for r in leaves.routes
    ]
    grad_widths = [(F32 + m) if grad_accum > 1 else (m if native else F32) for m in made]
    n = plan.data_size
    return [
        0.0 if r.frozen else gw * (w / n if r.sharded_grad else w)
        for w, r, gw in zip(leaves.whole, leaves.routes, grad_widths)
    ]


def _backward(
    leaves: _Leaves,
    plan: ZeroPlan,
    prec: Precision,
    widths: _Widths,
    *,
    native: bool,
    gathered: list,
    grads: list,
    activations: float,
    recompute_bytes: float,
) -> _Backward:
    """The unit being differentiated, what XLA:CPU widens, and the backward pass's two moments."""
    n, stack = plan.data_size, leaves.layer_stack
    unit = sum(w / shape[0] for w, shape, _ in stack) if stack else max(leaves.whole)
    # The unit's local fp32 gradient: of its trainable weights only.
    unit_grad = (
        sum(w / shape[0] for w, shape, t in stack if t)
        if stack
        else max((w for w, t in zip(leaves.whole, leaves.trains) if t), default=0.0)
    )
    unit_grad_width = widths.compute if native and not widths.widening else F32
    # The unit's weights take memory of their own when fetched (gathered at stage 3, copied out
    # of a scanned stack, widened by XLA:CPU); a resident unstacked weight is used in place,
    # as is every weight on a single device (stage 3 there gathers nothing).
    gathers = plan.shards_compute and n > 1
    fetched = (
        widths.fetched if (gathers or stack or widths.widening or widths.wide_collectives) else 0
    )
    widened = 0.0
    if widths.widening and stack and plan.keeps_compute_copy(prec.compute_dtype):
        # (with no compute copy, stage 3 casts the fp32 master's shard as it gathers it: there
        # is no half-precision stack to widen)
        widened = F32 * sum(w / (n if plan.shards_compute else 1) for w, _, _ in stack)
    # Once XLA:CPU has widened a whole stored stack (stages 0-2), the donated half-precision
    # stack is dead until the new weights are written: the stack's gradients go into its buffer.
    reused = 0.0
    if widened and plan.keeps_whole_compute_copy(prec.compute_dtype):
        reused = min(widths.compute * sum(w for w, _, _ in stack), leaves.over_stack(grads))

    # The backward pass peaks at its start (all it keeps from the forward pass, the first layer
    # being differentiated, and the gradient buffers of a scanned stack, allocated whole up
    # front) or at its end (every gradient; weights and activations of unstacked layers have
    # been freed one by one as the pass went back through them).
    in_flight = max(fetched * unit, recompute_bytes / plan.model_size) + unit_grad_width * unit_grad
    start = sum(gathered) + activations + in_flight + leaves.over_stack(grads) + widened - reused
    # Near the end, a unit still fetches its weights at stage 3 (only the very first layer's
    # input gradient is not needed).
    end = (
        leaves.over_stack(gathered)
        + sum(grads)
        + (fetched if plan.shards_compute else 0) * unit
        + unit_grad_width * unit_grad
        + widened
        - reused
    )
    return _Backward(in_flight=in_flight, widened=widened, reused=reused, start=start, end=end)


def _dead_compute_bytes(
    leaves: _Leaves, plan: ZeroPlan, prec: Precision, widths: _Widths, reused: float
) -> float:
    """Bytes of dead buffers an update direction of its own is written into. Whole compute
    weights gathered anew after the update (stages 1-2) are dead while it runs (donated):
    unless the stack's gradients already went into their buffer (``reused``), an update that
    materialises its directions (a ``lax.cond``, ``Traits.cond_updates_in_place``: XLA:CPU,
    from jaxlib 0.11 on, where it no longer widens the stack) writes them there."""
    regathered = plan.gathers_whole_weights and plan.keeps_compute_copy(prec.compute_dtype)
    if not regathered or reused or not plan.traits.cond_updates_in_place:
        return 0.0
    return widths.compute * sum(w for w, _, t in leaves.layer_stack if t)


def _stored_state(master, tx, plan: ZeroPlan, prec: Precision, layout):
    """The state as stored (abstract; leaves ZeRO pads are larger than the parameters) and its
    ``(arrays, shardings, memory kind)`` entries."""
    shard = layout.state
    stored = jax.eval_shape(
        lambda: init_train_state(master, tx, plan, prec, trainable=layout.trainable)
    )
    # Memory kinds from the plan, not from the shardings: a zf.target_mesh's abstract devices
    # expose no memories, so jax drops a sharding's pinned_host there.
    host = plan.storage_memory_kind or "device"
    weights = plan.compute_memory_kind or "device"
    state_arrays = [(stored.master, shard.master, host), (stored.opt_state, shard.opt_state, host)]
    if shard.compute is not None:
        state_arrays.append((stored.compute, shard.compute, weights))
    if shard.frozen is not None:
        state_arrays.append((stored.frozen, shard.frozen, weights))
    return stored, state_arrays


def _state_bytes(state_arrays, kind: str) -> float:
    """Bytes one device holds of the ``(arrays, shardings, memory kind)`` entries in ``kind``."""
    return float(
        sum(
            _local_elements(x.shape, sh) * jnp.dtype(x.dtype).itemsize
            for arrays, shardings, k in state_arrays
            if k == kind
            for x, sh in zip(jax.tree.leaves(arrays), jax.tree.leaves(shardings))
        )
    )


def _argument_bytes(state_arrays, batch, n: int, model_state) -> float:
    """The step's arguments on one device: the state's device-memory arrays, this device's rows
    of the batch, and the (replicated) model state."""

    def nbytes(tree):
        return sum(
            math.prod(np.shape(x)) * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree)
        )

    states = _state_bytes(state_arrays, "device")
    return states + nbytes(batch) / n + (0 if model_state is None else nbytes(model_state))


def _stacked(loss_fn, master, micro, extras, flat_routes, gather_per_layer, widening) -> list[bool]:
    """For each leaf: whether the step uses it one layer's slice at a time."""
    paths = [path_str(p) for p, _ in jax.tree_util.tree_leaves_with_path(master)]
    if gather_per_layer is not None:
        return [is_under(q, gather_per_layer) for q in paths]
    if widening or any(r.fetch is Fetch.ON_USE for r in flat_routes):
        # Weights fetched on use (stage 3, stage 2's whole weights, whole half-precision
        # weights on XLA:CPU): the step descends into the loss's scans and uses one slice of a
        # stack per iteration, except a stack split over devices along its stacked axis.
        scanned = scanned_leaves(loss_fn, master, micro, extras)
        return [s and r.dim != 0 for s, r in zip(scanned, flat_routes)]
    # Weights used where they are: the loss's own scans read one slice per iteration, and
    # their backward pass writes the stack's gradient into a whole buffer made up front.
    return scanned_leaves(loss_fn, master, micro, extras)


def _update_bytes(
    master,
    stored,
    shard,
    tx,
    flat_routes,
    plan: ZeroPlan,
    path: UpdatePath,
    native: bool = False,
    *,
    grads: list[float],
    free: float = 0.0,
) -> float:
    """What the device holds while the update runs along ``path`` (the step's ``UpdatePath``):
    the gradients (``grads``, one per leaf of ``master``, the trainable parameters), the update
    direction, whole where the gradients were all-reduced (XLA keeps the reduced and the
    unscaled gradients), fused into each leaf's update where they arrive sharded; and offloaded
    state brought in. An update on the host (ZeRO-Offload) holds only the gradients waiting for
    their copy to the host, unscaled one leaf at a time on the way unless ``native`` (they are
    unscaled on the host). ``free``: bytes of dead buffers an unfused update direction is
    written into."""
    local_master = [
        _local_elements(a.shape, sh)
        for a, sh in zip(jax.tree.leaves(stored.master), jax.tree.leaves(shard.master))
    ]
    if not plan.traits.separate_host_memory:
        # Host memory is device memory (XLA:CPU): on every path nothing is copied, and the
        # device holds what an update of state in device memory holds.
        path = UpdatePath.IN_PLACE
    if path is UpdatePath.ON_HOST:
        return sum(grads) + (0.0 if native else F32 * max(local_master, default=0))
    looped = [False] * len(grads)
    if _fused_update(plan):
        # (state copied in: the loop's new state is the parameter's state as made, counted below)
        direction, looped = _update_loops(tx, master, only_fp32=path.copies_state_in)
    else:
        all_reduced = not any(r.sharded_grad for r in flat_routes)
        direction = F32 * (sum(local_master) if all_reduced else max(local_master))
    if path is UpdatePath.IN_PLACE:
        return sum(grads) + direction - min(free, direction)
    shared, per_parameter = _brought_in_bytes(stored, shard, tx, master, path)
    if path is UpdatePath.BROUGHT_IN_WHOLE:  # all of the state comes in at once
        return sum(grads) + direction + shared
    # Streamed one parameter at a time, each one's results back on the host before the next
    # one's state comes in: parameter i's update holds its state twice (as brought in, and
    # as made: a skipped step keeps the old values, so both live until the new ones are back
    # on the host) and the gradients not yet read: those after it, and its own unless a loop
    # widened it into its fp32 buffer (``direction``).
    later = list(itertools.accumulate(reversed(grads)))[::-1][1:] + [0.0]
    return (
        direction
        + shared
        + max(
            (
                after + (0.0 if loop else g) + 2 * state
                for g, after, loop, state in zip(grads, later, looped, per_parameter)
            ),
            default=0.0,
        )
    )


def _fused_update(plan: ZeroPlan) -> bool:
    """Whether each leaf's update direction on the device is fused into its update, never a
    buffer of its own: on one device no collective reduces the gradients, and where a skipped
    step is a select (GPUs, ``Traits.cond_updates_in_place`` false) XLA computes direction and
    new state in one pass per leaf. (XLA:CPU's ``lax.cond`` update materialises the
    directions.)"""
    return plan.data_size == 1 and not plan.traits.cond_updates_in_place


def _update_loops(tx, master, only_fp32: bool) -> tuple[float, list[bool]]:
    """``(the largest loop's output bytes, for each leaf of
    ``master``, whether a loop reads its gradient, derived from it alone, scalars aside)``."""
    opt_state = jax.eval_shape(tx.init, master)
    closed = jax.make_jaxpr(tx.update)(master, opt_state, master)
    count = len(jax.tree.leaves(master))
    looped = [False] * count

    def walk(jaxpr, sources) -> float:
        """``sources``: for each variable, the gradients it is computed from."""
        found = 0.0
        for eqn in jaxpr.eqns:
            # (a scalar, such as a global norm, does not make a gradient another's)
            inputs = [
                sources.get(v, frozenset())
                if not isinstance(v, Literal) and v.aval.ndim
                else frozenset()
                for v in eqn.invars
            ]
            if eqn.primitive.name in ("scan", "while"):
                found = max(
                    found,
                    float(
                        sum(
                            math.prod(v.aval.shape) * v.aval.dtype.itemsize
                            for v in eqn.outvars
                            if not only_fp32 or v.aval.dtype == jnp.float32
                        )
                    ),
                )
                for leaves in inputs:
                    if len(leaves) == 1:
                        looped[next(iter(leaves))] = True
            elif jaxprs.call_body(eqn) is not None:
                inner, _ = jaxprs.open_jaxpr(jaxprs.call_body(eqn))
                found = max(found, walk(inner, dict(zip(inner.invars, inputs))))
            derived = frozenset().union(*inputs)
            sources.update((v, derived) for v in eqn.outvars)
        return found

    # tx.update(updates, opt_state, params): the gradients are its first inputs
    first = {v: frozenset([i]) for i, v in enumerate(closed.jaxpr.invars[:count])}
    return walk(closed.jaxpr, first), looped


def _without_data(spec):
    return P(*[None if axis in (DATA, (DATA, CONTEXT)) else axis for axis in spec])


def _brought_in_bytes(stored, shard, tx, master, path: UpdatePath) -> tuple[float, list[float]]:
    """Offloaded state an update on the device copies in: ``(shared, per parameter)``, the
    state shared by all parameters (a step count) and each parameter's master and optimizer
    state, in the order of ``master``'s leaves, where ``path`` streams it
    (``UpdatePath.STREAMED``); ``(all of it, [])`` where it is brought in whole."""
    sizes = [
        float(_local_elements(x.shape, sh) * jnp.dtype(x.dtype).itemsize)
        for arrays, shardings in (
            (stored.master, shard.master),
            (stored.opt_state, shard.opt_state),
        )
        for x, sh in zip(jax.tree.leaves(arrays), jax.tree.leaves(shardings))
    ]
    if path is not UpdatePath.STREAMED:
        return float(sum(sizes)), []
    count = len(jax.tree.leaves(master))
    groups = list(range(count)) + owners(tx, master, jax.eval_shape(tx.init, master))
    per_group = [0.0] * count
    shared = 0.0
    for g, size in zip(groups, sizes):
        if g < 0:
            shared += size
        else:
            per_group[g] += size
    return shared, per_group


def remat_recompute_bytes(
    plain, remat, *, grad_accum: int, num_layers: int, backend: str | None = None
) -> float:
    """What one layer's remat makes again in the backward pass, for ``estimate_step``'s
    ``recompute_bytes``: ``plain`` and ``remat`` are the same step without and with remat
    (objects with ``loss_fn, params, batch, plan, prec, gather_per_layer``; the stack of
    ``num_layers`` layers scanned under ``gather_per_layer``)."""
    micro = micro_batch(remat.batch, remat.plan.batch_split, grad_accum, remat.plan.context_size)
    with backends.tracing_for(_compiled_for(remat.plan, backend).traits):  # where remat may offload
        kept = [
            residual_bytes(p.loss_fn, p.params, micro, p.prec, p.gather_per_layer)
            for p in (plain, remat)
        ]
    # The layer being differentiated holds its recomputed activations and, beside them, the
    # cotangent of the largest (attention scores: XLA:GPU keeps both in fp32). The scan
    # stacks each activation over the layers, hence the division.
    largest = (
        largest_residual(plain.loss_fn, plain.params, micro, plain.prec, plain.gather_per_layer)
        / num_layers
    )
    return max(kept[0] - kept[1], 0.0) / num_layers + largest
