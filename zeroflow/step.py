"""The ZeRO train step: one jitted, state-donating ``train_step(state, batch)``.

Forward and backward run inside ``shard_map`` over the ``data`` axis so that the collectives
are explicit and the same on every backend:
- stage 0/1: local gradients are all-reduced (``psum``) once per step;
- stage 2:   each micro-batch's gradients are reduce-scattered (``psum_scatter``) onto the
             device that owns that slice of the master weights, never held whole;
- stage 3:   compute weights arrive sharded and are all-gathered on use; the transpose of that
             gather is the reduce-scatter of their gradients.
The optimizer update then runs on the sharded fp32 arrays outside ``shard_map``, so any optax
transform (global-norm clipping included) sees the true global gradient. ``model`` stays an
automatic axis, which is how tensor-parallel rules compose with ZeRO.
"""
from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax.sharding import PartitionSpec as P

from zeroflow import offload
from zeroflow.mesh import DATA
from zeroflow.plan import LeafLayout, ZeroPlan, path_str
from zeroflow.precision import Precision
from zeroflow.state import TrainState, state_shardings

LossFn = Callable[[Any, Any], Any]


def _is_layout(x) -> bool:
    return isinstance(x, LeafLayout)


def _varying(x):
    """Mark ``x`` as differing across ``data`` so its gradient stays local (no implicit psum)."""
    try:
        return jax.lax.pcast(x, DATA, to="varying")
    except ValueError:  # already varying; how that is spelled on the aval differs by jax version
        return x


def check_batch(batch, divisor: int, data_size: int, grad_accum: int) -> None:
    leaves = jax.tree_util.tree_leaves_with_path(batch)
    if not leaves:
        raise ValueError("batch has no array leaves")
    sizes = {path_str(p): (jnp.shape(x)[0] if jnp.ndim(x) else None) for p, x in leaves}
    if None in sizes.values():
        raise ValueError("every batch leaf needs a leading batch axis; scalars found at "
                         + ", ".join(k for k, v in sizes.items() if v is None))
    if len(set(sizes.values())) > 1:
        raise ValueError(f"batch leaves disagree on the leading batch size: {sizes}")
    size = next(iter(sizes.values()))
    if size % divisor:
        raise ValueError(f"batch size {size} does not divide by data axis size {data_size} x "
                         f"grad_accum {grad_accum} = {divisor}")


def _split_loss(out):
    loss, aux = out if isinstance(out, tuple) else (out, {})
    if len(jnp.shape(loss)) != 0:
        raise ValueError(f"loss_fn must return a scalar loss, got shape {jnp.shape(loss)}")
    if not isinstance(aux, dict):
        raise ValueError(f"loss_fn's aux must be a dict of metrics, got {type(aux).__name__}")
    return jnp.asarray(loss, jnp.float32), aux


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def gather_weight(shard_f32, dim: int, dtype):
    """All-gather a stage-3 weight shard in the compute ``dtype`` for use.

    The shard comes in as fp32 (an exact upcast of the compute-dtype shard) so that its
    gradient, the reduce-scatter of the devices' gradients, is summed and returned in fp32 and
    never rounded to bf16/fp16 (whose range a sum over many devices can overflow).
    """
    return jax.lax.all_gather(shard_f32.astype(dtype), DATA, axis=dim, tiled=True)


def _gather_fwd(shard_f32, dim, dtype):
    return gather_weight(shard_f32, dim, dtype), None


def _gather_bwd(dim, dtype, _, cotangent):
    # Reduce in fp32 whatever the compute dtype, as stage 2 does. (XLA:CPU also rejects a
    # bf16 reduce-scatter.)
    return (jax.lax.psum_scatter(cotangent.astype(jnp.float32), DATA, scatter_dimension=dim, tiled=True),)


gather_weight.defvjp(_gather_fwd, _gather_bwd)


def _gathered_on_use(lay: LeafLayout, plan: ZeroPlan) -> bool:
    return plan.shards_compute and lay.zero_dim is not None


def _reduce_now(g, lay: LeafLayout, plan: ZeroPlan):
    """Per micro-batch reduction: stage >= 2 reduce-scatters every leaf ZeRO can split."""
    if lay.zero_dim is None or not plan.shards_grads:
        return g  # reduced once, after accumulation
    if plan.shards_compute:
        return g  # gather_weight's backward already reduce-scattered it
    return jax.lax.psum_scatter(g, DATA, scatter_dimension=lay.zero_dim, tiled=True)


def _reduce_at_end(g, lay: LeafLayout, plan: ZeroPlan):
    if lay.zero_dim is not None and plan.shards_grads:
        return g
    return jax.lax.psum(g, DATA)


def _local_grads(params, batch, scale, *, loss_fn, layouts, plan: ZeroPlan, grad_accum: int,
                 per_layer: str | None, from_host: bool = False, collective: bool = True):
    """Runs per device inside shard_map: gradients of the (scaled) loss on the local batch.

    ``collective=False`` is the one-device case, run without shard_map: nothing to reduce, and
    XLA:CPU does not remove a single-participant all-reduce by itself.
    """
    grads, loss, aux = _accumulated_grads(params, batch, scale, loss_fn=loss_fn, layouts=layouts,
                                          plan=plan, grad_accum=grad_accum, per_layer=per_layer,
                                          from_host=from_host,
                                          varying=_varying if collective else (lambda x: x))
    if not collective:
        return grads, loss, aux
    grads = jax.tree.map(lambda g, lay: _reduce_at_end(g, lay, plan), grads, layouts)
    return grads, jax.lax.pmean(loss, DATA), jax.tree.map(lambda a: jax.lax.pmean(a, DATA), aux)


def _per_layer_flags(layouts, plan: ZeroPlan, prefix: str | None, from_host: bool):
    """Which leaves the loss's ``gather_layer`` handles, as two trees of bools.

    ``lazy``: stage-3 leaves under ``prefix`` (stacked layers, leading layer axis) whose ZeRO
    dimension is not the layer axis; they are all-gathered one layer at a time.
    ``streamed``: if ``from_host`` (compute weights stored in host memory), the leaves under
    ``prefix`` that can be taken one layer at a time (all but stage-3 leaves split along the
    layer axis); they stay in host memory and each layer's slice is copied to the device when
    that layer runs.
    """
    def under(path):
        return prefix is not None and (path_str(path) + "/").startswith(prefix + "/")

    def lazy(path, lay):
        return under(path) and _gathered_on_use(lay, plan) and lay.zero_dim > 0

    def streamed(path, lay):
        return (from_host and under(path)
                and not (_gathered_on_use(lay, plan) and lay.zero_dim == 0))

    return (jax.tree_util.tree_map_with_path(lazy, layouts, is_leaf=_is_layout),
            jax.tree_util.tree_map_with_path(streamed, layouts, is_leaf=_is_layout))


class _Streamed(NamedTuple):
    """A layer-stacked weight kept in host memory, with the device-side stand-in its gradient is
    taken against. ``nn.scan`` slices both fields, so ``gather_layer`` gets one layer of each."""
    host: jax.Array
    delta: jax.Array


@jax.custom_vjp
def _stream_in(host, delta):
    """``host`` (one layer's slice, in host memory) copied to the device as ``delta.dtype``.

    The gradient goes to ``delta``, a device array of zeros standing in for the weight: jax
    types a host value's cotangent as host memory, so differentiating ``host`` itself would
    ship every layer's gradient to the host and mix memory spaces in the backward pass. The
    forward never reads ``delta``, so XLA drops it; only its gradient, built one layer at a
    time on the device like any other weight's, is used.
    """
    return offload.to_device(host).astype(delta.dtype)


def _stream_in_fwd(host, delta):
    return _stream_in(host, delta), None


def _stream_in_bwd(_, cotangent):
    return None, cotangent  # host is never differentiated (None: a symbolic zero)


_stream_in.defvjp(_stream_in_fwd, _stream_in_bwd)


def _accumulated_grads(params, batch, scale, *, loss_fn, layouts, plan: ZeroPlan, grad_accum: int,
                       varying, per_layer: str | None = None, from_host: bool = False):
    """Gradients summed over micro-batches (reduced per micro-batch at stage >= 2), with the
    mean loss and aux over micro-batches."""
    dtypes = jax.tree.map(lambda x: x.dtype, params)
    lazy, streamed = _per_layer_flags(layouts, plan, per_layer, from_host)
    host = params  # streamed leaves are read from here; the rest are differentiated directly

    def differentiable(x, lay, stream):
        # Stage-3 shards are differentiated as fp32 upcasts (see gather_weight); streamed leaves
        # through a device-side stand-in (see _stream_in); the rest as they are.
        dtype = jnp.float32 if _gathered_on_use(lay, plan) else x.dtype
        return varying(jnp.zeros(x.shape, dtype) if stream else x.astype(dtype))

    params = jax.tree.map(differentiable, params, layouts, streamed)

    def gather_layer(layer_params):
        """One layer's slice of ``params[per_layer]`` -> its compute weights on the device."""
        def one(lay, x, dt, late, stream):
            # Below stage 3 the host copy is the same on every device, but its result must vary
            # over data like ``delta`` (whose gradient stays local) for the cotangent to fit.
            x = _stream_in(varying(x.host), x.delta) if stream else x
            return gather_weight(x, lay.zero_dim - 1, dt) if late else x
        return jax.tree.map(one, layouts[per_layer], layer_params, dtypes[per_layer],
                            lazy[per_layer], streamed[per_layer], is_leaf=_is_layout)

    def grads_of(micro):
        def scaled_loss(p):
            def use(x, h, lay, dt, late, stream):
                if stream:
                    return _Streamed(h, x)
                return gather_weight(x, lay.zero_dim, dt) if _gathered_on_use(lay, plan) and not late else x
            full = jax.tree.map(use, p, host, layouts, dtypes, lazy, streamed)
            out = loss_fn(full, micro) if per_layer is None else loss_fn(full, micro, gather_layer)
            loss, aux = _split_loss(out)
            return loss * scale, (loss, aux)

        (_, (loss, aux)), g = jax.value_and_grad(scaled_loss, has_aux=True)(params)
        g = jax.tree.map(lambda x, lay: _reduce_now(x.astype(jnp.float32), lay, plan), g, layouts)
        return g, loss, aux

    if grad_accum == 1:
        grads, loss, aux = grads_of(batch)
    else:
        micro = jax.tree.map(lambda x: x.reshape(grad_accum, -1, *x.shape[1:]), batch)
        first = jax.tree.map(lambda x: x[0], micro)
        shapes = jax.eval_shape(grads_of, first)
        zeros = jax.tree.map(lambda s: varying(jnp.zeros(s.shape, s.dtype)), shapes)

        def body(acc, mb):
            out = grads_of(mb)
            return jax.tree.map(jnp.add, acc, out), None

        (grads, loss, aux), _ = jax.lax.scan(body, zeros, micro)
        loss = loss / grad_accum
        aux = jax.tree.map(lambda a: a / grad_accum, aux)
    return grads, loss, aux


def _place(tree, shardings):
    return jax.tree.map(lambda x, s: jax.device_put(x, s), tree, shardings)


def _update(grads, master, opt_state, finite, *, tx: optax.GradientTransformation,
            compute_dtype):
    """The optimizer update on sharded fp32 arrays; a non-finite step changes nothing.
    Returns ``(new_master, new_opt_state, new_compute)`` (``new_compute`` None for fp32)."""
    def apply(grads, master, opt_state):
        updates, new_opt = tx.update(grads, opt_state, master)
        return optax.apply_updates(master, updates), new_opt

    def keep(grads, master, opt_state):
        return master, opt_state

    # A cond, not jnp.where over the results: the skipped branch is never computed, and XLA can
    # update the optimizer state in place instead of copying it.
    new_master, new_opt = jax.lax.cond(finite, apply, keep, grads, master, opt_state)
    new_compute = None if compute_dtype is None else jax.tree.map(
        lambda x: x.astype(compute_dtype), new_master)
    return new_master, new_opt, new_compute


def train_step(state: TrainState, batch, *, loss_fn: LossFn, tx: optax.GradientTransformation,
               plan: ZeroPlan, prec: Precision, grad_accum: int, per_layer: str | None = None):
    """One optimizer step on a global batch; returns ``(new_state, metrics)``."""
    n = plan.data_size
    check_batch(batch, n * grad_accum, n, grad_accum)
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, jnp.float32), state.master)
    layouts = plan.layouts(abstract)
    shard = state_shardings(abstract, tx, plan, prec)
    batch = jax.tree.map(lambda x: jax.lax.with_sharding_constraint(x, plan.batch_sharding()), batch)

    if per_layer is not None and per_layer not in state.master:
        raise ValueError(f"gather_per_layer={per_layer!r} is not a top-level key of params")
    # Weights as the forward pass reads them: stage 3 keeps them sharded over data, below
    # stage 3 they are whole on every device (fp32 compute gathers them from the master here).
    # Offloaded weights stream in here, whole, except the layer stacks that the loss fetches
    # one layer at a time (gather_layer): those stay in host memory.
    # fp32 at stages 1-2 keeps no compute copy: it is gathered from the master on the device.
    from_host = plan.offload == "optimizer+params" and (state.compute is not None or plan.stage in (0, 3))
    _, streamed = _per_layer_flags(layouts, plan, per_layer, from_host)
    on_device = plan.compute_shardings(abstract, memory_kind=None if plan.offload == "none" else "device")
    compute_sh = jax.tree.map(lambda here, stored, stream: stored if stream else here,
                              on_device, plan.compute_shardings(abstract), streamed)
    params = _place(state.params, compute_sh)
    scale = state.loss_scale.scale if state.loss_scale is not None else jnp.ones((), jnp.float32)

    specs_in = jax.tree.map(lambda lay: lay.data_only_spec(plan.shards_compute), layouts, is_leaf=_is_layout)
    specs_grad = jax.tree.map(lambda lay: lay.data_only_spec(plan.shards_grads), layouts, is_leaf=_is_layout)
    batch_specs = jax.tree.map(lambda _: P(DATA), batch)
    local = functools.partial(_local_grads, loss_fn=loss_fn, layouts=layouts, plan=plan,
                              grad_accum=grad_accum, per_layer=per_layer, from_host=from_host)
    if n == 1:  # one device on the data axis: no shard_map, no collectives to place
        grads, loss, aux = local(params, batch, scale, collective=False)
    else:
        grads, loss, aux = jax.shard_map(
            local, mesh=plan.mesh, in_specs=(specs_in, batch_specs, P()),
            out_specs=(specs_grad, P(), P()), axis_names={DATA})(params, batch, scale)

    # Unscale in fp32 and average over devices and micro-batches.
    grads = jax.tree.map(lambda g: g / (scale * (n * grad_accum)), grads)
    grad_norm = optax.tree.norm(grads)
    finite = jnp.isfinite(grad_norm)  # any inf/nan element makes the norm non-finite

    update = functools.partial(_update, tx=tx,
                               compute_dtype=None if state.compute is None else prec.compute_dtype)
    if plan.offload == "none":
        new_master, new_opt, new_compute = update(grads, state.master, state.opt_state, finite)
    elif plan.update_on == "device":
        # Stream master + optimizer state in, update on the device; _place below streams them
        # back. Nothing but the update reads them, so XLA may start the copies during backward.
        master = offload.to_memory(state.master, shard.master, "device")
        opt_state = offload.to_memory(state.opt_state, shard.opt_state, "device")
        new_master, new_opt, new_compute = update(grads, master, opt_state, finite)
    else:
        # ZeRO-Offload: gradients go to the host (in the master's sharding), the update runs
        # there, and only the compute-dtype weights travel back (via _place below).
        host_grads = offload.to_memory(grads, shard.master, "pinned_host")
        host_finite = offload.to_memory(finite, plan.replicated(), "pinned_host")
        new_master, new_opt, new_compute = offload.on_host(update)(
            host_grads, state.master, state.opt_state, host_finite)

    new_state = TrainState(step=state.step + 1, master=new_master, compute=new_compute,
                           opt_state=new_opt, loss_scale=prec.next_loss_scale(state.loss_scale, finite))
    new_state = _place(new_state, shard)
    metrics = {"loss": loss, "grad_norm": grad_norm, "loss_scale": scale,
               "skipped": jnp.logical_not(finite).astype(jnp.int32), **aux}
    return new_state, metrics


class TrainStep:
    """``step(state, batch) -> (state, metrics)``: one ``jax.jit`` per state layout.

    The jit is built on the first call, when the state's shapes are known, so that its
    ``out_shardings`` are exactly the plan's (``state_shardings``): the new state comes back in
    the layout it went in, the next call hits the compile cache, and donation can reuse every
    buffer. ``lower``/``trace`` and ``jitted(state)`` give the usual AOT access.
    """

    def __init__(self, fn, tx: optax.GradientTransformation, plan: ZeroPlan, prec: Precision, donate: bool):
        self._fn, self._tx, self._plan, self._prec = fn, tx, plan, prec
        self._donate = (0,) if donate else ()
        self._by_layout: dict[Any, Any] = {}

    def jitted(self, state: TrainState):
        """The ``jax.jit`` object for states shaped like ``state``."""
        leaves, treedef = jax.tree.flatten(state)
        key = (treedef, tuple(x.shape for x in leaves))  # cheap: this runs on every step
        if key not in self._by_layout:
            shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, jnp.float32), state.master)
            out = (state_shardings(shapes, self._tx, self._plan, self._prec), self._plan.replicated())
            self._by_layout[key] = jax.jit(self._fn, donate_argnums=self._donate, out_shardings=out)
        return self._by_layout[key]

    def __call__(self, state: TrainState, batch):
        return self.jitted(state)(state, batch)

    def lower(self, state: TrainState, batch):
        return self.jitted(state).lower(state, batch)

    def trace(self, state: TrainState, batch):
        return self.jitted(state).trace(state, batch)


def make_train_step(loss_fn: LossFn, tx: optax.GradientTransformation, plan: ZeroPlan,
                    prec: Precision, grad_accum: int = 1, *, donate: bool = True,
                    gather_per_layer: str | None = None) -> TrainStep:
    """A compiled ``step(state, batch) -> (state, metrics)`` that donates the state.

    ``loss_fn(params, batch)`` returns a scalar loss or ``(loss, aux_dict)``; ``batch`` is a
    pytree whose leaves share a leading global batch axis divisible by data size x grad_accum.

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
    """
    if isinstance(grad_accum, bool) or not isinstance(grad_accum, int) or grad_accum < 1:
        raise ValueError(f"grad_accum must be a positive int, got {grad_accum!r}")
    if not isinstance(plan, ZeroPlan):
        raise ValueError(f"plan must be a zf.ZeroPlan, got {type(plan).__name__}")
    if not isinstance(prec, Precision):
        raise ValueError(f"prec must be a zf.Precision, got {type(prec).__name__}")
    if prec.autocast != "none":  # half-precision compute for a model written in fp32
        from zeroflow.autocast import autocast
        loss_fn = autocast(loss_fn, dtype=prec.autocast)
    step = functools.partial(train_step, loss_fn=loss_fn, tx=tx, plan=plan, prec=prec,
                             grad_accum=grad_accum, per_layer=gather_per_layer)
    return TrainStep(step, tx, plan, prec, donate)
