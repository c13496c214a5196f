"""The training state and how it is built directly into its sharded layout."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import struct

from zeroflow.plan import ZeroPlan, path_str
from zeroflow.precision import LossScaleState, Precision


@struct.dataclass
class TrainState:
    """``master``: fp32 weights (the optimizer's); ``compute``: the compute-dtype copy, or None
    when the compute dtype is fp32 (then ``params`` is ``master``: one copy only)."""
    step: jax.Array
    master: Any
    compute: Any
    opt_state: Any
    loss_scale: LossScaleState | None

    @property
    def params(self):
        """The weights the forward pass uses, in the compute dtype."""
        return self.master if self.compute is None else self.compute


def check_float_params(params) -> None:
    bad = [f"{path_str(p)} ({jnp.result_type(x)})"
           for p, x in jax.tree_util.tree_leaves_with_path(params)
           if not jnp.issubdtype(jnp.result_type(x), jnp.floating)]
    if bad:
        raise ValueError(f"params must be floating point; non-float leaves: {', '.join(bad[:5])}"
                         + (" ..." if len(bad) > 5 else ""))
    if not jax.tree.leaves(params):
        raise ValueError("params has no array leaves")


def abstract_master(params):
    """fp32 ShapeDtypeStructs with the shapes of ``params`` (arrays or abstract values)."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(jnp.shape(x), jnp.float32), params)


def state_shardings(abstract_params, tx: optax.GradientTransformation, plan: ZeroPlan,
                    prec: Precision) -> TrainState:
    """The sharding of every leaf of the state: derived from the parameters, never hand-listed."""
    master = plan.storage_shardings(abstract_params)
    host = plan.storage_memory_kind
    opt_abstract = jax.eval_shape(tx.init, abstract_master(abstract_params))
    # tree_map_params runs tx.init on a dummy to learn the state's structure, creating a few
    # scalars on the default device; allow that even under a caller's transfer guard.
    with jax.transfer_guard("allow"):
        opt = optax.tree_map_params(tx, lambda _, s: s, opt_abstract, master,
                                    transform_non_params=lambda _: plan.replicated(host))
    compute = None if prec.params == "fp32" else plan.compute_shardings(abstract_params)
    scalar = plan.replicated()
    loss_scale = None if not prec.scaled else LossScaleState(scale=scalar, good_steps=scalar)
    return TrainState(step=scalar, master=master, compute=compute, opt_state=opt, loss_scale=loss_scale)


def init_train_state(params, tx: optax.GradientTransformation, plan: ZeroPlan,
                     prec: Precision) -> TrainState:
    """Build the sharded training state.

    ``params`` is an fp32 pytree, or a zero-argument function returning one: then nothing is
    ever materialised unsharded, which is how a model larger than one device is initialised.
    """
    init_fn: Callable[[], Any] | None = params if callable(params) else None
    abstract = jax.eval_shape(init_fn) if init_fn else jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(jnp.shape(x), jnp.result_type(x)), params)
    check_float_params(abstract)
    shardings = state_shardings(abstract, tx, plan, prec)

    def build(p):
        p = init_fn() if init_fn else p
        master = jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), p)
        compute = None if prec.params == "fp32" else jax.tree.map(
            lambda x: x.astype(prec.compute_dtype), master)
        return TrainState(step=jnp.zeros((), jnp.int32), master=master, compute=compute,
                          opt_state=tx.init(master), loss_scale=prec.init_loss_scale())

    return jax.jit(build, out_shardings=shardings)(None if init_fn else params)
