"""Where a weight fetched on use comes from and where its gradient goes: one ``Source`` per
kind of stored weight, used by every stage-3 path alike (``gather_on_use``'s units and scan
bodies, and the per-layer ``gather_layer``). A ZeRO++ variant is a source of its own:
``Sharded`` (plain stage 3, and qgZ's int8 gradient reduction through ``grad_hosts``),
``zeroflow.engine.zeropp.gather.QuantizedSharded`` (qwZ's int8 gathers); ``Whole`` is a stage-0-2
weight (its gradient reduce-scattered on use at stage 2), ``Frozen`` one never differentiated.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Protocol

import jax
import jax.numpy as jnp

from zeroflow.engine.grads.collectives import (all_gather, gather_weight, reduce_scatter,
                                        scatter_grad_on_use)
from zeroflow.engine.zeropp.hosts import HostSplit
from zeroflow.engine.zeropp.reduce import gather_weight_qgz, quantized_reduce_scatter


class Source(Protocol):
    """How one weight is stored on this device and how its gradient goes back there."""

    def fetch(self, stored) -> jax.Array:
        """The whole weight, as the loss uses it, from what this device stores."""

    def give_back(self, stored, grad):
        """The cotangent of ``stored`` for ``grad``, the gradient of the fetched weight."""


@dataclasses.dataclass(frozen=True)
class Sharded:
    """ZeRO-3: stored as a pair ``(shard, stand_in)``, the shard split along ``dim`` and
    all-gathered as ``dtype``; the gradient is reduce-scattered in fp32 into the stand-in.
    ``size``/``padded``: the weight's own and stored length along ``dim`` (they differ when it
    is stored padded). ``groups``: the groups of devices that each hold a whole copy and gather
    it among themselves (hpZ: each host's), None: all devices."""
    dim: int
    dtype: Any
    size: int | None = None
    padded: int | None = None
    groups: tuple | None = None
    grad_hosts: HostSplit | None = None
    "qgZ: the gradient is reduce-scattered as int8 blocks of ``grad_block``, host by host."
    grad_block: int = 256
    sliced: bool = False
    "One iteration's slice of a stack a scan walks through (``layer()``; see ``all_gather``)."
    reduce_dtype: Any = jnp.float32
    "What the gradient is summed over devices in (``Precision.reduce``)."

    def fetch(self, stored):
        return all_gather(stored[0], self.dim, self.dtype, self.size, self.groups,
                          sliced=self.sliced)

    def reduced(self, grad):
        """This device's fp32 slice of the sum over devices of ``grad``."""
        if self.grad_hosts is None:
            return reduce_scatter(grad, self.dim, self.padded, self.reduce_dtype)
        return quantized_reduce_scatter(grad, self.dim, self.grad_hosts, self.grad_block,
                                        self.padded)

    def give_back(self, stored, grad):
        return _pair_like(stored, self.reduced(grad))

    def fetch_for_grad(self, stored):
        """``fetch(stored)``, differentiable: the gradient of the fetched weight goes to the
        stand-in as ``give_back`` would hand it (inside a rematerialised scan body)."""
        if self.grad_hosts is not None:
            return gather_weight_qgz(stored[0], stored[1], self)
        return gather_weight(stored[0], stored[1], self.dim, self.dtype, self.size, self.groups,
                             self.sliced, self.reduce_dtype)

    def layer(self):
        """The source of one slice along the leading axis (a scan's iteration), or None when
        that axis is the one split over devices."""
        return None if self.dim == 0 else dataclasses.replace(self, dim=self.dim - 1,
                                                              sliced=True)


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
    "As for ``Sharded``."

    def fetch(self, stored):
        return stored if self.scatter_dim is None else stored[0]

    def give_back(self, stored, grad):
        if self.scatter_dim is None:
            return grad
        return _pair_like(stored, reduce_scatter(grad, self.scatter_dim, self.padded,
                                                 self.reduce_dtype))

    def fetch_for_grad(self, stored):
        if self.scatter_dim is None:
            return stored
        return scatter_grad_on_use(stored[0], stored[1], self.scatter_dim, self.reduce_dtype)

    def layer(self):
        if self.scatter_dim is None:
            return self
        return None if self.scatter_dim == 0 else dataclasses.replace(
            self, scatter_dim=self.scatter_dim - 1)


@dataclasses.dataclass(frozen=True)
class Frozen:
    """A frozen weight (``zeroflow.engine.frozen``), stored as it is: a shard split along ``dim`` and
    all-gathered as ``dtype`` (cut to ``size``), or whole (``dim`` None). It is fetched for
    the forward and the backward pass like any weight, but the unit takes no vjp with respect
    to it: its gradient is never computed. ``ordered`` as for ``Whole``."""
    dim: int | None
    dtype: Any
    size: int | None = None
    ordered: bool = True
    sliced: bool = False
    "As for ``Sharded``."
    frozen = True

    def fetch(self, stored):
        return stored if self.dim is None else all_gather(stored, self.dim, self.dtype, self.size,
                                                          sliced=self.sliced)

    def fetch_for_grad(self, stored):  # a constant of the differentiated function
        return self.fetch(stored)

    def layer(self):
        if self.dim is None:
            return self
        return None if self.dim == 0 else dataclasses.replace(self, dim=self.dim - 1, sliced=True)


def _pair_like(stored, grad):
    """The cotangent of a ``(weight, stand_in)`` pair: nothing for the weight (its zeros are
    never materialised: the caller differentiates the stand-in only), ``grad`` for the stand-in."""
    weight, _ = stored
    return jax.tree.unflatten(jax.tree.structure(stored), [jnp.zeros_like(weight), grad])
