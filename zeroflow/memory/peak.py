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
- ``activations``: what the backward pass keeps from the forward pass in device memory (the
  residuals of ``jax.vjp`` of the loss on one device's micro-batch, the weights themselves
  excluded); residuals a remat policy offloads (remat 'offload_dots') are ``host_activations``,
  not part of the device peak;
- ``layer_in_flight``: the unit being differentiated: one scanned layer (``gather_per_layer``)
  or the largest weight otherwise, as fetched for use plus its whole fp32 local gradient
  before that is reduced;
- ``widened``: XLA:CPU up to jaxlib 0.10 only (``Traits.widens_half_dots``): it multiplies
  half-precision matrices in fp32 and converts a scanned layer stack once, outside the loop
  (GPUs, and XLA:CPU from 0.11, use bf16/fp16 directly);
- ``update``: while the optimizer runs: the gradients, the update direction optax builds (one
  fp32 array per master shard; on one GPU fused into each leaf's update, except a loop's
  outputs, ``_looped_update_bytes``) and, with ``offload="optimizer", update_on="device"``,
  one parameter's master and optimizer state brought in from the host and made anew beside
  it, with the gradients not yet read; with ``update_on="host"``, only the gradients waiting
  for their copy to the host.

The peak is ``model_states + max(backward, update)`` with ``backward = whole_weights +
gradients + activations + layer_in_flight + widened``. docs/memory.md compares it with
``memory_analysis()`` for every stage, offload and remat choice.
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
from zeroflow.autocast import autocast
from zeroflow.engine.mesh import DATA
from zeroflow.engine.state import abstract_master, init_train_state, state_shardings
from zeroflow.engine.update import owners, streamable
from zeroflow.engine import frozen as frozen_weights
from zeroflow.util import jaxprs
from zeroflow.util.compat import scan_split
from zeroflow.engine.grads.local import native_gradients
from zeroflow.engine.grads.routes import Fetch, Reduce, Route, step_routes
from zeroflow.memory.trace_cache import remembered
from zeroflow.engine.plan import ZeroPlan
from zeroflow.util.tree import path_str
from zeroflow.engine.precision import Precision

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

    @property
    def peak_bytes(self) -> float:
        return self.model_states + max(self.backward_start, self.backward_end, self.update)

    @property
    def phase(self) -> str:
        """The moment that sets the peak: "backward_start", "backward_end" or "update"."""
        moments = {"backward_start": self.backward_start, "backward_end": self.backward_end,
                   "update": self.update}
        return max(moments, key=moments.get)

    def terms(self) -> dict[str, float]:
        return dataclasses.asdict(self)


def _local_elements(shape, sharding) -> int:
    return math.prod(sharding.shard_shape(tuple(shape)) if sharding is not None else shape)


def _kind_bytes(tree, kind: str) -> float:
    """Bytes one device holds of ``tree``'s leaves in memory ``kind`` (None counts as device)."""
    total = 0.0
    for leaf in jax.tree.leaves(tree):
        sharding = getattr(leaf, "sharding", None)
        if (getattr(sharding, "memory_kind", None) or "device") == kind:
            total += _local_elements(leaf.shape, sharding) * jnp.dtype(leaf.dtype).itemsize
    return total


def _device_bytes(tree) -> float:
    return _kind_bytes(tree, "device")


def scanned_leaves(loss_fn, params, batch, extras: dict | None = None) -> list[bool]:
    """For each leaf of ``params``: whether a ``lax.scan`` in the loss takes one slice of it per
    iteration (a stack of layers), which the stage-3 step then fetches one slice at a time."""
    closed = jax.make_jaxpr(lambda p, b, e: loss_fn(p, b, **e))(params, batch, extras or {})
    count = len(jax.tree.leaves(params))
    found: set[int] = set()

    def visit(jaxpr, leaf_of):
        for eqn in jaxpr.eqns:
            invars = [(v, leaf_of.get(v)) if not isinstance(v, Literal) else (v, None)
                      for v in eqn.invars]
            if eqn.primitive.name == "scan":
                split = sum(scan_split(eqn.params))
                found.update(i for _, i in invars[split:] if i is not None)
            elif jaxprs.call_body(eqn) is not None:  # inlined by the fetch-on-use replay too
                inner, _ = jaxprs.open_jaxpr(jaxprs.call_body(eqn))
                visit(inner, {iv: i for (_, i), iv in zip(invars, inner.invars) if i is not None})

    visit(closed.jaxpr, {v: i for i, v in enumerate(closed.jaxpr.invars[:count])})
    return [i in found for i in range(count)]


@remembered  # a plan traces the same loss for every stage and offload
def activation_residuals(loss_fn, params, batch, *, gather_per_layer: str | None = None,
                         extras: dict | None = None, memory: str | None = None,
                         trainable: tuple[bool, ...] | None = None) -> list:
    """``ShapeDtypeStruct``s of what ``jax.vjp`` of ``loss_fn(params, batch)`` keeps for the
    backward pass, the parameters themselves excluded (also as a scan keeps them: its slices
    stacked again). Traced abstractly: nothing runs. ``extras``: the keywords the step passes
    the loss (``model_state``, ``rng``). ``memory``: only those in ``"device"`` or in ``"host"``
    memory (a remat policy's offloaded residuals), default all. ``trainable``: one bool per
    leaf of ``params`` (flatten order); the frozen ones are constants of the vjp, as in the
    step (what only their gradient would need is not kept)."""
    found: list = []

    def probe(params, batch, extras):
        leaves, treedef = jax.tree.flatten(params)
        keep = trainable or (True,) * len(leaves)

        def loss(trained):
            given = iter(trained)
            p = treedef.unflatten([next(given) if t else x for t, x in zip(keep, leaves)])
            out = (loss_fn(p, batch, **extras) if gather_per_layer is None
                   else loss_fn(p, batch, lambda x: x, **extras))
            return out[0] if isinstance(out, tuple) else out
        _, vjp = jax.vjp(loss, [x for t, x in zip(keep, leaves) if t])
        inputs = jax.tree.leaves(params)
        weights = {(tuple(p.shape), p.dtype) for p in inputs}
        found.extend(jax.ShapeDtypeStruct(r.shape, r.dtype) for r in jax.tree.leaves(vjp)
                     if not any(r is p for p in inputs)
                     and (tuple(r.shape), r.dtype) not in weights
                     and memory in (None, _memory_of(r)))
        return 0

    jax.make_jaxpr(probe)(params, batch, extras or {})
    return found


def _traits_for(plan: ZeroPlan, platform: str | None) -> backends.Traits:
    if platform is None or plan.traits.platform == platform:
        return plan.traits
    return backends.for_platform(platform)


def _memory_of(x) -> str:
    space = getattr(getattr(x, "aval", None), "memory_space", None)
    return "host" if space is not None and space.name.lower() == "host" else "device"


def estimate_step(loss_fn, params, batch, tx, plan: ZeroPlan, prec: Precision, *,
                  grad_accum: int = 1, gather_per_layer: str | None = None,
                  backend: str | None = None, recompute_bytes: float = 0.0,
                  model_state=None, rng=None, trainable=None) -> PeakEstimate:
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
    (1/N at stage 3) and nothing else."""

    master = abstract_master(params)
    mask = frozen_weights.trainable_mask(trainable, master)
    flat_mask = tuple(jax.tree.leaves(mask))
    stored, shard, state_arrays = _stored_state(master, tx, plan, prec, mask)
    n, model = plan.data_size, plan.model_size
    layouts = plan.layouts(master)
    route_tree = step_routes(layouts, plan, prec, gather_per_layer, grad_accum, trainable=mask)
    flat_routes = jax.tree.leaves(route_tree, is_leaf=lambda x: isinstance(x, Route))
    shapes = [x.shape for x in jax.tree.leaves(master)]
    compute_sh = jax.tree.leaves(plan.compute_shardings(master, memory_kind=None))
    whole = [_local_elements(s, sh.update(spec=_without_data(sh.spec))) for s, sh in
             zip(shapes, compute_sh)]  # elements on a device with data unsplit (TP split kept)
    half = jnp.dtype(prec.compute_dtype).itemsize < 4
    backend = backend or plan.traits.platform
    traits = _traits_for(plan, backend)
    widening = half and traits.widens_half_dots  # XLA:CPU up to jaxlib 0.10
    # A unit's half-precision weights (or gradients) crossing devices go through fp32 copies
    # where collectives widen (XLA:CPU, every version).
    wide_collectives = half and traits.widens_half_precision and n > 1
    width = jnp.dtype(prec.compute_dtype).itemsize
    fetched_width = F32 if widening or wide_collectives else width

    states = _argument_bytes(state_arrays, batch, n, model_state)
    stored_compute = prec.params != "fp32"
    micro = _micro_batch(batch, n, grad_accum)
    extras = {k: v for k, v in (("model_state", model_state), ("rng", rng)) if v is not None}
    # (whole half-precision weights are fetched on use where collectives widen: fetches_whole)
    stacked = _stacked(loss_fn, master, micro, extras, flat_routes, gather_per_layer,
                       half and traits.widens_half_precision)
    # (a frozen fp32 weight is stored whole below stage 3: nothing to gather)
    gathered_whole = [F32 * w if (not stored_compute and plan.stage in (1, 2) and r.dim is not None
                                  and not r.frozen) else 0.0 for w, r in zip(whole, flat_routes)]
    if plan.offloads_params:  # weights outside the streamed stack are copied in whole
        gathered_whole = [g + (width * w if r.fetch is not Fetch.PER_LAYER else 0.0)
                          for g, w, r in zip(gathered_whole, whole, flat_routes)]
    # Gradients leave the backward pass in fp32, except where nothing sums them: they stay as
    # the backward pass makes them until the update reads them (native_gradients), in the
    # weights' dtype unless reduced on use (fp32 stand-ins).
    native = native_gradients(plan, grad_accum)
    # With accumulation, an fp32 sum beside each micro-batch's own gradients, which stay in the
    # compute dtype (their widening fuses into the sum) unless reduce-scattered first. XLA:CPU
    # computes half precision in fp32 and keeps the gradients so.
    made = [F32 if widening or r.reduce in (Reduce.ON_USE, Reduce.AFTER) else width
            for r in flat_routes]
    grad_widths = [(F32 + m) if grad_accum > 1 else (m if native else F32) for m in made]
    grads = [0.0 if r.frozen else gw * (w / n if r.sharded_grad else w)
             for w, r, gw in zip(whole, flat_routes, grad_widths)]

    # Traced for the backend compiled for: a remat policy may offload only where host memory
    # is a memory of its own (``zeroflow.models.gpt.offload_policy``).
    with backends.tracing_for(traits):
        activations, host_activations = (
            _residual_bytes(loss_fn, master, micro, prec, gather_per_layer, extras, memory=kind,
                            trainable=flat_mask) / model for kind in ("device", "host"))
    layer_stack = [(w, shape, t) for w, shape, st, t in zip(whole, shapes, stacked, flat_mask) if st]
    unit = (sum(w / shape[0] for w, shape, _ in layer_stack) if layer_stack else max(whole))
    # The unit's local fp32 gradient: of its trainable weights only.
    unit_grad = (sum(w / shape[0] for w, shape, t in layer_stack if t) if layer_stack
                 else max((w for w, t in zip(whole, flat_mask) if t), default=0.0))
    unit_grad_width = width if native and not widening else F32
    # The unit's weights take memory of their own when fetched (gathered at stage 3, copied out
    # of a scanned stack, widened by XLA:CPU); a resident unstacked weight is used in place,
    # as is every weight on a single device (stage 3 there gathers nothing).
    gathers = plan.shards_compute and n > 1
    fetched = fetched_width if (gathers or layer_stack or widening or wide_collectives) else 0
    widened = 0.0
    if widening and layer_stack:
        widened = F32 * sum(w / (n if plan.shards_compute else 1) for w, _, _ in layer_stack)
    # Once XLA:CPU has widened a whole stored stack (stages 0-2), the donated half-precision
    # stack is dead until the new weights are written: the stack's gradients go into its buffer.
    reused = 0.0
    if widened and not plan.shards_compute and stored_compute:
        reused = min(width * sum(w for w, _, _ in layer_stack),
                     sum(g for g, st in zip(grads, stacked) if st))

    # The backward pass peaks at its start (all it keeps from the forward pass, the first layer
    # being differentiated, and the gradient buffers of a scanned stack, allocated whole up
    # front) or at its end (every gradient; weights and activations of unstacked layers have
    # been freed one by one as the pass went back through them).
    in_flight = max(fetched * unit, recompute_bytes / model) + unit_grad_width * unit_grad
    at_start = (sum(gathered_whole) + activations + in_flight
                + sum(g for g, st in zip(grads, stacked) if st) + widened - reused)
    # Near the end, a unit still fetches its weights at stage 3 (only the very first layer's
    # input gradient is not needed).
    at_end = (sum(g for g, st in zip(gathered_whole, stacked) if st) + sum(grads)
              + (fetched if plan.shards_compute else 0) * unit + unit_grad_width * unit_grad
              + widened - reused)
    # Whole compute weights gathered anew after the update (stages 1-2) are dead while it runs
    # (donated): unless the stack's gradients already went into their buffer (reused), the
    # update direction goes there (XLA:CPU from jaxlib 0.11, which no longer widens the stack).
    free = (width * sum(w for w, _, t in layer_stack if t)
            if plan.stage in (1, 2) and stored_compute and not reused and backend == "cpu" else 0.0)
    update = _update_bytes(frozen_weights.split(master, mask)[0], stored, shard, tx,
                           flat_routes, plan, backend, native,
                           grads=[g for g, t in zip(grads, flat_mask) if t], free=free)
    host_state = _state_bytes(state_arrays, "pinned_host")
    return PeakEstimate(model_states=states, host_state=host_state,
                        gathered_weights=sum(gathered_whole),
                        gradients=sum(grads), activations=activations,
                        layer_in_flight=in_flight, widened=widened,
                        backward_start=at_start, backward_end=at_end, update=update,
                        host_activations=host_activations)


def _stored_state(master, tx, plan: ZeroPlan, prec: Precision, trainable=None):
    """The state as stored (abstract; leaves ZeRO pads are larger than the parameters), its
    shardings, and its ``(arrays, shardings)`` pairs."""

    shard = state_shardings(master, tx, plan, prec, trainable=trainable)
    stored = jax.eval_shape(lambda: init_train_state(master, tx, plan, prec,
                                                        trainable=trainable))
    # Memory kinds from the plan, not from the shardings: a zf.target_mesh's abstract devices
    # expose no memories, so jax drops a sharding's pinned_host there.
    host = "pinned_host" if plan.offloads else "device"
    weights = "pinned_host" if plan.offloads_params else "device"
    state_arrays = [(stored.master, shard.master, host), (stored.opt_state, shard.opt_state, host)]
    if shard.compute is not None:
        state_arrays.append((stored.compute, shard.compute, weights))
    if shard.frozen is not None:
        state_arrays.append((stored.frozen, shard.frozen, weights))
    return stored, shard, state_arrays


def _state_bytes(state_arrays, kind: str) -> float:
    """Bytes one device holds of the ``(arrays, shardings, memory kind)`` entries in ``kind``."""
    return float(sum(_local_elements(x.shape, sh) * jnp.dtype(x.dtype).itemsize
                     for arrays, shardings, k in state_arrays if k == kind
                     for x, sh in zip(jax.tree.leaves(arrays), jax.tree.leaves(shardings))))


def _argument_bytes(state_arrays, batch, n: int, model_state) -> float:
    """The step's arguments on one device: the state's device-memory arrays, this device's rows
    of the batch, and the (replicated) model state."""
    nbytes = lambda tree: sum(math.prod(np.shape(x)) * jnp.dtype(x.dtype).itemsize  # noqa: E731
                              for x in jax.tree.leaves(tree))
    states = _state_bytes(state_arrays, "device")
    return states + nbytes(batch) / n + (0 if model_state is None else nbytes(model_state))


def _stacked(loss_fn, master, micro, extras, flat_routes, gather_per_layer, widening) -> list[bool]:
    """For each leaf: whether the step uses it one layer's slice at a time."""
    paths = [path_str(p) for p, _ in jax.tree_util.tree_leaves_with_path(master)]
    if gather_per_layer is not None:
        return [(q + "/").startswith(gather_per_layer + "/") for q in paths]
    if widening or any(r.fetch is Fetch.ON_USE for r in flat_routes):
        # Weights fetched on use (stage 3, stage 2's whole weights, whole half-precision
        # weights on XLA:CPU): the step descends into the loss's scans and uses one slice of a
        # stack per iteration, except a stack split over devices along its stacked axis.
        scanned = scanned_leaves(loss_fn, master, micro, extras)
        return [s and r.dim != 0 for s, r in zip(scanned, flat_routes)]
    # Weights used where they are: the loss's own scans read one slice per iteration, and
    # their backward pass writes the stack's gradient into a whole buffer made up front.
    return scanned_leaves(loss_fn, master, micro, extras)


def _update_bytes(master, stored, shard, tx, flat_routes, plan: ZeroPlan, backend: str,
                  native: bool = False, *, grads: list[float], free: float = 0.0) -> float:
    """What the device holds while the update runs: the gradients (``grads``, one per leaf
    of ``master``, the trainable parameters), the update direction, whole where the gradients
    were all-reduced (XLA keeps the reduced and the unscaled gradients), fused into each leaf's
    update where they arrive sharded; and offloaded state brought in. An update on the host
    (ZeRO-Offload) holds only the gradients waiting for their copy to the host, unscaled one
    leaf at a time on the way unless ``native`` (they are unscaled on the host). ``free``:
    bytes of dead buffers an unfused update direction is written into."""
    local_master = [_local_elements(a.shape, sh) for a, sh in
                    zip(jax.tree.leaves(stored.master), jax.tree.leaves(shard.master))]
    if plan.updates_on_host and backend != "cpu":
        return sum(grads) + (0.0 if native else F32 * max(local_master, default=0))
    streams = plan.offloads and backend != "cpu"
    looped = [False] * len(grads)
    if _fused_update(plan, backend):
        # (streamed: the loop's new state is the parameter's state as made, counted below)
        direction, looped = _update_loops(tx, master, only_fp32=streams)
    else:
        all_reduced = not any(r.sharded_grad for r in flat_routes)
        direction = F32 * (sum(local_master) if all_reduced else max(local_master))
    if not streams:
        # (XLA:CPU's host and device memory are one: nothing is brought in there.)
        return sum(grads) + direction - min(free, direction)
    shared, per_parameter = _streamed_in_bytes(master, stored, shard, tx)
    if per_parameter is None:  # not streamable: all of the state comes in at once
        return sum(grads) + direction + shared
    # Streamed one parameter at a time, each one's results back on the host before the next
    # one's state comes in: parameter i's update holds its state twice (as brought in, and
    # as made: a skipped step keeps the old values, so both live until the new ones are back
    # on the host) and the gradients not yet read: those after it, and its own unless a loop
    # widened it into its fp32 buffer (``direction``).
    later = list(itertools.accumulate(reversed(grads)))[::-1][1:] + [0.0]
    return direction + shared + max(
        (after + (0.0 if loop else g) + 2 * state
         for g, after, loop, state in zip(grads, later, looped, per_parameter)), default=0.0)


def _fused_update(plan: ZeroPlan, backend: str) -> bool:
    """Whether each leaf's update direction is fused into its update, never a buffer of its
    own: on one device no collective reduces the gradients, and where a skipped step is a
    select (GPUs, ``Traits.cond_updates_in_place`` false) XLA computes direction and new
    state in one pass per leaf. (XLA:CPU's ``lax.cond`` update materialises the directions.)"""
    return plan.data_size == 1 and backend != "cpu" and not plan.updates_on_host


def _looped_update_bytes(tx, master, only_fp32: bool = False) -> float:
    """The largest output of a loop inside ``tx.update`` (8-bit AdamW updates each stack of
    layers one slice at a time, ``zeroflow.optim.by_slices``): a loop's outputs (the stack's
    fp32 direction and its new moments) are whole buffers before the rest of the update reads
    them; ``only_fp32``: its fp32 outputs only (the direction, and the moments' scales). Bytes
    of the whole parameters: used where nothing is split over devices."""
    return _update_loops(tx, master, only_fp32)[0]


def _update_loops(tx, master, only_fp32: bool) -> tuple[float, list[bool]]:
    """``(the largest loop's output bytes, as _looped_update_bytes; for each leaf of
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
            inputs = [sources.get(v, frozenset()) if not isinstance(v, Literal) and v.aval.ndim
                      else frozenset() for v in eqn.invars]
            if eqn.primitive.name in ("scan", "while"):
                found = max(found, float(sum(math.prod(v.aval.shape) * v.aval.dtype.itemsize
                                             for v in eqn.outvars
                                             if not only_fp32 or v.aval.dtype == jnp.float32)))
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


def _micro_batch(batch, n: int, grad_accum: int):
    """One device's micro-batch of the global ``batch``, abstract."""
    rows = {np.shape(x)[0] for x in jax.tree.leaves(batch)}
    if len(rows) != 1 or next(iter(rows)) % (n * grad_accum):
        raise ValueError(f"batch of {sorted(rows)} rows does not divide by data axis size {n} x "
                         f"grad_accum {grad_accum}")
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct((np.shape(x)[0] // (n * grad_accum),)
                                                       + tuple(np.shape(x)[1:]), x.dtype), batch)


def _residual_bytes(loss_fn, params, micro, prec: Precision, gather_per_layer,
                    extras: dict | None = None, memory: str | None = None,
                    trainable: tuple[bool, ...] | None = None) -> float:
    """Bytes of the loss's residuals on one micro-batch, as the step runs it (autocast too);
    ``memory``: only those in device or in host memory (``activation_residuals``)."""
    compute_params = jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), prec.compute_dtype),
                                  params)
    fn = loss_fn
    if prec.autocast != "none":
        fn = autocast(loss_fn, dtype=prec.autocast)
    residuals = activation_residuals(fn, compute_params, micro, gather_per_layer=gather_per_layer,
                                     extras=extras, memory=memory, trainable=trainable)
    return float(sum(math.prod(r.shape) * jnp.dtype(r.dtype).itemsize for r in residuals))


def _largest_residual(loss_fn, params, micro, prec: Precision, gather_per_layer) -> float:
    compute_params = jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), prec.compute_dtype),
                                  params)
    residuals = activation_residuals(loss_fn, compute_params, micro,
                                     gather_per_layer=gather_per_layer)
    return float(max((math.prod(r.shape) * jnp.dtype(r.dtype).itemsize for r in residuals),
                     default=0))


def _with_shardings(shapes, shardings, dtype=None):
    return jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, dtype or s.dtype, sharding=sh),
                        shapes, shardings)


def _without_data(spec):
    return P(*[None if axis == DATA else axis for axis in spec])


def _streamed_in_bytes(master, stored, shard, tx) -> tuple[float, list[float] | None]:
    """Offloaded state an on-device update brings in: ``(shared, per parameter)``, the state
    shared by all parameters (a step count) and each parameter's master and optimizer state,
    in the order of ``master``'s leaves, where ``zeroflow.engine.update.streamed`` can split the
    update; ``(all of it, None)`` where it cannot."""
    on_device = lambda tree: jax.tree.map(lambda sh: sh.with_memory_kind("device"), tree)  # noqa: E731
    sizes = ([_device_bytes(_with_shardings(m, s)) for m, s in
              zip(jax.tree.leaves(stored.master), jax.tree.leaves(on_device(shard.master)))]
             + [_device_bytes(_with_shardings(o, s)) for o, s in
                zip(jax.tree.leaves(stored.opt_state), jax.tree.leaves(on_device(shard.opt_state)))])
    if not streamable(tx, master):
        return float(sum(sizes)), None
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


def remat_recompute_bytes(plain, remat, *, grad_accum: int, num_layers: int,
                          backend: str | None = None) -> float:
    """What one layer's remat makes again in the backward pass, for ``estimate_step``'s
    ``recompute_bytes``: ``plain`` and ``remat`` are the same step without and with remat
    (objects with ``loss_fn, params, batch, plan, prec, gather_per_layer``; the stack of
    ``num_layers`` layers scanned under ``gather_per_layer``)."""
    micro = _micro_batch(remat.batch, remat.plan.data_size, grad_accum)
    with backends.tracing_for(_traits_for(remat.plan, backend)):  # where remat may offload
        kept = [_residual_bytes(p.loss_fn, p.params, micro, p.prec, p.gather_per_layer)
                for p in (plain, remat)]
    # The layer being differentiated holds its recomputed activations and, beside them, the
    # cotangent of the largest (attention scores: XLA:GPU keeps both in fp32). The scan
    # stacks each activation over the layers, hence the division.
    largest = _largest_residual(plain.loss_fn, plain.params, micro, plain.prec,
                                plain.gather_per_layer) / num_layers
    return max(kept[0] - kept[1], 0.0) / num_layers + largest
