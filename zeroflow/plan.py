"""ZeroPlan: the one place that decides where every array of the training state lives.

Two mappings per parameter (STYLE item 4):
- *storage*: how fp32 master weights and optimizer state are kept (sharded over ``data`` from
  ZeRO stage 1 on, optionally in host memory);
- *compute*: how the weights the forward pass reads are laid out (replicated over ``data``
  below stage 3, sharded and gathered on use at stage 3).
Tensor-parallel rules place dimensions on the ``model`` axis in both.

The ZeRO dimension of a leaf is the largest dimension that divides by the ``data`` axis size
and is not already split over ``model``. A leaf with no such dimension (say a bias of size 10
on 8 devices) stays replicated over ``data``; such leaves are small in practice, so memory per
device stays close to 1/N. ``ZeroPlan.replicated_fraction`` reports how much that is.
"""
from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import AbstractMesh, Mesh, NamedSharding, PartitionSpec as P

from zeroflow.mesh import DATA, MODEL

OFFLOAD_CHOICES = ("none", "optimizer", "optimizer+params")
UPDATE_ON_CHOICES = ("device", "host")


def path_str(path) -> str:
    """'/'-joined key path of a pytree leaf, e.g. ``Dense_0/kernel``."""
    parts = []
    for k in path:
        for attr in ("key", "name", "idx"):
            if hasattr(k, attr):
                parts.append(str(getattr(k, attr)))
                break
        else:
            parts.append(str(k))
    return "/".join(parts)


@dataclasses.dataclass(frozen=True)
class LeafLayout:
    """Where one parameter lives: its tensor-parallel spec and its ZeRO dimension."""
    shape: tuple[int, ...]
    tensor_spec: tuple  # per-dimension mesh axis (MODEL or None), without ZeRO
    zero_dim: int | None  # dimension split over DATA at stages >= 1, None = replicated

    def spec(self, with_zero: bool) -> P:
        entries = list(self.tensor_spec)
        if with_zero and self.zero_dim is not None:
            entries[self.zero_dim] = DATA
        return P(*entries)

    def data_only_spec(self, with_zero: bool) -> P:
        """The spec restricted to the ``data`` axis, as shard_map over ``data`` wants it."""
        if not with_zero or self.zero_dim is None:
            return P()
        entries = [None] * len(self.shape)
        entries[self.zero_dim] = DATA
        return P(*entries)


@dataclasses.dataclass(frozen=True)
class ZeroPlan:
    """How a training state is sharded over a ``("data", "model")`` mesh.

    ``mesh`` is a ``jax.sharding.Mesh`` (``zf.make_mesh``), or an ``AbstractMesh``
    (``zf.planning_mesh``) to plan and estimate memory for devices this machine has not.
    stage 0: all replicated; 1: master weights + optimizer state sharded over ``data``;
    2: also gradients reduce-scattered; 3: also compute weights sharded, gathered on use.
    ``offload``: "none", "optimizer" (master + optimizer state in pinned host memory) or
    "optimizer+params" (compute weights there too). ``update_on``: where an offloaded update runs.
    ``tensor_rules``: ``[(path_regex, PartitionSpec), ...]`` placing dimensions on ``model``;
    the first rule whose regex matches (``re.search``) the leaf's '/'-joined path wins.
    """
    mesh: Mesh
    stage: int = 0
    offload: str = "none"
    update_on: str = "device"
    tensor_rules: Sequence[tuple[str, P]] = ()

    def __post_init__(self):
        if (not isinstance(self.mesh, (Mesh, AbstractMesh))
                or set(self.mesh.axis_names) != {DATA, MODEL}):
            raise ValueError("ZeroPlan needs a mesh with axes ('data', 'model'); use zf.make_mesh "
                             "(or zf.planning_mesh to plan for devices this machine has not)")
        if isinstance(self.stage, bool) or self.stage not in (0, 1, 2, 3):
            raise ValueError(f"ZeRO stage must be 0, 1, 2 or 3, got {self.stage!r}")
        if self.offload not in OFFLOAD_CHOICES:
            raise ValueError(f"unknown offload {self.offload!r}; choose one of {list(OFFLOAD_CHOICES)}")
        if self.update_on not in UPDATE_ON_CHOICES:
            raise ValueError(f"unknown update_on {self.update_on!r}; choose one of {list(UPDATE_ON_CHOICES)}")
        if self.update_on == "host" and self.offload == "none":
            raise ValueError("update_on='host' needs offload='optimizer' or 'optimizer+params'")
        rules = []
        for rule in self.tensor_rules:
            try:
                pattern, spec = rule
                re.compile(pattern)
            except (TypeError, ValueError, re.error) as e:
                raise ValueError(f"tensor_rules entries must be (path_regex, PartitionSpec): {rule!r} ({e})") from None
            spec = spec if isinstance(spec, P) else P(*spec)
            for axis in spec:
                if axis not in (None, MODEL):
                    raise ValueError(f"tensor rule {pattern!r} may only use the 'model' axis, got {spec}")
            rules.append((pattern, spec))
        object.__setattr__(self, "tensor_rules", tuple(rules))

    # -- sizes -------------------------------------------------------------------------------
    @property
    def data_size(self) -> int:
        return self.mesh.shape[DATA]

    @property
    def model_size(self) -> int:
        return self.mesh.shape[MODEL]

    @property
    def shards_storage(self) -> bool:
        return self.stage >= 1

    @property
    def shards_grads(self) -> bool:
        return self.stage >= 2

    @property
    def shards_compute(self) -> bool:
        return self.stage >= 3

    # -- offload -----------------------------------------------------------------------------
    @property
    def offloads(self) -> bool:
        """Master weights and optimizer state live in pinned host memory."""
        return self.offload != "none"

    @property
    def offloads_params(self) -> bool:
        """The compute-dtype weights live in pinned host memory too."""
        return self.offload == "optimizer+params"

    @property
    def updates_on_host(self) -> bool:
        """The optimizer update runs on the host CPU (ZeRO-Offload)."""
        return self.offloads and self.update_on == "host"

    # -- per-leaf layout ---------------------------------------------------------------------
    def _tensor_spec(self, path: str, shape) -> tuple:
        for pattern, spec in self.tensor_rules:
            if re.search(pattern, path):
                entries = tuple(spec) + (None,) * (len(shape) - len(spec))
                if len(entries) != len(shape):
                    raise ValueError(f"tensor rule {pattern!r} spec {spec} has more entries than "
                                     f"{path} has dimensions {tuple(shape)}")
                for dim, axis in zip(shape, entries):
                    if axis == MODEL and dim % self.model_size:
                        raise ValueError(f"{path}: dimension {dim} does not divide by model={self.model_size} "
                                         f"(tensor rule {pattern!r})")
                return entries
        return (None,) * len(shape)

    def leaf_layout(self, path: str, shape) -> LeafLayout:
        shape = tuple(int(d) for d in shape)
        tspec = self._tensor_spec(path, shape)
        n = self.data_size
        candidates = [d for d, size in enumerate(shape)
                      if tspec[d] is None and size % n == 0 and size >= n]
        zero_dim = max(candidates, key=lambda d: (shape[d], -d)) if candidates and n > 1 else None
        return LeafLayout(shape, tspec, zero_dim)

    def layouts(self, params) -> Any:
        """A pytree of ``LeafLayout`` matching ``params`` (arrays or ShapeDtypeStructs)."""
        return jax.tree_util.tree_map_with_path(
            lambda path, x: self.leaf_layout(path_str(path), np.shape(x)), params)

    # -- shardings ---------------------------------------------------------------------------
    def _named(self, spec: P, memory_kind: str | None = None) -> NamedSharding:
        return NamedSharding(self.mesh, spec, memory_kind=memory_kind)

    @property
    def storage_memory_kind(self) -> str | None:
        return "pinned_host" if self.offloads else None

    @property
    def compute_memory_kind(self) -> str | None:
        return "pinned_host" if self.offloads_params else None

    def storage_shardings(self, params, memory_kind: str | None | bool = True):
        """Shardings of fp32 master weights (and so of the optimizer state)."""
        kind = self.storage_memory_kind if memory_kind is True else memory_kind
        return jax.tree.map(lambda lay: self._named(lay.spec(self.shards_storage), kind),
                            self.layouts(params), is_leaf=lambda x: isinstance(x, LeafLayout))

    def compute_shardings(self, params, memory_kind: str | None | bool = True):
        """Shardings of the compute-dtype weights as they are stored between steps."""
        kind = self.compute_memory_kind if memory_kind is True else memory_kind
        return jax.tree.map(lambda lay: self._named(lay.spec(self.shards_compute), kind),
                            self.layouts(params), is_leaf=lambda x: isinstance(x, LeafLayout))

    def replicated(self, memory_kind: str | None = None) -> NamedSharding:
        return self._named(P(), memory_kind)

    def batch_sharding(self) -> NamedSharding:
        return self._named(P(DATA))

    def replicated_fraction(self, params) -> float:
        """Fraction of parameter elements that no dimension lets ZeRO split (kept whole)."""
        total = kept = 0
        for lay in jax.tree.leaves(self.layouts(params), is_leaf=lambda x: isinstance(x, LeafLayout)):
            size = int(np.prod(lay.shape))
            total += size
            kept += size if lay.zero_dim is None else 0
        return kept / max(total, 1)
