"""The ZeRO train step: one jitted, state-donating ``train_step(state, batch)``.

Forward and backward run inside ``shard_map`` over the ``data`` axis so that the collectives
are explicit and the same on every backend:
- stage 0/1: local gradients are all-reduced (``psum``) once per step;
- stage 2:   each gradient is reduce-scattered (``psum_scatter``) inside the backward pass as
             soon as it is complete, onto the device that owns that slice of the master weights;
- stage 3:   compute weights arrive sharded and each is all-gathered just before its use, and
             again for the backward pass; its gradient is reduce-scattered.
How weights reach the loss and gradients leave it is ``zeroflow.engine.grads``. The optimizer update
(``zeroflow.engine.update``) then runs on the sharded fp32 arrays outside ``shard_map``, so any optax
transform (global-norm clipping included) sees the true global gradient. ``model`` stays an
automatic axis, which is how tensor-parallel rules compose with ZeRO.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax.sharding import PartitionSpec as P

from zeroflow import backend
from zeroflow.autocast import autocast, fp8
from zeroflow.autocast.precision import Precision
from zeroflow.engine import fp8_state as fp8_states
from zeroflow.engine import frozen as frozen_weights
from zeroflow.engine import offload, padding, update
from zeroflow.engine.grads import (
    Stage3Collectives,
    local_grads,
    native_gradients,
    step_routes,
)
from zeroflow.engine.grads.routes import is_route
from zeroflow.engine.plan import ZeroPlan, abstract_of, is_layout
from zeroflow.engine.plan_rules import batch_split_problem, sequence_split_problem
from zeroflow.engine.state import TrainState, state_shardings_of
from zeroflow.engine.zeropp import hierarchical
from zeroflow.util import compat
from zeroflow.util.tree import path_str

LossFn = Callable[..., Any]


def check_batch(batch, data_size: int, grad_accum: int, context: int = 1) -> None:
    """One readable line where ``batch`` cannot be split as the step splits it: every leaf
    needs the same leading batch axis, which splits over ``grad_accum`` x the data devices
    (``plan_rules.batch_split_problem``), and with ``context`` devices every leaf of two or
    more dimensions a sequence (its second) that splits over them. The memory estimator asks
    the same."""
    leaves = jax.tree_util.tree_leaves_with_path(batch)
    if not leaves:
        raise ValueError("batch has no array leaves")
    scalars = [path_str(p) for p, x in leaves if not jnp.ndim(x)]
    if scalars:
        raise ValueError(
            "every batch leaf needs a leading batch axis; scalars found at " + ", ".join(scalars)
        )
    sizes = {path_str(p): jnp.shape(x)[0] for p, x in leaves}
    if len(set(sizes.values())) > 1:
        raise ValueError(f"batch leaves disagree on the leading batch size: {sizes}")
    problem = batch_split_problem(next(iter(sizes.values())), grad_accum, data_size)
    if problem:
        raise ValueError(problem)
    for path, x in leaves:
        problem = sequence_split_problem(jnp.shape(x)[1], context) if jnp.ndim(x) >= 2 else None
        if problem:
            raise ValueError(f"batch leaf {path_str(path)}: {problem}")


class StepLayout(NamedTuple):
    """Everything about where arrays live that one state layout needs, computed once per layout
    (not per trace) by ``step_layout``, and read by the step and the memory estimator alike."""

    layouts: Any
    "Per-leaf ``LeafLayout``s of the whole tree, frozen leaves included (``trains`` False)."
    state: TrainState
    "The state's shardings, with the trainable/frozen split."
    compute_as_used: Any
    "The compute weights' shardings as the forward pass reads them: in device memory."
    compute_as_stored: Any
    "The compute weights' shardings as the state keeps them between steps (pinned host memory"
    " under ``offload='optimizer+params'``)."
    update_path: update.UpdatePath
    "Where the optimizer update runs (``update.update_path``)."
    compute_refresh: update.ComputeRefresh
    "How the new compute weights reach their stored layout (``update.compute_refresh``)."

    @property
    def trainable(self):
        """The trainable mask (a tree of bools), as the layouts say."""
        return jax.tree.map(lambda lay: lay.trains, self.layouts, is_leaf=is_layout)


def step_layout(
    abstract_master,
    tx: optax.GradientTransformation,
    plan: ZeroPlan,
    prec: Precision,
    model_state=None,
    rng=None,
    trainable=None,
    fp8=None,
) -> StepLayout:
    """The ``StepLayout`` of a state of ``abstract_master`` (the parameters' own, unpadded
    shapes, frozen ones included) under ``plan``; the rest as for ``init_train_state``."""
    mask = frozen_weights.trainable_mask(trainable, abstract_master)
    layouts = plan.layouts(abstract_master, trainable=mask)
    return layout_of(layouts, tx, plan, prec, model_state, rng, fp8)


def layout_of(
    layouts,
    tx: optax.GradientTransformation,
    plan: ZeroPlan,
    prec: Precision,
    model_state,
    rng,
    fp8=None,
) -> StepLayout:
    """The ``StepLayout`` of the parameters' ``layouts`` (``plan.layouts``, whether each leaf
    trains included); ``model_state`` / ``rng`` / ``fp8``: as the state carries them (or
    None)."""
    path = update.update_path(plan, tx, abstract_of(frozen_weights.split(layouts, layouts)[0]))
    used = "device" if plan.offloads else None
    return StepLayout(
        layouts=layouts,
        state=state_shardings_of(layouts, tx, plan, prec, model_state, rng, fp8),
        compute_as_used=plan.shardings_of(layouts, plan.shards_compute, used),
        compute_as_stored=plan.shardings_of(layouts, plan.shards_compute, plan.compute_memory_kind),
        update_path=path,
        compute_refresh=update.compute_refresh(plan, prec.compute_dtype, path),
    )


def _place(tree, shardings):
    return jax.tree.map(lambda x, s: jax.device_put(x, s), tree, shardings)


def train_step(
    state: TrainState,
    batch,
    *,
    loss_fn: LossFn,
    tx: optax.GradientTransformation,
    plan: ZeroPlan,
    prec: Precision,
    grad_accum: int,
    layout: StepLayout,
    per_layer: str | None = None,
    prefetch: int = 0,
):
    """One optimizer step on a global batch; returns ``(new_state, metrics)``: gradients on
    every device, reduced by the plan, then the update where the plan keeps the state."""
    n = plan.data_size
    check_batch(batch, plan.batch_split, grad_accum, plan.context_size)
    batch = jax.tree.map(
        lambda x: jax.lax.with_sharding_constraint(x, plan.batch_sharding(jnp.ndim(x))), batch
    )
    pads = state.padding
    scale = prec.step_scale(state.loss_scale)
    grads, loss, aux, model_state, fp8 = _step_gradients(
        state,
        batch,
        scale,
        loss_fn=loss_fn,
        plan=plan,
        prec=prec,
        grad_accum=grad_accum,
        layout=layout,
        per_layer=per_layer,
        prefetch=prefetch,
    )
    grads, grad_norm, divisor = _averaged(grads, scale * (n * grad_accum), plan, grad_accum)
    finite = jnp.isfinite(grad_norm)  # any inf/nan element makes the norm non-finite
    if not plan.shards_grads:  # whole gradients: into the master's (padded) form for the update
        grads = padding.pad(grads, pads.master, n)
    new_master, new_opt, new_compute = _updated(
        grads, state, finite, divisor, tx=tx, plan=plan, prec=prec, layout=layout
    )
    if plan.hierarchical:  # the within-host copy the next step gathers from
        new_compute = hierarchical.refresh(new_compute, layout.layouts, plan)

    return _next_state(
        state,
        finite,
        loss,
        grad_norm,
        scale,
        aux,
        (model_state, fp8),
        (new_master, new_opt, new_compute),
        prec=prec,
        layout=layout,
    )


def _averaged(grads, divisor, plan: ZeroPlan, grad_accum: int):
    """``(grads, grad_norm, divisor)``: the summed gradients of the scaled loss divided by
    ``divisor`` (loss scale x devices x micro-batches) in fp32, and their global norm.
    Gradients in their own dtype (``native_gradients``) stay as they are, to be widened and
    divided where the update reads them: then ``divisor`` comes back, otherwise None."""
    if native_gradients(plan, grad_accum):
        norm = optax.tree.norm(jax.tree.map(lambda g: g.astype(jnp.float32), grads)) / divisor
        return grads, norm, divisor
    grads = jax.tree.map(lambda g: g / divisor, grads)
    return grads, optax.tree.norm(grads), None


def _next_state(
    state: TrainState, finite, loss, grad_norm, scale, aux, carried, updated, *, prec, layout
):
    """``(new_state, metrics)`` from the ``updated`` (master, opt state, compute) weights and
    the ``carried`` (model state, FP8 state) the loss left: a skipped step (not ``finite``)
    changes nothing, those included (its statistics and amaxes may be NaN); the rng's base key
    and the frozen weights stay as they are."""
    new_master, new_opt, new_compute = updated
    model_state, fp8 = carried
    model_state = jax.tree.map(
        lambda new, old: jnp.where(finite, new, old), model_state, state.model_state
    )
    loss_scale = prec.next_loss_scale(state.loss_scale, finite)
    skipped = jnp.logical_not(finite).astype(jnp.int32)
    new_state = dataclasses.replace(
        state,
        step=state.step + 1,
        applied=state.applied + (1 - skipped),
        master=new_master,
        compute=new_compute,
        opt_state=new_opt,
        loss_scale=loss_scale,
        model_state=model_state,
        fp8=fp8_states.kept_if_skipped(finite, fp8, state.fp8),
    )
    new_state = _place(new_state, layout.state)
    metrics = {
        "loss": loss,
        "grad_norm": grad_norm,
        "loss_scale": scale,
        "skipped": skipped,
        "applied": new_state.applied,
        "consecutive_skips": skipped if loss_scale is None else loss_scale.skips,
        **aux,
    }
    return new_state, metrics


def _step_gradients(
    state: TrainState,
    batch,
    scale,
    *,
    loss_fn: LossFn,
    plan: ZeroPlan,
    prec: Precision,
    grad_accum: int,
    layout: StepLayout,
    per_layer: str | None,
    prefetch: int,
):
    """``(grads, loss, aux, model_state, fp8_state)`` of the loss scaled by ``scale``: each leaf
    routed (``step_routes``) from its layout, gradients as the routes leave them."""
    if per_layer is not None and per_layer not in layout.layouts:
        raise ValueError(f"gather_per_layer={per_layer!r} is not a top-level key of params")
    route_tree = step_routes(layout.layouts, plan, prec, per_layer, grad_accum)
    # What the loss gets besides weights and data: the step's key (local_grads folds in the
    # device and micro-batch), the model state and the FP8 state (delayed scaling).
    extras = {
        **({} if state.model_state is None else {"model_state": state.model_state}),
        **({} if state.rng is None else {"rng": jax.random.fold_in(state.rng, state.step)}),
        **({} if state.fp8 is None else {"fp8_state": state.fp8}),
    }
    local = functools.partial(
        local_grads,
        loss_fn=loss_fn,
        routes=route_tree,
        plan=plan,
        grad_accum=grad_accum,
        per_layer=per_layer,
        prefetch=prefetch,
        gather_dtype=state.padding.cast_on_use,
        collectives=Stage3Collectives.of(plan, prec.reduce_dtype),
        compute_dtype=prec.compute_dtype,
    )
    return _gradients(
        local,
        _compute_params(state, plan, layout, route_tree),
        batch,
        scale,
        extras,
        plan=plan,
        layout=layout,
        routes=route_tree,
    )


def _compute_params(state: TrainState, plan: ZeroPlan, layout: StepLayout, route_tree):
    """Weights as the forward pass reads them, in one pass over the leaves: stage 3 keeps them
    sharded over data, below stage 3 they are whole on every device (fp32 compute gathers them
    from the master here). Offloaded weights stream in here, whole, except the layer stacks
    that the loss fetches one layer at a time (gather_layer): those stay in host memory. A
    frozen leaf (its route's) is read from the frozen weights, laid out as it is stored."""
    trained = state.compute
    if trained is None:  # the master is read: padded where the use is whole (below stage 3)
        pads = None if plan.shards_compute else state.padding.master
        trained = state.master if pads is None else padding.unpad(state.master, pads)
    cast = state.padding.cast_on_use  # no compute copy (stage 3): shards are cast as gathered

    def one(r, weight, used, stored):
        if cast is not None and not r.frozen and not r.sharded:
            weight = weight.astype(cast)
        return jax.device_put(weight, stored if r.stream else used)

    weights = frozen_weights.merge(trained, state.frozen)
    return jax.tree.map(
        one,
        route_tree,
        weights,
        layout.compute_as_used,
        layout.compute_as_stored,
        is_leaf=is_route,
    )


def _gradients(local, params, batch, scale, extras, *, plan: ZeroPlan, layout: StepLayout, routes):
    """``local`` (``local_grads`` bound to the step) on every device's rows of ``batch``:
    gradients as the routes leave them (sharded or whole), loss, aux, model and FP8 state."""
    if plan.data_size == 1:  # one device on the data axis: no shard_map, no collectives to place
        return local(params, batch, scale, extras, collective=False)
    specs_in = jax.tree.map(
        lambda lay: lay.data_only_spec(plan.shards_compute), layout.layouts, is_leaf=is_layout
    )
    specs_grad = jax.tree.map(
        lambda lay, r: None if r.frozen else lay.data_only_spec(r.sharded_grad),
        layout.layouts,
        routes,
        is_leaf=is_layout,
    )
    batch_specs = jax.tree.map(lambda x: plan.batch_spec(jnp.ndim(x)), batch)
    # check_vma off: the loss is the user's one-device code, and jax's varying-axes types
    # refuse some of what a plain jit runs, e.g. a loop whose carry starts from a constant (the
    # same on every device) while its body mixes in this device's rows. The step does not need
    # those types: its collectives are written out, and the ones differentiated inside the
    # loss (all-gather, reduce-scatter, all-to-all) transpose the same way without them. A
    # psum differentiated inside the loss would not (its transpose becomes a second psum).
    return jax.shard_map(
        local,
        mesh=plan.mesh,
        in_specs=(specs_in, batch_specs, P(), P()),
        out_specs=(specs_grad, P(), P(), P(), P()),
        axis_names=plan.manual_axes,
        check_vma=False,
    )(params, batch, scale, extras)


def _updated(
    grads,
    state: TrainState,
    finite,
    divisor,
    *,
    tx: optax.GradientTransformation,
    plan: ZeroPlan,
    prec: Precision,
    layout: StepLayout,
):
    """``(new_master, new_opt_state, new_compute)``: the optax update where
    ``layout.update_path`` says it runs. ``divisor``: what gradients in their own dtype
    (``native_gradients``) are still to be divided by, after widening; None where they come
    unscaled."""
    compute_dtype = None if state.compute is None else prec.compute_dtype
    apply = functools.partial(
        update.apply,
        tx=tx,
        compute_dtype=compute_dtype,
        pads=state.padding,
        skip_by_select=not plan.traits.cond_updates_in_place,
    )
    if layout.update_path is update.UpdatePath.ON_HOST:
        return _updated_on_host(
            grads, state, finite, divisor, apply=apply, plan=plan, layout=layout
        )
    grads = _unscaled(grads, divisor)  # on the device: widened as each leaf's update reads it
    if layout.update_path is update.UpdatePath.STREAMED:
        return update.streamed(
            grads,
            state.master,
            state.opt_state,
            finite,
            tx=tx,
            compute_dtype=compute_dtype,
            shardings=layout.state,
            pads=state.padding,
        )
    leaf_after_leaf = layout.compute_refresh is update.ComputeRefresh.LEAF_AFTER_LEAF
    if layout.update_path is update.UpdatePath.BROUGHT_IN_WHOLE:
        master = offload.to_memory(state.master, layout.state.master, "device")
        opt_state = offload.to_memory(state.opt_state, layout.state.opt_state, "device")
        compute_as_used = frozen_weights.split(layout.compute_as_used, layout.layouts)[0]
        return apply(
            grads,
            master,
            opt_state,
            finite,
            compute_shardings=compute_as_used if leaf_after_leaf else None,
        )
    # UpdatePath.IN_PLACE: the state is in device memory already.
    new_master, new_opt, new_compute = apply(
        grads,
        state.master,
        state.opt_state,
        finite,
        compute_shardings=layout.state.compute if leaf_after_leaf else None,
    )
    if layout.compute_refresh is update.ComputeRefresh.BY_SLICES:
        new_compute = update.gather_by_slices(
            new_compute, layout.state.master, plan.mesh, into=state.compute
        )
    return new_master, new_opt, new_compute


def _unscaled(grads, divisor):
    """``grads`` widened to fp32 and divided by ``divisor``; as they are where it is None."""
    return (
        grads if divisor is None else jax.tree.map(lambda g: g.astype(jnp.float32) / divisor, grads)
    )


def _updated_on_host(
    grads, state: TrainState, finite, divisor, *, apply, plan: ZeroPlan, layout: StepLayout
):
    """ZeRO-Offload (``UpdatePath.ON_HOST``): gradients go to the host (in the master's
    sharding), are unscaled and applied there, and only the compute-dtype weights travel back
    (placed by the caller)."""
    host_grads = offload.to_memory(grads, layout.state.master, "pinned_host")
    host_scalars = offload.to_memory((finite, divisor), plan.replicated(), "pinned_host")

    def unscaled_apply(grads, master, opt_state, scalars):
        finite, divisor = scalars
        return apply(_unscaled(grads, divisor), master, opt_state, finite)

    return offload.on_host(unscaled_apply)(host_grads, state.master, state.opt_state, host_scalars)


def _traced_for(fn, state, batch, *, layout: StepLayout, traits: backend.Traits):
    """``fn`` traced with the plan's backend traits current: code that sees only arrays (the
    model's attention, Pallas kernels) compiles for the mesh's devices, not this process's."""
    with backend.tracing_for(traits):
        return fn(state, batch, layout=layout)


def fp8_overlap_options(plan: ZeroPlan, prec: Precision) -> dict:
    """XLA options for a stage-3 step with FP8 matmuls and gradients summed in bf16 on GPUs:
    the collective pipeliner may move each layer's gradient reduce-scatter into the next
    iteration of the backward loop (the backend's default keeps it in its own iteration).
    FP8 GEMMs halve the backward layer's compute, which then no longer hides that layer's
    reduce-scatter; moved, it overlaps the next layer's (Llama-3-8B shape, 8 x H100, XLA:GPU's
    estimate: 125.0 -> 106.0 ms at 2,048 tokens, 317.5 -> 309.9 ms at 8,192, peak +0.03 /
    +0.23 GB; experiments/results/fp8.md). Not with an fp32 reduction: XLA then fuses the
    cast to fp32 into the weight-gradient GEMM, a GEMM with an fp32 result that its cost
    model prices at ~19 ms per Llama MLP weight (2.3 s per step estimated)."""
    gpu = plan.traits.platform == "gpu"
    if gpu and plan.stage == 3 and prec.autocast == "fp8" and prec.reduce == "bf16":
        return compat.pipelined_reduce_scatter()
    return {}


class TrainStep:
    """``step(state, batch) -> (state, metrics)``: one ``jax.jit`` per state layout.

    The jit is built on the first call, when the state's shapes are known, so that its
    ``out_shardings`` are exactly the plan's (``state_shardings``): the new state comes back in
    the layout it went in, the next call hits the compile cache, and donation can reuse every
    buffer. ``lower``/``trace`` and ``jitted(state)`` give the usual AOT access.
    """

    def __init__(
        self,
        fn,
        tx: optax.GradientTransformation,
        plan: ZeroPlan,
        prec: Precision,
        donate: bool,
        compiler_options: dict | None = None,
        trainable=None,
        find_fp8_sites=None,
    ):
        self._fn, self._tx, self._plan, self._prec = fn, tx, plan, prec
        self._find_fp8_sites = find_fp8_sites
        self._trainable = trainable
        self.compiler_options = {
            **backend.compiler_options(plan.traits),
            **fp8_overlap_options(plan, prec),
            **(compiler_options or {}),
        }
        self._donate = (0,) if donate else ()
        self._by_layout: dict[Any, Any] = {}
        self._layouts: dict[Any, StepLayout] = {}

    def layout(self, state: TrainState) -> StepLayout:
        """The ``StepLayout`` of states shaped like ``state``: what the jit for them is built
        from (the update path included)."""
        key = _shapes_key(state)
        if key not in self._layouts:
            layouts = _param_layouts(state, self._plan)
            if self._trainable is not None:
                _check_same_split(self._trainable, layouts)
            self._layouts[key] = layout_of(
                layouts, self._tx, self._plan, self._prec, state.model_state, state.rng, state.fp8
            )
        return self._layouts[key]

    def jitted(self, state: TrainState):
        """The ``jax.jit`` object for states shaped like ``state``."""
        key = _shapes_key(state)
        if key not in self._by_layout:
            layout = self.layout(state)
            self._by_layout[key] = jax.jit(
                functools.partial(_traced_for, self._fn, layout=layout, traits=self._plan.traits),
                donate_argnums=self._donate,
                compiler_options=self.compiler_options or None,
                out_shardings=(layout.state, self._plan.replicated()),
            )
        return self._by_layout[key]

    def __call__(self, state: TrainState, batch):
        state = self.with_fp8_state(state, batch)
        return self.jitted(state)(state, batch)

    def lower(self, state: TrainState, batch):
        state = self.with_fp8_state(state, batch)
        return self.jitted(state).lower(state, batch)

    def trace(self, state: TrainState, batch):
        state = self.with_fp8_state(state, batch)
        return self.jitted(state).trace(state, batch)

    def with_fp8_state(self, state: TrainState, batch) -> TrainState:
        """``state`` with a first step's FP8 state (scale 1, empty amax histories) for every
        FP8 matmul of this step, under delayed scaling where ``state`` has none yet; else
        ``state`` itself. The sites are found by tracing the step's gradient part (nothing
        computed) on ``batch``'s shapes, so their keys are the step's own (``fp8_state``)."""
        if self._find_fp8_sites is None or state.fp8 is not None:
            return state
        marker = fp8_states.SiteShapes()

        def gradients(state, batch):
            marked = dataclasses.replace(state, fp8=marker)
            return self._find_fp8_sites(marked, batch, layout=self.layout(state))

        with backend.tracing_for(self._plan.traits):
            jax.eval_shape(gradients, state, batch)
        history = self._prec.fp8_history
        abstract = any(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(state.master))
        fresh = fp8_states.fresh_state(marker.found, history, self._plan.replicated(), abstract)
        return dataclasses.replace(state, fp8=fresh)


def _param_layouts(state: TrainState, plan: ZeroPlan):
    """The ``LeafLayout``s of ``state``'s parameters under ``plan``, frozen ones included
    (``trains`` False): each half laid out from its own (unpadded) shapes, then joined."""
    trained = plan.layouts(padding.unpadded_shapes(state.master, state.padding.master))
    if state.frozen is None:
        return trained
    frozen = padding.unpadded_shapes(state.frozen, state.padding.frozen)
    return frozen_weights.merge(trained, plan.layouts(frozen, trainable=False))


def _shapes_key(state: TrainState):
    """What tells one state layout from another: cheap, as it runs on every step."""
    leaves, treedef = jax.tree.flatten(state)
    return treedef, tuple(x.shape for x in leaves)


def _check_same_split(trainable, layouts) -> None:
    """``make_train_step(trainable=...)`` must describe the state it is given, whose leaves'
    ``layouts`` say which train."""
    want = frozen_weights.trainable_mask(trainable, abstract_of(layouts))
    have = jax.tree.leaves(layouts, is_leaf=is_layout)
    differ = [
        path_str(p)
        for (p, w), lay in zip(jax.tree_util.tree_leaves_with_path(want), have)
        if w != lay.trains
    ]
    if differ:
        raise ValueError(
            f"make_train_step's trainable differs from the state's (built by "
            f"init_train_state(trainable=...)) at {', '.join(differ[:4])}"
            + (" ..." if len(differ) > 4 else "")
        )


def make_train_step(
    loss_fn: LossFn,
    tx: optax.GradientTransformation,
    plan: ZeroPlan,
    prec: Precision,
    grad_accum: int = 1,
    *,
    donate: bool = True,
    gather_per_layer: str | None = None,
    prefetch: int | None = None,
    compiler_options: dict | None = None,
    trainable=None,
) -> TrainStep:
    """A compiled ``step(state, batch) -> (state, metrics)`` that donates the state.

    ``loss_fn(params, batch)`` returns a scalar loss or ``(loss, aux_dict)``; ``batch`` is a
    pytree whose leaves share a leading global batch axis divisible by data size x grad_accum.
    When the state carries them, the loss also gets ``model_state=`` (and must then return
    ``(loss, aux, new_model_state)``) and ``rng=`` (a key of its own per step, device and
    micro-batch) as keyword arguments. ``aux`` may not reuse a name of the step's metrics.

    ``gather_per_layer``: the top-level key of stacked layer weights (leading layer axis, e.g.
    the GPT's ``"layers"`` from ``nn.scan``). Then ``loss_fn(params, batch, gather_layer)`` is
    given those weights still sharded, and must call ``gather_layer(one_layer_params)`` inside
    its layer loop: at stage 3 each layer is all-gathered just before it runs (and again in the
    backward pass under remat) instead of the whole model at once. Below stage 3
    ``gather_layer`` returns its input, except with ``offload="optimizer+params"``: then the
    layer weights stay in host memory and ``gather_layer`` copies each layer to the device
    when it runs. The loss must treat ``params[gather_per_layer]`` as opaque until
    ``gather_layer`` returns: scan over it (a leaf may be a pair of host copy and gradient
    stand-in) and hand each layer's slice to ``gather_layer``.
    The result is a ``TrainStep``: a ``jax.jit`` with the plan's output shardings, with
    ``.lower(state, batch)`` for ahead-of-time compilation.

    ``prefetch``: at stage 3, how many operations ahead a weight may be all-gathered (forward
    and backward), so that the gather overlaps the compute before it; each step ahead holds
    one more operation's weights. Default: 1 where collectives run beside compute (GPUs), 0 on
    XLA:CPU (which runs them in line). ``compiler_options``: XLA options
    for this step's compile, over the ones the backend needs (``zeroflow.backend.compiler_options``:
    on GPUs, collective combining bounded so that gradients are reduced one weight at a time).

    Frozen weights: the step reads the trainable/frozen split from the state
    (``init_train_state(trainable=...)``); only the trainable leaves are differentiated, the
    frozen ones enter the loss as constants (fetched on use at stage 3, without a gradient
    path) and come back unchanged. ``trainable`` (optional, the same spellings): checked
    against the state's split on the first call.
    """
    if isinstance(grad_accum, bool) or not isinstance(grad_accum, int) or grad_accum < 1:
        raise ValueError(f"grad_accum must be a positive int, got {grad_accum!r}")
    if not isinstance(plan, ZeroPlan):
        raise ValueError(f"plan must be a zf.ZeroPlan, got {type(plan).__name__}")
    if not isinstance(prec, Precision):
        raise ValueError(f"prec must be a zf.Precision, got {type(prec).__name__}")
    if prec.autocast == "fp8":
        fp8.check_mesh(plan.mesh)
    if prec.autocast != "none":  # half-precision compute for a model written in fp32
        loss_fn = autocast(loss_fn, dtype=prec.autocast, policy=prec.autocast_policy())
    if prec.delayed_fp8:  # the amax histories come as the keyword fp8_state (fp8_state.py)
        loss_fn = fp8_states.loss_with_state(loss_fn)
    if prefetch is None:
        prefetch = 1 if plan.traits.overlaps_collectives else 0
    if isinstance(prefetch, bool) or not isinstance(prefetch, int) or prefetch < 0:
        raise ValueError(f"prefetch must be a non-negative int, got {prefetch!r}")
    bound: dict[str, Any] = dict(loss_fn=loss_fn, plan=plan, prec=prec, grad_accum=grad_accum)
    bound.update(per_layer=gather_per_layer, prefetch=prefetch)
    step = functools.partial(train_step, tx=tx, **bound)
    find_sites = None
    if prec.delayed_fp8:  # the gradient part, with no loss scale, as the step runs it
        find_sites = functools.partial(_step_gradients, scale=jnp.float32(1.0), **bound)
    return TrainStep(step, tx, plan, prec, donate, compiler_options, trainable, find_sites)
