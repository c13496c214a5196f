"""Where a weight fetched on use comes from and where its gradient goes: one ``Source`` per
kind of stored weight, used by every path that fetches weights alike (``gather_on_use``'s units
and scan bodies, and the per-layer ``gather_layer``): ``Sharded`` is a stage-3 weight, gathered
and reduce-scattered by its ``Stage3Collectives`` (plain, or ZeRO++'s variants); ``Whole`` a
stage-0-2 weight (its gradient reduce-scattered on use at stage 2); ``Frozen`` one never
differentiated.

A source fetches in two ways: ``fetch``, inside a unit, which takes the gradient itself and
hands it to ``give_back``; and ``fetch_for_grad``, differentiable on its own (a layer of a
rematerialised scan), whose gradient reaches the stand-in as ``give_back`` would hand it.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Protocol

import jax
import jax.numpy as jnp

from zeroflow.engine.grads.collectives import (
    all_gather,
    gathered_tangent,
    reduce_scatter,
    scatter_grad_on_use,
)
from zeroflow.engine.hosts import HostSplit
from zeroflow.engine.plan import ZeroPlan
from zeroflow.engine.zeropp.fp8_gather import fp8_all_gather
from zeroflow.engine.zeropp.gather import quantized_all_gather
from zeroflow.engine.zeropp.reduce import quantized_reduce_scatter


def dim_in_layer(dim: int) -> int | None:
    """Where a layer stack's ZeRO dimension ``dim`` falls in one layer's slice (the stack's
    leading, layer axis dropped): ``dim - 1``; None when ``dim`` is the layer axis itself,
    where each device holds whole layers and no slice is split alike on every device."""
    return None if dim == 0 else dim - 1


class Source(Protocol):
    """How one weight is stored on this device and how its gradient goes back there."""

    @property
    def ordered(self) -> bool:
        """Its fetch waits for the unit's inputs (``ordering.after``), or the compiler places it."""

    @property
    def frozen(self) -> bool:
        """Never differentiated: the unit takes no vjp with respect to it."""

    def fetch(self, stored) -> jax.Array:
        """The whole weight, as the loss uses it, from what this device stores."""

    def give_back(self, stored, grad):
        """The cotangent of ``stored`` for ``grad``, the gradient of the fetched weight."""

    def fetch_for_grad(self, stored) -> jax.Array:
        """``fetch(stored)``, differentiable: the gradient reaches what ``give_back`` fills."""

    def layer(self) -> Source | None:
        """The source of one slice along the leading axis (a scan's iteration), or None when
        that axis is the one split over devices."""


@dataclasses.dataclass(frozen=True)
class Stage3Collectives:
    """How stage-3 weights are gathered and their gradients reduce-scattered: ZeRO++'s three
    options, each one field (all unset: plain stage 3, full-precision over every device).

    - hpZ, ``groups``: each weight is gathered within a group of devices that holds a whole
      copy between them (each host's; the copy is ``zeroflow.engine.zeropp.hierarchical``'s);
    - qwZ, ``weight_block``: gathered as int8 blocks of that many entries
      (``zeroflow.engine.zeropp.gather``), or with ``weight_format="fp8"`` as e4m3 with one
      scale per weight (``zeroflow.engine.zeropp.fp8_gather``; matrices only, see ``gather``);
    - qgZ, ``grad_hosts``: gradients reduce-scattered as int8 blocks of ``grad_block``
      entries, within and then across these hosts (``zeroflow.engine.zeropp.reduce``).
    The gradient always reaches the 1/N shard of the master over all devices."""

    groups: tuple | None = None
    weight_block: int | None = None
    grad_hosts: HostSplit | None = None
    grad_block: int = 256
    reduce_dtype: Any = jnp.float32
    "What gradients are summed over devices in (``Precision.reduce``), exact reductions only."
    weight_format: str = "int8"
    "What quantized weight gathers move: 'int8' blocks (qwZ) or 'fp8' (e4m3, one scale)."

    @classmethod
    def of(cls, plan: ZeroPlan, reduce_dtype) -> Stage3Collectives:
        """What ``plan`` sets (hpZ, qwZ, qgZ), summing exact reductions in ``reduce_dtype``."""
        return cls(
            plan.gather_groups,
            plan.quantize_block if plan.quantize_weights else None,
            plan.host_split if plan.quantize_grads else None,
            plan.quantize_block,
            reduce_dtype,
            plan.quantize_weights or "int8",
        )

    @property
    def is_plain(self) -> bool:
        """Plain stage 3: gathered whole over every device in full precision, reduced exactly."""
        return self.groups is None and self.weight_block is None and self.grad_hosts is None

    @property
    def reduces_by_transpose(self) -> bool:
        """The gradient reduction is the transpose of the gather (an exact reduce-scatter),
        which qgZ's quantizing one is not."""
        return self.grad_hosts is None

    def gather(self, shard, dim: int, dtype, size: int | None = None, *, sliced: bool = False):
        """The whole weight in ``dtype`` from this device's ``shard`` (see ``all_gather``).
        FP8 gathers take matrices only: a vector (a norm's gain, a bias; a layer's slice of a
        stack of them) is no FP8 matmul's operand, moves few bytes, and in e4m3 would be off
        by up to 1/16 of itself in the forward pass (a frozen, pretrained gain for good)."""
        if self.weight_block is not None and self.weight_format == "fp8":
            if shard.ndim >= 2:
                return fp8_all_gather(shard, dim, dtype, size, self.groups, sliced=sliced)
            return all_gather(shard, dim, dtype, size, self.groups, sliced=sliced)
        if self.weight_block is not None:
            return quantized_all_gather(shard, dim, dtype, self.weight_block, size, self.groups)
        return all_gather(shard, dim, dtype, size, self.groups, sliced=sliced)

    def reduce_scatter(self, grad, dim: int, padded: int | None = None):
        """This device's fp32 slice of the sum over all devices of ``grad``."""
        if self.grad_hosts is not None:
            return quantized_reduce_scatter(grad, dim, self.grad_hosts, self.grad_block, padded)
        return reduce_scatter(grad, dim, padded, self.reduce_dtype)


@dataclasses.dataclass(frozen=True)
class Sharded:
    """ZeRO-3: stored as a pair ``(shard, stand_in)``, the shard split along ``dim`` and
    gathered as ``dtype``; the gradient is reduce-scattered in fp32 into the stand-in, both
    by ``collectives``. ``size``/``padded``: the weight's own and stored length along ``dim``
    (they differ when it is stored padded)."""

    dim: int
    dtype: Any
    size: int | None = None
    padded: int | None = None
    sliced: bool = False
    "One iteration's slice of a stack a scan walks through (``layer()``; see ``all_gather``)."
    # The plan's (``Stage3Collectives.of``), always given: a source built without it is a
    # TypeError, never plain collectives where the plan asked for ZeRO++'s.
    collectives: Stage3Collectives = dataclasses.field(kw_only=True)
    ordered = True
    frozen = False

    def gathered(self, shard):
        return self.collectives.gather(shard, self.dim, self.dtype, self.size, sliced=self.sliced)

    def fetch(self, stored):
        return self.gathered(stored[0])

    def reduced(self, grad):
        """This device's fp32 slice of the sum over devices of ``grad``."""
        return self.collectives.reduce_scatter(grad, self.dim, self.padded)

    def give_back(self, stored, grad):
        return _pair_like(stored, self.reduced(grad))

    def fetch_for_grad(self, stored):
        gather = gather_weight if self.collectives.reduces_by_transpose else gather_weight_vjp
        return gather(stored[0], stored[1], self)

    def layer(self):
        dim = dim_in_layer(self.dim)
        return None if dim is None else dataclasses.replace(self, dim=dim, sliced=True)


@functools.partial(jax.custom_jvp, nondiff_argnums=(2,))
def gather_weight(shard, stand_in, source: Sharded):
    """``source.gathered(shard)``, whose gradient goes to ``stand_in`` (fp32 zeros shaped like
    the 1/N shard of the master, never read): the tangent map is linear in the stand-in, so
    the gradient is its transpose, the reduce-scatter of the devices' gradients summed in
    ``reduce_dtype`` and returned in fp32, while the shard itself stays in its stored dtype
    (no fp32 copy of the weights is made to differentiate). Its primal is plain jax, so
    ``jax.checkpoint`` sees the gather and recomputes it (``save_all_but_fetched``)."""
    del stand_in
    return source.gathered(shard)


@gather_weight.defjvp
def _gather_weight_jvp(source: Sharded, primals, tangents):
    (shard, _), (_, d_stand_in) = primals, tangents
    return source.gathered(shard), gathered_tangent(
        d_stand_in,
        source.dim,
        source.dtype,
        source.size,
        source.sliced,
        source.collectives.reduce_dtype,
    )


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def gather_weight_vjp(shard, stand_in, source: Sharded):
    """``gather_weight`` for a reduction that is not the transpose of the gather (qgZ's
    quantizing one): a ``custom_vjp`` whose backward pass is ``source.reduced``. It keeps no
    residual, so a rematerialised layer saves no gathered weight either."""
    del stand_in
    return source.gathered(shard)


def _gather_weight_fwd(shard, stand_in, source):
    return source.gathered(shard), None


def _gather_weight_bwd(source, _, grad):
    return None, source.reduced(grad)


gather_weight_vjp.defvjp(_gather_weight_fwd, _gather_weight_bwd)


@dataclasses.dataclass(frozen=True)
class Whole:
    """A whole weight used as it is; with ``scatter_dim`` (ZeRO-2) it is stored as a pair
    ``(weight, stand_in)`` and the gradient is reduce-scattered into the stand-in (padded to
    ``padded`` entries along ``scatter_dim`` first, when the stored form is padded).
    ``ordered``: its use waits for the unit's inputs like a gather (where the compiler widens
    each use to a converted copy, XLA:CPU); else nothing is fetched and nothing waits."""

    scatter_dim: int | None = None
    padded: int | None = None
    ordered: bool = True
    reduce_dtype: Any = jnp.float32
    "What the gradient is summed over devices in (``Precision.reduce``)."
    frozen = False

    def fetch(self, stored):
        return stored if self.scatter_dim is None else stored[0]

    def give_back(self, stored, grad):
        if self.scatter_dim is None:
            return grad
        return _pair_like(
            stored, reduce_scatter(grad, self.scatter_dim, self.padded, self.reduce_dtype)
        )

    def fetch_for_grad(self, stored):
        if self.scatter_dim is None:
            return stored
        return scatter_grad_on_use(stored[0], stored[1], self.scatter_dim, self.reduce_dtype)

    def layer(self):
        if self.scatter_dim is None:
            return self
        dim = dim_in_layer(self.scatter_dim)
        return None if dim is None else dataclasses.replace(self, scatter_dim=dim)


@dataclasses.dataclass(frozen=True)
class Frozen:
    """A frozen weight (``zeroflow.engine.frozen``), stored as it is: a shard split along ``dim``
    and all-gathered as ``dtype`` (cut to ``size``), or whole (``dim`` None). It is fetched for
    the forward and the backward pass like any weight, but the unit takes no vjp with respect
    to it: its gradient is never computed. ``ordered`` as for ``Whole``, ``sliced`` as for
    ``Sharded``. ``collectives``: how a stage-3 shard is gathered, as trained weights are
    (hpZ within each host, qwZ in int8 blocks); a weight that is already packed bytes (a
    ``QuantizedArray``'s) is gathered as it is, never quantized again."""

    dim: int | None
    dtype: Any
    size: int | None = None
    ordered: bool = True
    sliced: bool = False
    collectives: Stage3Collectives = dataclasses.field(kw_only=True)
    frozen = True

    def fetch(self, stored):
        if self.dim is None:
            return stored
        return self.collectives.gather(stored, self.dim, self.dtype, self.size, sliced=self.sliced)

    def as_bytes(self) -> Frozen:
        """This source for packed bytes: gathered as they are (qwZ would quantize them again),
        within the same groups."""
        return dataclasses.replace(
            self, collectives=dataclasses.replace(self.collectives, weight_block=None)
        )

    def give_back(self, stored, grad):  # never called: nothing differentiates a frozen weight
        return None

    def fetch_for_grad(self, stored):  # a constant of the differentiated function
        return self.fetch(stored)

    def layer(self):
        if self.dim is None:
            return self
        dim = dim_in_layer(self.dim)
        return None if dim is None else dataclasses.replace(self, dim=dim, sliced=True)


def _pair_like(stored, grad):
    """The cotangent of a ``(weight, stand_in)`` pair: nothing for the weight (its zeros are
    never materialised: the caller differentiates the stand-in only), ``grad`` for the stand-in."""
    weight, _ = stored
    return jax.tree.unflatten(jax.tree.structure(stored), [jnp.zeros_like(weight), grad])
