"""ZeroPlan: the one place that decides where every array of the training state lives.

Two mappings per parameter, kept apart because ZeRO changes only the first:
- *storage*: how fp32 master weights and optimizer state are kept (sharded over ``data`` from
  ZeRO stage 1 on, optionally in host memory);
- *compute*: how the weights the forward pass reads are laid out (replicated over ``data``
  below stage 3, sharded and gathered on use at stage 3).
Tensor-parallel rules place dimensions on the ``model`` axis in both.

The ZeRO dimension of a leaf is the largest dimension that divides by the ``data`` axis size
and is not already split over ``model``; a matrix whose rows divide is split by rows (its
first dimension), and a stack of layers by each layer's rows (its second), so that each shard
is a contiguous block of the row-major array (of a layer's slice) and gathering weights or
reduce-scattering gradients needs no transpose (on XLA:GPU a transposed
gradient shard also made the update copy the optimizer state it overwrites). A leaf with no such dimension (a 50257 x 100
embedding, a bias of size 10 on 8 devices) is *padded*: its largest free dimension of at least
N entries is stored with zeros appended up to a multiple of N and split like any other
(``LeafLayout.pad``; ``zeroflow.engine.padding`` adds and removes the zeros, and nothing outside the
engine sees them). Only a leaf whose every free dimension is shorter than N stays replicated
over ``data``; ``ZeroPlan.describe`` reports the bytes per device and that share.
"""

from __future__ import annotations

import dataclasses
import math
import re
import warnings
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AbstractMesh, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from zeroflow import backend
from zeroflow.backend.mesh import CONTEXT, DATA, MODEL, zero_axes, zero_axis_names
from zeroflow.engine.hosts import host_split, hosts_of
from zeroflow.engine.plan_rules import hierarchical_hosts_problem, plan_problems
from zeroflow.util.settings import (  # the config reads them from there, before jax starts
    OFFLOAD_CHOICES,
    QUANTIZE_GRADS_CHOICES,
    QUANTIZE_WEIGHTS_CHOICES,
    UPDATE_ON_CHOICES,
    ZERO_STAGES,
)
from zeroflow.util.tree import path_str

WIDE = 8
"A matrix at least this many times wider than tall is split by columns (``leaf_layout``)."
LOOKUP_TABLE_NAMES = ("embedding",)
"""The last path entry of a table that is looked up, not multiplied: Flax's ``nn.Embed`` and
``nnx.Embed`` name theirs so. Such a table is never split by columns, even when a small
vocabulary makes it wide (a 256-token vocabulary at width 2048): it is looked up where its
rows are (``grads/row_lookup.py``). Split by columns, a lookup needs every column of the
gathered rows, so XLA:GPU gathers the whole table (docs/engine.md measures the cost)."""


def is_lookup_table(path: str) -> bool:
    """Whether the leaf at ``path`` (``util.tree.path_str``) is a lookup table by its name."""
    return path.rsplit("/", 1)[-1] in LOOKUP_TABLE_NAMES


@dataclasses.dataclass(frozen=True)
class LeafLayout:
    """Where one array lives: its tensor-parallel spec and its ZeRO dimension, and whether it
    trains. ``shape`` is the array's own (logical) shape; split over ``data`` it is stored
    padded (``stored_shape``)."""

    shape: tuple[int, ...]
    tensor_spec: tuple  # per-dimension mesh axis (MODEL or None), without ZeRO
    zero_dim: int | None  # dimension split over DATA at stages >= 1, None = replicated
    pad: int = 0  # zeros appended to zero_dim when it is split, so that it divides by N
    trains: bool = True
    """A parameter with an fp32 master copy, optimizer state and a gradient; False: frozen
    (``zeroflow.engine.frozen``), stored once as the compute weights are, never differentiated."""
    zero_axis: str | tuple[str, ...] = DATA  # what zero_dim is split over (plan.zero_axes)

    def spec(self, with_zero: bool) -> P:
        """The spec of the array as stored (padded, when split)."""
        entries = list(self.tensor_spec)
        if with_zero and self.zero_dim is not None:
            entries[self.zero_dim] = self.zero_axis
        return P(*entries)

    def logical_spec(self, with_zero: bool) -> P:
        """The closest spec an array of the unpadded ``shape`` can take: a padded leaf is whole
        over ``data``."""
        return self.spec(with_zero and not self.pad)

    def padding(self, with_zero: bool) -> tuple[int, int] | None:
        """``(dim, logical size)`` when the stored form is padded, else None."""
        if with_zero and self.zero_dim is not None and self.pad:
            return self.zero_dim, self.shape[self.zero_dim]
        return None

    def stored_shape(self, with_zero: bool) -> tuple[int, ...]:
        padded = self.padding(with_zero)
        if padded is None:
            return self.shape
        return tuple(s + self.pad if d == padded[0] else s for d, s in enumerate(self.shape))

    def data_only_spec(self, with_zero: bool) -> P:
        """The spec restricted to the ZeRO axes (``data``, with ``context`` where the mesh has
        it), as shard_map over them wants it."""
        if not with_zero or self.zero_dim is None:
            return P()
        entries: list[str | tuple[str, ...] | None] = [None] * len(self.shape)
        entries[self.zero_dim] = self.zero_axis
        return P(*entries)


def is_layout(x) -> bool:
    """``is_leaf`` of a tree of ``LeafLayout``: the one test for the end of such a tree."""
    return isinstance(x, LeafLayout)


def abstract_of(layouts):
    """fp32 ``ShapeDtypeStruct``s of the own (unpadded) shapes of a tree of ``LeafLayout``."""
    return jax.tree.map(
        lambda lay: jax.ShapeDtypeStruct(lay.shape, jnp.float32), layouts, is_leaf=is_layout
    )


@dataclasses.dataclass(frozen=True)
class ZeroPlan:
    """How a training state is sharded over a ``("data", "model")`` mesh, or a
    ``("data", "context", "model")`` one: states are then sharded over ``data`` x ``context``
    (the weights are the same on every context device) and gradients summed over both, while
    the batch's rows split over ``data`` and its sequence over ``context``.

    ``mesh`` is a ``jax.sharding.Mesh`` (``zf.make_mesh``), or an ``AbstractMesh``
    (``zf.planning_mesh``) to plan and estimate memory for devices this machine has not.
    stage 0: all replicated; 1: master weights + optimizer state sharded over ``data``;
    2: also gradients reduce-scattered; 3: also compute weights sharded, gathered on use.
    ``offload``: "none", "optimizer" (master + optimizer state in pinned host memory) or
    "optimizer+params" (compute weights there too). ``update_on``: where an offloaded update runs.
    ``tensor_rules``: ``[(path_regex, PartitionSpec), ...]`` placing dimensions on ``model``;
    the first rule whose regex matches (``re.search``) the leaf's '/'-joined path wins.
    ``traits``: what the backend of the mesh's devices does differently
    (``zeroflow.backend.Traits``); by default read from the mesh.
    ``quantize_weights``: None, or "int8" (ZeRO++'s qwZ, stage 3 only): weights are all-gathered
    as int8 blocks of ``quantize_block`` entries with one fp32 scale each and dequantized to the
    compute dtype (``zeroflow.engine.zeropp``); gradients and the master stay exact. "fp8":
    gathered as e4m3 with one scale per weight, the FP8 matmul's (``zeropp.fp8_gather``).
    ``hierarchical``: ZeRO++'s hpZ (stage 3, two or more hosts, no offload): the compute-dtype
    weights are kept as a secondary copy sharded over each host's devices only, so the forward
    and backward gathers stay inside the host (``zeroflow.engine.zeropp.hierarchical``); the master,
    optimizer state and gradient reduction stay sharded over all devices.
    ``quantize_grads``: None, or "int8" (ZeRO++'s qgZ, stage 3 only): the gradients of gathered
    weights are reduce-scattered as int8 blocks in two hops, within the host and then across
    hosts, summed in fp32 after each (``zeroflow.engine.zeropp.reduce``).
    ``hosts``: how many hosts the ``data`` axis spans, for meshes of emulated devices that all
    belong to one process (None: each device's ``process_index``; ``zeroflow.engine.hosts``).
    """

    mesh: Mesh | AbstractMesh
    stage: int = 0
    offload: str = "none"
    update_on: str = "device"
    tensor_rules: Sequence[tuple[str, P]] = ()
    # None (the default) stands for the mesh's own traits: __post_init__ puts them in its
    # place, so a constructed plan always holds a Traits, which is the type every reader gets.
    traits: backend.Traits = None  # type: ignore[assignment]
    quantize_weights: str | None = None
    quantize_block: int = 256
    hierarchical: bool = False
    quantize_grads: str | None = None
    hosts: int | None = None

    def __post_init__(self):
        if not isinstance(self.mesh, (Mesh, AbstractMesh)) or set(self.mesh.axis_names) not in (
            {DATA, MODEL},
            {DATA, CONTEXT, MODEL},
        ):
            raise ValueError(
                "ZeroPlan needs a mesh with axes ('data', 'model') or ('data', 'context', "
                "'model'); use zf.make_mesh (or zf.planning_mesh to plan for devices this "
                "machine has not)"
            )
        self._check_choices()
        problems = plan_problems(
            self.stage,
            self.offload,
            self.update_on,
            self.quantize_weights,
            self.quantize_block,
            self.hierarchical,
            self.quantize_grads,
            self.hosts,
        )
        if problems:
            raise ValueError(problems[0])
        if self.hosts is not None:
            hosts_of(self.mesh, self.hosts)  # the one check of a given host count
        if self.hierarchical:
            problem = hierarchical_hosts_problem(True, self.host_split.hosts)
            if problem:
                raise ValueError(problem)
        object.__setattr__(self, "tensor_rules", self._checked_rules())
        if self.traits is None:
            object.__setattr__(self, "traits", backend.of(self.mesh))
        elif not isinstance(self.traits, backend.Traits):
            raise ValueError(
                f"traits must be a zeroflow.backend.Traits, got {type(self.traits).__name__}"
            )

    def _check_choices(self) -> None:
        """Each setting on its own; the rules between them are ``plan_problems``."""
        if isinstance(self.stage, bool) or self.stage not in ZERO_STAGES:
            raise ValueError(f"ZeRO stage must be 0, 1, 2 or 3, got {self.stage!r}")
        for name, choices in (
            ("offload", OFFLOAD_CHOICES),
            ("update_on", UPDATE_ON_CHOICES),
            ("quantize_weights", QUANTIZE_WEIGHTS_CHOICES),
            ("quantize_grads", QUANTIZE_GRADS_CHOICES),
        ):
            if getattr(self, name) not in choices:
                raise ValueError(
                    f"unknown {name} {getattr(self, name)!r}; choose one of {list(choices)}"
                )
        if not isinstance(self.hierarchical, bool):
            raise ValueError(f"hierarchical must be a bool, got {self.hierarchical!r}")

    def _checked_rules(self) -> tuple[tuple[str, P], ...]:
        rules = []
        for rule in self.tensor_rules:
            try:
                pattern, spec = rule
                re.compile(pattern)
            except (TypeError, ValueError, re.error) as e:
                raise ValueError(
                    f"tensor_rules entries must be (path_regex, PartitionSpec): {rule!r} ({e})"
                ) from None
            spec = spec if isinstance(spec, P) else P(*spec)
            for axis in spec:
                if axis not in (None, MODEL):
                    raise ValueError(
                        f"tensor rule {pattern!r} may only use the 'model' axis, got {spec}"
                    )
            rules.append((pattern, spec))
        return tuple(rules)

    @property
    def host_split(self):
        """The ``data`` axis as hosts x local devices (``zeroflow.engine.hosts.HostSplit``)."""
        if isinstance(self.mesh, AbstractMesh) and self.hosts is None:
            raise ValueError("a planning mesh has no devices to read hosts from; pass hosts=H")
        return host_split(self.mesh, self.hosts)

    @property
    def weight_copies(self) -> int:
        """How many times the stage-3 compute copy holds each weight: once, or once per host
        (hpZ: each host's devices hold a whole copy between them)."""
        return self.host_split.hosts if self.hierarchical else 1

    @property
    def gather_groups(self):
        """``axis_index_groups`` of the stage-3 weight gathers: None (all devices), or each
        host's devices (hpZ)."""
        return self.host_split.within if self.hierarchical else None

    # -- sizes -------------------------------------------------------------------------------
    @property
    def data_size(self) -> int:
        """How many devices each ZeRO-sharded array is split over: the ``data`` axis times the
        ``context`` axis (the whole ``data`` axis where there is no context axis)."""
        return self.mesh.shape[DATA] * self.context_size

    @property
    def context_size(self) -> int:
        """How many devices a sequence is split over (1: no context axis)."""
        return self.mesh.shape.get(CONTEXT, 1)

    @property
    def batch_split(self) -> int:
        """How many devices the batch's rows are split over: the ``data`` axis."""
        return self.mesh.shape[DATA]

    @property
    def zero_axes(self) -> str | tuple[str, str]:
        """The mesh axis (or pair) states are sharded and gradients summed over."""
        return zero_axes(self.mesh)

    @property
    def manual_axes(self) -> set[str]:
        """The axes a ``shard_map`` of the engine places collectives on by hand: the ZeRO axes
        (``data``, and ``context``, over which attention also exchanges keys and values); every
        axis where no tensor-parallel rule leaves ``model`` to the compiler, which is what
        kernels with custom partitioners (cuDNN attention) need."""
        if self.model_size > 1:
            return set(zero_axis_names(self.mesh))
        return set(self.mesh.axis_names)

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

    def keeps_compute_copy(self, compute_dtype) -> bool:
        """Whether the state holds the trained weights a second time, in ``compute_dtype``.
        Below stage 3 that copy is the whole weights the forward pass reads. At stage 3 every
        use all-gathers a shard anyway, so the master's own shard is cast as it is gathered: no
        second copy (2 bytes per parameter over N saved; a Llama-8B shape on 8 devices: 2 GB).
        A copy stays where something else reads it: hpZ's within-host copy, qwZ's quantized
        gathers, and offload (the master lives in host memory, the weights are used on the
        device)."""
        if jnp.dtype(compute_dtype).itemsize >= 4:
            return False
        return (
            not self.shards_compute
            or self.offloads
            or self.hierarchical
            or self.quantize_weights is not None
        )

    @property
    def gathers_whole_weights(self) -> bool:
        """Stages 1-2: the master is sharded while the forward pass reads whole weights, so the
        whole weights are all-gathered from the shards (after each update into the compute
        copy, or, with none, from the master for each step)."""
        return self.shards_storage and not self.shards_compute

    def keeps_whole_compute_copy(self, compute_dtype) -> bool:
        """The compute copy is kept whole (below stage 3): the update's new weights must be
        gathered into it."""
        return self.keeps_compute_copy(compute_dtype) and not self.shards_compute

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
                    raise ValueError(
                        f"tensor rule {pattern!r} spec {spec} has more entries than "
                        f"{path} has dimensions {tuple(shape)}"
                    )
                for dim, axis in zip(shape, entries):
                    if axis == MODEL and dim % self.model_size:
                        raise ValueError(
                            f"{path}: dimension {dim} does not divide by model={self.model_size} "
                            f"(tensor rule {pattern!r})"
                        )
                return entries
        return (None,) * len(shape)

    def leaf_layout(self, path: str, shape, *, tensor_rules: bool = True) -> LeafLayout:
        """The ZeRO dimension: a wide matrix's columns (a vocabulary head, at least ``WIDE``
        times wider than tall and not a lookup table, ``is_lookup_table``: its matmul is
        computed where its columns are, ``grads/split_columns.py``) or else a matrix's rows
        when they divide by N, else the largest free dimension that divides by N; failing that,
        the largest free dimension of at least N entries, padded up to a multiple of N; failing
        that (every free dimension shorter than N, or a scalar) none. A leaf of three or more
        dimensions is most often a stack of layers (``[layers, in, out]``) fetched one layer at a
        time: it is split along each layer's rows (its second dimension) when they divide by N,
        so that a layer's slice is gathered, and its gradient reduce-scattered, along the
        slice's major dimension; split along a later dimension, each gathered slice lands on a
        new leading axis to be moved into place and its gradient moved back before the
        reduction (a pass over the layer's weights and one over its gradient, per layer, in
        each direction). ``tensor_rules=False``: an array that is not a parameter (optimizer
        state of its own shape)."""
        shape = tuple(int(d) for d in shape)
        tspec = self._tensor_spec(path, shape) if tensor_rules else (None,) * len(shape)
        n = self.data_size
        free = [d for d, size in enumerate(shape) if tspec[d] is None and size >= n]
        if n == 1 or not free:
            return LeafLayout(shape, tspec, None, zero_axis=self.zero_axes)
        largest = lambda dims: max(dims, key=lambda d: (shape[d], -d))  # noqa: E731
        even = [d for d in free if shape[d] % n == 0]
        if (
            len(shape) == 2
            and 1 in even
            and shape[1] >= WIDE * shape[0]
            and not is_lookup_table(path)
        ):
            zero_dim = 1  # a vocabulary head: split by columns (see grads/split_columns.py)
        elif len(shape) == 2 and 0 in even:
            zero_dim = 0
        elif len(shape) >= 3 and 1 in even:
            zero_dim = 1  # a layer's rows, in a stack of layers
        else:
            zero_dim = largest(even) if even else largest(free)
        return LeafLayout(
            shape, tspec, zero_dim, pad=-shape[zero_dim] % n, zero_axis=self.zero_axes
        )

    def layouts(self, params, trainable=True) -> Any:
        """A pytree of ``LeafLayout`` matching ``params`` (arrays or ShapeDtypeStructs).
        ``trainable``: which leaves train (``LeafLayout.trains``), one bool for them all or a
        tree of bools matching ``params`` (``zeroflow.engine.frozen.trainable_mask``)."""

        def one(path, x, trains):
            lay = self.leaf_layout(path_str(path), np.shape(x))
            return lay if trains else dataclasses.replace(lay, trains=False)

        if isinstance(trainable, bool):
            return jax.tree_util.tree_map_with_path(lambda p, x: one(p, x, trainable), params)
        return jax.tree_util.tree_map_with_path(one, params, trainable)

    # -- shardings ---------------------------------------------------------------------------
    def _named(self, spec: P, memory_kind: str | None = None) -> NamedSharding:
        return NamedSharding(self.mesh, spec, memory_kind=memory_kind)

    @property
    def storage_memory_kind(self) -> str | None:
        return "pinned_host" if self.offloads else None

    @property
    def compute_memory_kind(self) -> str | None:
        return "pinned_host" if self.offloads_params else None

    def storage_shardings(
        self, params, memory_kind: str | None | bool = True, *, padded: bool = False
    ):
        """Shardings of fp32 master weights (and so of the optimizer state), for arrays of the
        parameters' own shapes (a padded leaf whole over ``data``; this is how a loader places
        parameters before ``init_train_state``); ``padded=True``: for the stored, padded arrays
        of the training state."""
        kind = self.storage_memory_kind if memory_kind is True else memory_kind
        return self._shardings(params, self.shards_storage, kind, padded)

    def compute_shardings(
        self, params, memory_kind: str | None | bool = True, *, padded: bool = False
    ):
        """Shardings of the compute-dtype weights as they are stored between steps (``padded``
        as for ``storage_shardings``)."""
        kind = self.compute_memory_kind if memory_kind is True else memory_kind
        return self._shardings(params, self.shards_compute, kind, padded)

    def _shardings(self, params, with_zero: bool, kind, padded: bool):
        return self.shardings_of(self.layouts(params), with_zero, kind, padded=padded)

    def shardings_of(self, layouts, with_zero: bool, memory_kind: str | None, *, padded=True):
        """``NamedSharding``s of a tree of ``LeafLayout``: split over ``data`` where
        ``with_zero``, for the stored (padded) arrays, or ``padded=False`` for arrays of their
        own shapes (``LeafLayout.logical_spec``)."""

        def one(lay: LeafLayout):
            spec = lay.spec(with_zero) if padded else lay.logical_spec(with_zero)
            return self._named(spec, memory_kind)

        return jax.tree.map(one, layouts, is_leaf=is_layout)

    def replicated(self, memory_kind: str | None = None) -> NamedSharding:
        return self._named(P(), memory_kind)

    def batch_spec(self, ndim: int = 1) -> P:
        """How a batch leaf of ``ndim`` dimensions is split: rows over ``data``; with a context
        axis, the sequence (the second dimension) over ``context``."""
        return P(DATA, CONTEXT) if self.context_size > 1 and ndim >= 2 else P(DATA)

    def batch_sharding(self, ndim: int = 1) -> NamedSharding:
        return self._named(self.batch_spec(ndim))

    def replicated_fraction(self, params) -> float:
        """Fraction of parameter elements that no dimension lets ZeRO split, even padded (kept
        whole on every device); 1.0 on one data device."""
        return self.describe(params).replicated_fraction

    def describe(self, params) -> PlanDescription:
        """Per-device bytes of the fp32 master weights of ``params`` under this plan, what padding
        adds, and the leaves (and share of elements) kept whole over ``data``."""
        rows = [
            (path_str(path), lay)
            for path, lay in jax.tree_util.tree_leaves_with_path(
                self.layouts(params), is_leaf=is_layout
            )
        ]
        split = self.shards_storage
        total = sum(math.prod(lay.shape) for _, lay in rows)
        whole = [p for p, lay in rows if lay.zero_dim is None]
        per_device = sum(
            4 * math.prod(self._named(lay.spec(split)).shard_shape(lay.stored_shape(split)))
            for _, lay in rows
        )
        padding = sum(
            4 * (math.prod(lay.stored_shape(split)) - math.prod(lay.shape)) for _, lay in rows
        )
        kept = sum(math.prod(lay.shape) for _, lay in rows if lay.zero_dim is None)
        return PlanDescription(
            stage=self.stage,
            data_size=self.data_size,
            param_bytes=4 * total,
            master_bytes_per_device=per_device,
            padding_bytes=padding,
            replicated_fraction=kept / max(total, 1),
            replicated=tuple(whole),
            padded=tuple(p for p, lay in rows if split and lay.padding(True)),
        )

    def warn_if_replicated(self, params, threshold: float = 0.01) -> None:
        """One warning (per call site, Python's default filter) when more than ``threshold`` of
        the parameters stay whole on every device although the plan shards them."""
        if not self.shards_storage or self.data_size == 1:
            return
        described = self.describe(params)
        if described.replicated_fraction > threshold:
            warnings.warn(
                f"ZeRO stage {self.stage} keeps {described.replicated_fraction:.1%} of the "
                f"parameters whole on each of {self.data_size} devices (no dimension of "
                f"at least {self.data_size} entries free of tensor rules: "
                f"{', '.join(described.replicated[:4])}"
                + (" ..." if len(described.replicated) > 4 else "")
                + ")",
                stacklevel=3,
            )


@dataclasses.dataclass(frozen=True)
class PlanDescription:
    """What ``ZeroPlan.describe`` reports; ``str()`` gives a short summary."""

    stage: int
    data_size: int
    param_bytes: int
    "fp32 bytes of all parameters (one whole copy)."
    master_bytes_per_device: int
    "fp32 master bytes one device stores, padding included (optimizer moments are alike)."
    padding_bytes: int
    "fp32 bytes padding adds to the whole stored master (all devices together)."
    replicated_fraction: float
    "Share of parameter elements that no dimension lets ZeRO split (1.0 on one data device)."
    replicated: tuple[str, ...]
    "Paths of the leaves kept whole over ``data`` at every stage."
    padded: tuple[str, ...]
    "Paths of the leaves stored padded."

    def __str__(self) -> str:
        leaves = lambda k: f"{k} leaf" if k == 1 else f"{k} leaves"  # noqa: E731
        return (
            f"ZeRO stage {self.stage} on {self.data_size} data devices: fp32 master "
            f"{self.master_bytes_per_device:,} bytes per device of {self.param_bytes:,} "
            f"({self.master_bytes_per_device / max(self.param_bytes, 1):.2%}); padding "
            f"{self.padding_bytes:,} bytes in all ({leaves(len(self.padded))}); whole on every "
            f"device {self.replicated_fraction:.2%} ({leaves(len(self.replicated))})"
        )
