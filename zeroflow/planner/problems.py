"""Any JAX model as the planner's problem: ``loss_fn``, abstract ``params`` and a global
``batch``, an optax ``tx`` and a ``zf.Precision``, compiled with ``zf.make_train_step`` for each
plan (``zf.memory.compile_step``). What remat and attention a model uses is its own business;
the planner searches the engine's choices only."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from zeroflow.engine.frozen import trainable_mask
from zeroflow.engine.plan import ZeroPlan
from zeroflow.memory.estimate import DTYPE_BYTES
from zeroflow.memory.measure import compile_step, itemsize
from zeroflow.planner.choices import Choice
from zeroflow.planner.whatif import ModelFacts
from zeroflow.planner.where import Where


class ModelProblem:
    """``zf.plan``'s problem (see ``zeroflow.planner.library.plan``)."""

    def __init__(
        self,
        loss_fn,
        params,
        batch,
        tx,
        prec,
        *,
        trainable=None,
        gather_per_layer: str | None = None,
        tokens_per_example: int | None = None,
    ):
        self.loss_fn, self.params, self.batch, self.tx, self.prec = loss_fn, params, batch, tx, prec
        self.trainable, self.gather_per_layer = trainable, gather_per_layer
        leaves = jax.tree.leaves(batch)
        if not leaves or not np.shape(leaves[0]):
            raise ValueError("zf.plan: batch must hold arrays with a leading batch dimension")
        batch_size = int(np.shape(leaves[0])[0])
        total = sum(math.prod(np.shape(x)) for x in jax.tree.leaves(params))
        frozen, frozen_bytes = _frozen(params, trainable, DTYPE_BYTES[prec.params])
        self.facts = ModelFacts(
            params=total,
            tokens_per_step=batch_size * (tokens_per_example or 1),
            batch_size=batch_size,
            compute_dtype=prec.params,
            frozen_params=frozen,
            frozen_bytes_per_param=frozen_bytes / frozen if frozen else None,
            optimizer_bytes=_optimizer_bytes(tx, params, total),
        )
        self.tokens_per_example = tokens_per_example

    @property
    def title(self) -> str:
        return f"{self.facts.params:,} params, batch {self.facts.batch_size}"

    def compile(self, choice: Choice, where: Where, options: dict):
        plan = ZeroPlan(where.mesh(), **choice.plan_settings())
        return compile_step(
            self.loss_fn,
            self.params,
            self.batch,
            self.tx,
            plan,
            self.prec,
            grad_accum=choice.grad_accum,
            gather_per_layer=self.gather_per_layer,
            trainable=self.trainable,
            compiler_options=options,
        )

    def model_flops(self) -> float | None:
        """6 x parameters x tokens per step, when tokens per example are known."""
        if self.tokens_per_example is None:
            return None
        return 6.0 * self.facts.params * self.facts.tokens_per_step

    def overrides(self, choice: Choice, devices: int) -> None:
        return None


def _frozen(params, trainable, width: int) -> tuple[int, int]:
    """``(elements, stored bytes)`` of the frozen leaves: a floating-point one is stored in the
    compute dtype (``width`` bytes), any other (a ``zf.quantize_frozen`` leaf's packed bytes)
    in its own."""
    if trainable is None:
        return 0, 0
    flags = jax.tree.leaves(trainable_mask(trainable, params))
    frozen = [x for x, keep in zip(jax.tree.leaves(params), flags, strict=True) if not keep]
    elements = sum(math.prod(np.shape(x)) for x in frozen)
    stored = sum(
        math.prod(np.shape(x))
        * (width if jnp.issubdtype(x.dtype, jnp.floating) else itemsize(x.dtype))
        for x in frozen
    )
    return elements, stored


def _optimizer_bytes(tx, params, total: int) -> float:
    """The optimizer state's bytes per parameter, from its abstract ``init``."""
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), np.float32), params)
    state = jax.eval_shape(tx.init, abstract)
    nbytes = sum(math.prod(x.shape) * itemsize(x.dtype) for x in jax.tree.leaves(state))
    return nbytes / max(total, 1)
