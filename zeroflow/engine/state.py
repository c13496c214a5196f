"""The training state and how it is built directly into its sharded layout."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from flax import struct

from zeroflow.autocast.precision import LossScaleState, Precision
from zeroflow.engine import frozen as frozen_weights
from zeroflow.engine import opt_mirror, padding, quantized
from zeroflow.engine.padding import NO_PADDING, StatePadding
from zeroflow.engine.plan import ZeroPlan, abstract_of, is_layout
from zeroflow.engine.plan_rules import hierarchical_copy_problem
from zeroflow.engine.zeropp import hierarchical
from zeroflow.util.tree import path_str


@struct.dataclass
class TrainState:
    """``step``: steps taken, skipped ones included (the data position; the rng's step);
    ``applied``: optimizer updates applied (equal to optax's own count, which schedules read);
    ``master``: fp32 weights (the optimizer's); ``compute``: the compute-dtype copy, or None when
    the compute dtype is fp32 (then ``params`` is ``master``: one copy only); ``model_state``:
    mutable model variables (e.g. Flax ``batch_stats``) or None; ``rng``: the base key of the
    per-step keys, or None; ``frozen``: the frozen weights (``zeroflow.engine.frozen``) in the compute
    dtype, with holes (None) where the trainable leaves are, or None when every leaf trains;
    ``master``, ``compute``, ``opt_state`` then hold the trainable leaves only (holes at the
    frozen ones). ``fp8``: the amax histories of FP8 matmuls under delayed scaling
    (``zeroflow.engine.fp8_state``), replicated, never seen by the optimizer; None otherwise.
    ``padding`` (static) says which stored arrays carry ZeRO padding."""

    step: jax.Array
    applied: jax.Array
    master: Any
    compute: Any
    opt_state: Any
    loss_scale: LossScaleState | None
    model_state: Any = None
    rng: jax.Array | None = None
    frozen: Any = None
    fp8: Any = None
    padding: StatePadding = struct.field(pytree_node=False, default=NO_PADDING)

    @property
    def stored_params(self):
        """The compute weights as stored (padded where the plan pads them)."""
        return self.master if self.compute is None else self.compute

    @property
    def params(self):
        """The weights the forward pass uses (frozen ones included), in the compute dtype and
        their own shapes."""
        if self.compute is not None:
            trained = padding.unpad(self.compute, self.padding.compute)
        elif self.padding.cast_on_use is not None:  # stage 3 without a compute copy
            dtype = jnp.dtype(self.padding.cast_on_use)
            trained = jax.tree.map(lambda x: x.astype(dtype), self.master_params)
        else:
            trained = self.master_params
        return frozen_weights.merge(trained, self.frozen_params)

    @property
    def frozen_params(self):
        """The frozen weights in their own shapes (holes at the trainable leaves), or None."""
        if self.frozen is None:
            return None
        return padding.unpad(self.frozen, self.padding.frozen)

    @property
    def trainable(self):
        """The trainable mask (a pytree of bools with the parameters' structure)."""
        return frozen_weights.mask_of(self.master, self.frozen)

    @property
    def master_params(self):
        """The fp32 master weights in their own shapes (ZeRO padding sliced off); holes (None) at
        frozen leaves."""
        return padding.unpad(self.master, self.padding.master)


def check_float_params(params) -> None:
    """Every leaf floating point; a ``QuantizedArray`` (``zeroflow.engine.quantized``) counts
    as the floating-point weight it encodes."""
    bad = [
        f"{path_str(p)} ({jnp.result_type(x)})"
        for p, x in jax.tree_util.tree_leaves_with_path(params, is_leaf=quantized.is_quantized)
        if not quantized.is_quantized(x) and not jnp.issubdtype(jnp.result_type(x), jnp.floating)
    ]
    if bad:
        raise ValueError(
            f"params must be floating point; non-float leaves: {', '.join(bad[:5])}"
            + (" ..." if len(bad) > 5 else "")
        )
    if not jax.tree.leaves(params):
        raise ValueError("params has no array leaves")


def abstract_master(params):
    """fp32 ShapeDtypeStructs with the shapes of ``params`` (arrays or abstract values)."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(jnp.shape(x), jnp.float32), params)


class StateLayouts(NamedTuple):
    """``LeafLayout`` trees of the master weights and of the optimizer state."""

    master: Any
    opt_state: Any


def state_layouts(master, tx: optax.GradientTransformation, plan: ZeroPlan) -> StateLayouts:
    """Layouts of the ``master`` weights (the trained leaves' ``LeafLayout``s, holes at the
    frozen ones) and of every optimizer-state leaf: a leaf that mirrors a parameter is laid
    out like that parameter; any other leaf (Adafactor's factored moments, counters) gets its
    own layout from its shape, without tensor rules: split along a dimension of at least N
    entries, or whole when it has none."""
    opt_abstract = jax.eval_shape(tx.init, abstract_of(master))
    return StateLayouts(master, _opt_state_layouts(opt_abstract, master, plan))


def _opt_state_layouts(opt_abstract, master, plan: ZeroPlan):
    """A leaf that mirrors a parameter (``zeroflow.engine.opt_mirror``) is laid out like it."""

    def own(x):
        return plan.leaf_layout("", x.shape, tensor_rules=False)

    return opt_mirror.map_mirrored(lambda x, lay: lay, own, opt_abstract, master, is_leaf=is_layout)


def state_padding(
    layouts: StateLayouts, plan: ZeroPlan, prec: Precision, frozen_layouts=None
) -> StatePadding:
    copy = plan.keeps_compute_copy(prec.compute_dtype)
    compute = padding.entries_of(layouts.master, plan.shards_compute) if copy else ()
    if plan.hierarchical:  # the within-host copy (zeroflow.engine.zeropp.hierarchical)
        compute = hierarchical.copy_entries(layouts.master)
    frozen = (
        () if frozen_layouts is None else padding.entries_of(frozen_layouts, plan.shards_compute)
    )
    if plan.hierarchical and frozen_layouts is not None:  # one copy per host, as compute's
        frozen = hierarchical.copy_entries(frozen_layouts)
    return StatePadding(
        master=padding.entries_of(layouts.master, plan.shards_storage),
        compute=compute,
        opt_state=padding.entries_of(layouts.opt_state, plan.shards_storage),
        data_size=plan.data_size,
        frozen=frozen,
        compute_copies=plan.weight_copies,
        cast_on_use=None if copy or prec.params == "fp32" else jnp.dtype(prec.compute_dtype).name,
    )


def _check_hierarchical(plan: ZeroPlan, prec: Precision) -> None:
    if not plan.hierarchical:
        return
    problem = hierarchical_copy_problem(True, prec.params)
    if problem:
        raise ValueError(problem)


def state_shardings(
    abstract_params,
    tx: optax.GradientTransformation,
    plan: ZeroPlan,
    prec: Precision,
    model_state=None,
    rng=None,
    trainable=None,
) -> TrainState:
    """The sharding of every leaf of the state: derived from the parameters, never hand-listed.
    ``abstract_params`` has the parameters' own shapes (all of them, frozen ones included);
    padded leaves get the sharding of their stored (padded) form. ``model_state`` / ``rng``:
    the state carries them (replicated). ``trainable``: as for ``init_train_state``; frozen
    leaves are laid out like the compute weights (split at stage 3, in host memory when the
    weights are offloaded)."""
    mask = frozen_weights.trainable_mask(trainable, abstract_params)
    layouts = plan.layouts(abstract_params, trainable=mask)
    return state_shardings_of(layouts, tx, plan, prec, model_state, rng)


def state_shardings_of(
    param_layouts,
    tx: optax.GradientTransformation,
    plan: ZeroPlan,
    prec: Precision,
    model_state=None,
    rng=None,
    fp8=None,
) -> TrainState:
    """``state_shardings`` of the parameters' ``plan.layouts``, frozen leaves included: each
    leaf goes to the master weights and optimizer state or to the frozen weights as its layout
    says (``LeafLayout.trains``). ``fp8``: the FP8 state the state carries (replicated)."""
    trained, frozen_layouts = frozen_weights.split(param_layouts, param_layouts)
    if not jax.tree.leaves(frozen_layouts, is_leaf=is_layout):  # every leaf trains
        frozen_layouts = None
    _check_hierarchical(plan, prec)
    layouts = state_layouts(trained, tx, plan)
    host = plan.storage_memory_kind
    master = plan.shardings_of(layouts.master, plan.shards_storage, host)
    opt = plan.shardings_of(layouts.opt_state, plan.shards_storage, host)
    compute = (
        plan.shardings_of(layouts.master, plan.shards_compute, plan.compute_memory_kind)
        if (plan.keeps_compute_copy(prec.compute_dtype))
        else None
    )
    frozen = (
        None
        if frozen_layouts is None
        else plan.shardings_of(frozen_layouts, plan.shards_compute, plan.compute_memory_kind)
    )
    # The TrainState returned is a tree of shardings: a sharding stands in each field that the
    # state itself holds an array in (and is annotated so).
    scalar: Any = plan.replicated()
    loss_scale = (
        None
        if not prec.scaled
        else LossScaleState(scale=scalar, good_steps=scalar, skips=scalar, dynamic=prec.dynamic)
    )
    return TrainState(
        step=scalar,
        applied=scalar,
        master=master,
        compute=compute,
        opt_state=opt,
        loss_scale=loss_scale,
        model_state=None if model_state is None else jax.tree.map(lambda _: scalar, model_state),
        rng=None if rng is None else scalar,
        frozen=frozen,
        fp8=None if fp8 is None else jax.tree.map(lambda _: scalar, fp8),
        padding=state_padding(layouts, plan, prec, frozen_layouts),
    )


def as_key(rng) -> jax.Array:
    """A typed jax key from a typed key or a legacy ``uint32[2]`` ``PRNGKey``."""
    typed = isinstance(rng, (jax.Array, jax.ShapeDtypeStruct)) and jnp.issubdtype(
        rng.dtype, jax.dtypes.prng_key
    )
    if typed:
        if rng.shape != ():
            raise ValueError(
                f"rng must be a single jax key, got an array of keys of shape {rng.shape}"
            )
        return rng
    shape, dtype = jnp.shape(rng), jnp.result_type(rng) if hasattr(rng, "dtype") else None
    if dtype == jnp.uint32 and shape == (2,):
        return jax.random.wrap_key_data(rng)
    raise ValueError(
        f"rng must be a jax random key (jax.random.key(seed)), got "
        f"{type(rng).__name__} of shape {shape}"
    )


def check_model_state(model_state) -> None:
    leaves = jax.tree_util.tree_leaves_with_path(model_state)
    bad = [path_str(p) for p, x in leaves if not hasattr(x, "shape") or not hasattr(x, "dtype")]
    if bad:
        raise ValueError(f"model_state leaves must be arrays; not arrays: {', '.join(bad[:5])}")


def _abstract(tree):
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(jnp.shape(x), jnp.result_type(x)), tree)


def _in_compute_dtype(frozen, prec: Precision):
    """Frozen weights in the compute dtype; quantized ones keep their codes and scales."""
    return jax.tree.map(
        lambda x: x if quantized.is_quantized(x) else jnp.asarray(x, prec.compute_dtype),
        frozen,
        is_leaf=quantized.is_quantized,
    )


def stored_frozen(frozen, pads: StatePadding):
    """The frozen weights (their own shapes) as the state stores them: padded where split,
    and with hpZ one copy per host (``zeroflow.engine.zeropp.hierarchical``: never updated,
    so the within-host copy is their only one)."""
    padded = padding.pad(frozen, pads.frozen, pads.data_size)
    return hierarchical.tile(padded, pads.frozen, pads.compute_copies)


def init_train_state(
    params,
    tx: optax.GradientTransformation,
    plan: ZeroPlan,
    prec: Precision,
    model_state=None,
    rng=None,
    trainable=None,
) -> TrainState:
    """Build the sharded training state.

    ``params`` is an fp32 pytree, or a zero-argument function returning one: then nothing is
    ever materialised unsharded, which is how a model larger than one device is initialised.
    ``model_state``: a pytree of mutable model variables (Flax ``batch_stats``), kept
    replicated and never touched by the optimizer; ``rng``: a jax key from which every step,
    device and micro-batch derives its own (dropout). The loss gets them as keywords.
    ``trainable``: which leaves train (``zeroflow.engine.frozen``): a pytree of bools matching
    ``params``, or a callable ``(path_str, leaf) -> bool``; None trains every leaf. A frozen
    leaf is stored once, in the compute dtype, with no master copy and no optimizer state: the
    optimizer ``tx`` sees the trainable leaves only. A frozen leaf may be a ``QuantizedArray``
    (``zf.quantize_frozen``): stored as its codes and scales, dequantized on use by the step.
    """
    init_fn: Callable[[], Any] | None = params if frozen_weights.is_function(params) else None
    abstract = jax.eval_shape(init_fn) if init_fn else _abstract(params)
    check_float_params(abstract)
    if model_state is not None:
        check_model_state(model_state)
    key = None if rng is None else as_key(rng)
    plan.warn_if_replicated(abstract)
    mask = frozen_weights.trainable_mask(trainable, abstract)
    quantized.check_trainable(abstract, mask)
    layouts = plan.layouts(abstract, trainable=mask)
    shardings = state_shardings_of(layouts, tx, plan, prec, model_state, key)
    pads = shardings.padding

    def build(p, model_state, key):
        p, frozen = frozen_weights.split(init_fn() if init_fn else p, layouts)
        master = jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), p)
        if frozen_weights.any_frozen(layouts):
            frozen = stored_frozen(_in_compute_dtype(frozen, prec), pads)
        else:
            frozen = None
        compute = (
            jax.tree.map(lambda x: x.astype(prec.compute_dtype), master)
            if (plan.keeps_compute_copy(prec.compute_dtype))
            else None
        )
        opt_state = tx.init(master)
        n = plan.data_size
        return TrainState(
            step=jnp.zeros((), jnp.int32),
            applied=jnp.zeros((), jnp.int32),
            master=padding.pad(master, pads.master, n),
            compute=None
            if compute is None
            else hierarchical.tile(
                padding.pad(compute, pads.compute, n), pads.compute, pads.compute_copies
            ),
            opt_state=padding.pad(opt_state, pads.opt_state, n),
            loss_scale=prec.init_loss_scale(),
            model_state=model_state,
            rng=key,
            frozen=frozen,
            padding=pads,
        )

    return jax.jit(build, out_shardings=shardings)(None if init_fn else params, model_state, key)
