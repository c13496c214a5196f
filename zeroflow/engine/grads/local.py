"""Per-device gradients of the loss, run inside ``shard_map`` over ``data``: how each weight
reaches the loss, how its gradient leaves the backward pass, and accumulation over micro-batches.

Every parameter takes one ``Route`` (``zeroflow.engine.grads.routes``, decided once per layout):
- stage 3: the weight is a shard, all-gathered on use and again for the backward pass
  (``gather_on_use`` for any model; inside the layer loop one layer at a time with
  ``gather_per_layer``); its gradient comes out reduce-scattered;
- stage 2: the weight is whole, and its gradient is reduce-scattered inside the backward pass as
  soon as it is complete (``scatter_grad_on_use``; per layer inside the layer loop);
- stages 0-1: whole weight, whole gradient, all-reduced once per step;
- with ``offload="optimizer+params"`` the layer stack stays in host memory and each layer is
  copied in when it runs (``stream_in``);
- a frozen weight (``Reduce.NONE``) is fetched the same way but enters the loss as a
  constant: it is not differentiated, so no gradient of it is ever computed, and the
  gradients leave with holes (None) where the frozen weights are.
A gradient that leaves the backward pass sharded is fp32 and already summed over devices; a
whole one is summed over micro-batches locally and reduced at the end.

What the loss gets besides weights and data (``extras``): ``model_state`` (threaded through the
micro-batches in order, then averaged over ``data``) and ``rng`` (one key per device and
micro-batch, folded from the step's key). Both are data to the engine, never weights.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from zeroflow.backend.mesh import zero_axes
from zeroflow.engine import fp8_state as fp8_states
from zeroflow.engine import offload
from zeroflow.engine.grads import gather_on_use, sources
from zeroflow.engine.grads.collectives import reduce_scatter, stream_in
from zeroflow.engine.grads.collectives import varying as _varying
from zeroflow.engine.grads.dequantized import source_of
from zeroflow.engine.grads.loss_errors import explained
from zeroflow.engine.grads.routes import Fetch, Reduce, Route, is_route, trained
from zeroflow.engine.grads.sources import Stage3Collectives
from zeroflow.engine.plan import ZeroPlan
from zeroflow.engine.quantized import dequantize, is_quantized
from zeroflow.util.tree import path_str


class WeightAndStandIn(NamedTuple):
    """A weight handed to the loss as stored (a shard, a whole weight or a host copy) together
    with the zero ``stand_in`` its gradient is taken against (see ``scatter_grad_on_use`` and
    ``stream_in``): the loss never differentiates ``weight`` itself. ``nn.scan`` slices both
    fields, so ``gather_layer`` gets one layer of each."""

    weight: jax.Array
    stand_in: jax.Array


def _is_pair(x) -> bool:
    return isinstance(x, WeightAndStandIn)


def _shard_shape(shape, r: Route, n: int) -> tuple[int, ...]:
    """This device's shard of a leaf of ``shape`` (padded first when its route pads it)."""
    stored = r.padded or shape[r.dim]
    return tuple(stored // n if d == r.dim else s for d, s in enumerate(shape))


ENGINE_METRICS = ("loss", "grad_norm", "loss_scale", "skipped", "applied", "consecutive_skips")
"Metric names the step reports itself; an aux entry may not reuse one."


def split_loss(out, model_state=None):
    """``(loss, aux, new_model_state)`` from what ``loss_fn`` returned, checked. ``model_state``:
    the state the loss was given (None when the state carries none)."""
    carries = model_state is not None
    if carries:
        if not (isinstance(out, tuple) and len(out) == 3):
            raise ValueError(
                "the state carries model_state, so loss_fn must return (loss, aux, new_model_state)"
            )
        loss, aux, new_state = out
        _check_new_model_state(model_state, new_state)
        new_state = jax.tree.map(
            lambda new, old: jnp.asarray(new, old.dtype), new_state, model_state
        )
    else:
        if isinstance(out, tuple) and len(out) == 3:
            raise ValueError(
                "loss_fn returned (loss, aux, new_model_state) but the state carries no "
                "model_state; pass model_state= to zf.init_train_state"
            )
        if isinstance(out, tuple) and len(out) != 2:
            raise ValueError(f"loss_fn must return loss or (loss, aux), got a tuple of {len(out)}")
        (loss, aux), new_state = (out if isinstance(out, tuple) else (out, {})), None
    if len(jnp.shape(loss)) != 0:
        raise ValueError(f"loss_fn must return a scalar loss, got shape {jnp.shape(loss)}")
    if not isinstance(aux, dict):
        raise ValueError(f"loss_fn's aux must be a dict of metrics, got {type(aux).__name__}")
    clash = sorted(k for k in aux if k in ENGINE_METRICS)
    if clash:
        raise ValueError(
            f"loss_fn's aux key {clash[0]!r} collides with the step's own metric of that "
            f"name; rename it (the step reports {', '.join(ENGINE_METRICS)})"
        )
    return jnp.asarray(loss, jnp.float32), aux, new_state


def _check_new_model_state(old, new) -> None:
    old_def, new_def = jax.tree.structure(old), jax.tree.structure(new)
    if old_def != new_def:  # type: ignore[operator]  # jaxlib's PyTreeDef has no stub
        raise ValueError(
            f"loss_fn's new model_state has structure {new_def}, the state's is {old_def}"
        )
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(old), jax.tree.leaves(new)):
        if jnp.shape(a) != jnp.shape(b):
            raise ValueError(
                f"loss_fn's new model_state {path_str(path)} has shape {jnp.shape(b)}, "
                f"the state's has {jnp.shape(a)}"
            )


def local_grads(
    params,
    batch,
    scale,
    extras,
    *,
    loss_fn,
    routes,
    plan: ZeroPlan,
    grad_accum: int,
    per_layer: str | None,
    prefetch: int,
    gather_dtype,
    collectives: Stage3Collectives,
    compute_dtype,
    collective: bool = True,
):
    """``(grads, loss, aux, model_state, fp8_state)``: gradients of the (scaled) loss on this
    device's batch, with the loss and aux averaged over devices, the new model state averaged
    over devices and the new FP8 state the max over them (``zeroflow.engine.fp8_state``).
    ``routes``: each leaf's ``Route`` (``step_routes``). ``extras``: a dict with
    ``model_state``, ``rng`` (the step's key) and/or ``fp8_state`` when the state carries
    them. ``collective=False`` is the one-device case, run without shard_map. ``prefetch``:
    how many units ahead a weight fetched on use may be fetched (``gather_on_use.call``). ``collectives``: the plan's (``Stage3Collectives.of``):
    how stage-3 weights and gradients travel, and what every gradient is summed over devices
    in (its ``reduce_dtype``). ``gather_dtype``: the dtype stage-3 weights stored in fp32 (no
    compute copy) are cast to as they are gathered; None: their own. ``compute_dtype``: what
    quantized frozen weights are dequantized to (None: their own)."""
    varying = _varying if collective else (lambda x: x)
    extras = dict(extras)
    if "rng" in extras:  # one key per device: fold in its index on the data axis
        extras["rng"] = jax.random.fold_in(
            extras["rng"], jax.lax.axis_index(zero_axes()) if collective else 0
        )
    grads, loss, aux, model_state, fp8_state = _accumulated(
        params,
        batch,
        scale,
        extras,
        loss_fn=loss_fn,
        routes=routes,
        plan=plan,
        grad_accum=grad_accum,
        per_layer=per_layer,
        varying=varying,
        prefetch=prefetch,
        gather_dtype=gather_dtype,
        collectives=collectives,
        compute_dtype=compute_dtype,
    )
    if not collective:
        return grads, loss, aux, model_state, fp8_state
    reduce_dtype = collectives.reduce_dtype
    grads = jax.tree.map(
        lambda g, r: g if r.sharded_grad else _all_reduced(g, reduce_dtype), grads, trained(routes)
    )
    return (
        grads,
        jax.lax.pmean(loss, zero_axes()),
        # A metric may be the same on every context device already (a count over whole rows).
        jax.tree.map(lambda a: jax.lax.pmean(_varying(a), zero_axes()), aux),
        jax.tree.map(_across_devices, model_state),
        fp8_states.max_over_devices(fp8_state),
    )


def _across_devices(x):
    """Model state after the step: floating leaves averaged over ``data`` (cross-replica batch
    statistics); other leaves (counters, the same on every device) take the maximum."""
    if jnp.issubdtype(x.dtype, jnp.inexact):
        return jax.lax.pmean(x, zero_axes())
    return jax.lax.pmax(x, zero_axes())


def _accumulated(
    params,
    batch,
    scale,
    extras,
    *,
    loss_fn,
    routes,
    plan: ZeroPlan,
    grad_accum: int,
    per_layer: str | None,
    varying,
    prefetch: int,
    gather_dtype,
    collectives: Stage3Collectives,
    compute_dtype,
):
    """Gradients summed over micro-batches, the mean loss and aux, the model state after the
    last one, the new FP8 state their max. Micro-batch ``i`` gets the key ``fold_in(rng, i)``."""
    old_fp8 = extras.get("fp8_state")
    stored = params  # whole / host weights are read from here; the loss differentiates stand-ins
    dtypes, params = _used_dtypes_and_stand_ins(params, routes, plan, varying, gather_dtype)
    # Nothing sums the gradients (one data device, one micro-batch): they stay as the backward
    # pass made them until the update reads them (see native_gradients).
    native = native_gradients(plan, grad_accum)
    widens, reduce_dtype = plan.traits.widens_half_precision, collectives.reduce_dtype
    gather_layer = (
        None
        if per_layer is None
        else _layer_gatherer(
            routes[per_layer], dtypes[per_layer], varying, collectives, widens, compute_dtype
        )
    )

    def grads_of(micro, model_state, key):
        def scaled_loss(p, fp8_state):
            # The model state's containers are rebuilt at this trace level: Flax NNX variables
            # may only be mutated inside the trace that made them.
            given = {
                **({} if model_state is None else {"model_state": _rebuilt(model_state)}),
                **({} if key is None else {"rng": key}),
                **({} if fp8_state is None else {"fp8_state": fp8_state}),
            }
            # A hole of the caller's own tree (eqx.partition's None) has no route: it stays one.
            seen = jax.tree.map(
                lambda x, w, r: None if r is None else _visible(x, w, r, varying),
                p,
                stored,
                routes,
                is_leaf=_is_hole,
            )
            out = _call_gathering(
                loss_fn,
                seen,
                routes,
                dtypes,
                micro,
                prefetch,
                widens,
                gather_layer,
                given,
                collectives,
                compute_dtype,
            )
            loss, aux, new_state = split_loss(out, model_state)
            return loss * scale, (loss, aux, new_state)

        # the "gradient" with respect to the FP8 state is its next value (fp8_state.py)
        (_, (loss, aux, new_state)), (g, new_fp8) = jax.value_and_grad(
            scaled_loss, argnums=(0, 1), has_aux=True
        )(params, old_fp8)
        g = jax.tree.map(
            lambda x, r: _reduce_late(x if native else x.astype(jnp.float32), r, reduce_dtype),
            g,
            trained(routes),
        )
        return g, loss, aux, new_state, new_fp8

    return _over_micro_batches(grads_of, batch, extras, grad_accum, varying)


def _used_dtypes_and_stand_ins(params, routes, plan: ZeroPlan, varying, gather_dtype):
    """``(dtypes, stand_ins)``: the dtype each leaf is used in (a sharded trained leaf is cast
    to ``gather_dtype`` as it is gathered; frozen leaves are stored in the dtype they are used
    in, quantized codes in their own), and what the loss is differentiated against per leaf
    (``_differentiable``; None for a frozen leaf)."""
    dtypes = jax.tree.map(
        lambda x, r: (
            jnp.dtype(gather_dtype) if gather_dtype and r.sharded and not r.frozen else x.dtype
        ),
        params,
        routes,
    )
    stand_ins = jax.tree.map(
        lambda x, r: (
            None if r.frozen else _differentiable(x, r, plan.data_size, varying, plan.weight_copies)
        ),
        params,
        routes,
    )
    return dtypes, stand_ins


def _differentiable(x, r: Route, n: int, varying, copies: int = 1):
    """What the loss is differentiated against for one leaf: zeros shaped like the gradient
    that leaves the backward pass stand in for the weight (see zeroflow.engine.grads.collectives),
    fp32 shards where it is reduced on use; else the weight itself. ``copies``: a stage-3
    shard is a piece of one of that many copies (hpZ), so the 1/N gradient is that much
    shorter along its ZeRO dimension."""
    if r.reduce is Reduce.ON_USE:
        shape = (
            tuple(s // copies if d == r.dim else s for d, s in enumerate(x.shape))
            if r.sharded
            else _shard_shape(x.shape, r, n)
        )
        return varying(jnp.zeros(shape, jnp.float32))
    if r.stream:
        return varying(jnp.zeros(x.shape, x.dtype))
    return varying(x)


def _visible(x, w, r: Route, varying):
    """What the loss sees for one leaf: the weight as it is, or a ``WeightAndStandIn`` pair of
    the stored weight ``w`` (shard, whole or in host memory) and its stand-in ``x``; a frozen
    weight as stored (a constant of the differentiated function)."""
    if r.frozen:
        return w if r.stream else varying(w)
    if r.stream:
        return WeightAndStandIn(w, x)
    if r.reduce is not Reduce.ALL_REDUCE:
        # gather_layer / sources.Sharded / sources.Whole(dim) fetch it
        return WeightAndStandIn(varying(w), x)
    return x


def _layer_gatherer(
    routes, dtypes, varying, collectives: Stage3Collectives, widens: bool, compute_dtype=None
):
    """``gather_layer``: one layer's slice of the stack -> its compute weights on the device,
    through the layer's slice of the same source any other fetch uses (``Source.layer``).
    Under the ``save_all_but_fetched`` remat policy the backward pass fetches it again.
    ``collectives``, ``widens``: as for ``_source``; a quantized leaf's bytes are gathered as
    they are and dequantized to ``compute_dtype``."""

    def frozen(r: Route, x, dt, packed: bool = False):  # fetched without a gradient path
        weight = offload.to_device(varying(x)) if r.stream else x
        if not r.sharded:
            return weight
        source = _layer_source(r, dt, collectives, widens)
        if packed and isinstance(source, sources.Frozen):
            source = source.as_bytes()
        return source.fetch(weight)

    def one(r: Route, x, dt):
        if r.fetch is not Fetch.PER_LAYER:
            return x
        if r.frozen:
            return frozen(r, x, dt)
        if r.stream and r.reduce is not Reduce.ON_USE:
            return stream_in(x.weight, x.stand_in)
        weight = offload.to_device(varying(x.weight)) if r.stream else x.weight
        return _layer_source(r, dt, collectives, widens).fetch_for_grad((weight, x.stand_in))

    def one_or_bytes(r, x, dt):
        if is_quantized(x) and r.data.fetch is Fetch.PER_LAYER:
            data = frozen(r.data, x.data, dt.data, packed=True)
            return dequantize(x.replace(data=data), compute_dtype)
        return one(r, x, dt)

    def gather_layer(layer_params):
        return jax.tree.map(
            one_or_bytes,
            routes,
            layer_params,
            dtypes,
            is_leaf=lambda x: is_route(x) or is_quantized(x),
        )

    return gather_layer


def native_gradients(plan: ZeroPlan, grad_accum: int) -> bool:
    """Whether the step's gradients stay in the dtype the backward pass makes them in (the
    compute dtype for half-precision weights) until the update reads them, widened and
    unscaled there, leaf by leaf: where no sum over devices or micro-batches needs fp32 (one
    data device, one micro-batch). No whole fp32 copy of the gradients is made before the
    update, and with the update on the host (ZeRO-Offload) they cross to it at half the size.
    The values are the same: widening later is exact."""
    return plan.data_size == 1 and grad_accum == 1


def _over_micro_batches(grads_of, batch, extras, grad_accum: int, varying):
    """``grads_of`` summed over ``grad_accum`` micro-batches of ``batch`` (a scan), the loss
    and aux averaged, the FP8 state their max; the model state is threaded through them in
    order (it differs per device)."""
    model_state, key = extras.get("model_state"), extras.get("rng")

    def micro_key(i):
        return None if key is None else jax.random.fold_in(key, i)

    if grad_accum == 1:
        return grads_of(batch, model_state, micro_key(0))
    micro = jax.tree.map(lambda x: x.reshape(grad_accum, -1, *x.shape[1:]), batch)
    first = jax.tree.map(lambda x: x[0], micro)
    g, loss, aux, _, fp8 = jax.eval_shape(grads_of, first, model_state, micro_key(0))
    zeros = jax.tree.map(lambda s: varying(jnp.zeros(s.shape, s.dtype)), (g, loss, aux, fp8))
    model_state = jax.tree.map(varying, model_state)

    def body(carry, xs):
        (*sums, amax), state = carry
        mb, i = xs
        g, loss, aux, state, fp8 = grads_of(mb, state, micro_key(i))
        sums = jax.tree.map(jnp.add, tuple(sums), (g, loss, aux))
        return ((*sums, fp8_states.max_over_micro_batches(amax, fp8)), state), None

    ((grads, loss, aux, fp8), model_state), _ = jax.lax.scan(
        body, (zeros, model_state), (micro, jnp.arange(grad_accum))
    )
    aux = jax.tree.map(lambda a: a / grad_accum, aux)
    return grads, loss / grad_accum, aux, model_state, fp8


def _is_hole(x) -> bool:
    return x is None


def _rebuilt(tree):
    """``tree`` with every pytree node made anew around the same leaves."""
    leaves, treedef = jax.tree.flatten(tree)
    return jax.tree.unflatten(treedef, leaves)


def _all_reduced(g, dtype):
    """``g`` summed over ``data`` in ``dtype`` (``Precision.reduce``), in its own dtype."""
    return jax.lax.psum(g.astype(dtype), zero_axes()).astype(g.dtype)


def _reduce_late(g, r: Route, dtype=jnp.float32):
    """Per micro-batch: a gradient to be reduce-scattered that the backward pass left whole (a
    streamed stack split along its layer axis) is reduce-scattered now."""
    if r.reduce is Reduce.AFTER:
        return reduce_scatter(g, r.split_dim, r.padded, dtype)
    return g


def _source(r: Route, dtype, collectives: Stage3Collectives, widens: bool) -> sources.Source:
    """The source of a leaf as its route stores it (``.layer()``: of one layer's slice).
    ``collectives``: how stage-3 weights and their gradients travel (ZeRO++), and what whole
    gradients are reduced in. ``widens``: the backend widens each use of a half-precision weight (XLA:CPU), so a whole
    weight's use waits for its unit's inputs like a gather."""
    if r.frozen:
        return sources.Frozen(
            r.dim if r.sharded else None,
            dtype,
            r.cut,
            ordered=r.sharded or widens,
            collectives=collectives,
        )
    if r.sharded:
        return sources.Sharded(r.split_dim, dtype, r.cut, r.padded, collectives=collectives)
    scattered = r.reduce is Reduce.ON_USE
    return sources.Whole(
        r.dim if scattered else None,
        r.padded if scattered else None,
        ordered=widens,
        reduce_dtype=collectives.reduce_dtype,
    )


def _layer_source(r: Route, dtype, collectives: Stage3Collectives, widens: bool) -> sources.Source:
    """The source of one layer's slice of a leaf fetched one layer at a time: such a leaf is
    split within its layers or not at all, never along its layer axis, so the slice has one."""
    layer = _source(r, dtype, collectives, widens).layer()
    if layer is None:
        raise AssertionError(f"{r} is fetched per layer but split along its layer axis")
    return layer


def _call_gathering(
    loss_fn,
    seen,
    routes,
    dtypes,
    micro,
    prefetch,
    widens,
    gather_layer,
    given,
    collectives: Stage3Collectives,
    compute_dtype,
):
    """``loss_fn(seen, micro[, gather_layer], **given)`` with the weights routed ``on_use``
    fetched just before each use (``gather_on_use``). ``given``: the model state and key, passed
    to the replay as data. ``collectives``: how stage-3 weights and gradients travel (ZeRO++).
    A quantized frozen weight (``zeroflow.engine.quantized``) is always fetched on use: its
    bytes as its route says, then dequantized to ``compute_dtype``."""
    loss_fn = explained(loss_fn)  # one readable error where jax cannot trace the loss here
    call = (
        (lambda p, b, kw: loss_fn(p, b, **kw))
        if gather_layer is None
        else (lambda p, b, kw: loss_fn(p, b, gather_layer, **kw))
    )
    top = jax.tree.map(
        lambda r, dt: _source(r, dt, collectives, widens) if r.fetch is Fetch.ON_USE else None,
        routes,
        dtypes,
        is_leaf=is_route,
    )
    leaves, treedef = jax.tree.flatten(seen, is_leaf=lambda x: _is_pair(x) or is_quantized(x))
    # jaxlib ships no stub for its compiled PyTreeDef, so mypy cannot see its methods
    flat = treedef.flatten_up_to(top)  # type: ignore[attr-defined]
    # A quantized leaf fetched per layer reaches the loss as stored: ``gather_layer`` gathers
    # and dequantizes each layer's slice.
    per_layer = [
        is_quantized(r) and r.data.fetch is Fetch.PER_LAYER
        for r in treedef.flatten_up_to(routes)  # type: ignore[attr-defined]
    ]
    specs = [
        None if layered else source_of(x, compute_dtype, spec.data) if is_quantized(x) else spec
        for x, spec, layered in zip(leaves, flat, per_layer)
    ]
    if not any(specs):
        return call(seen, micro, given)
    return gather_on_use.call(
        lambda ls, b, kw: call(jax.tree.unflatten(treedef, ls), b, kw),
        leaves,
        specs,
        micro,
        given,
        order=True,
        prefetch=prefetch,
    )
