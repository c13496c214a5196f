"""How each parameter reaches the loss and how its gradient leaves the backward pass: one
``Route`` per leaf, decided once from its layout, the plan and the precision
(``step_routes``), and read by the gradient code (``local_grads``), the step and the memory
estimator alike.

A route is two choices and two facts:
- ``fetch``: how the loss gets the weight (``Fetch``): as stored, fetched by ``gather_on_use``
  just before each use, or handed to the loss's ``gather_layer`` one layer at a time;
- ``reduce``: how its gradient leaves (``Reduce``): whole and all-reduced after the step's
  micro-batches, reduce-scattered inside the backward pass as soon as it is complete, or
  reduce-scattered after each micro-batch's backward pass;
- ``sharded``: the compute weight is stored as a shard (ZeRO-3) and gathered for each use;
- ``stream``: the compute weight lives in host memory and is copied in per layer.

The decision is one table, ``ROUTES``: a ``RouteKey`` (what the stage does with gradients,
where the layer stack's compute weights live, where the leaf is split, whether it trains,
as its layout says; ``route_key``) to a ``Decision``, a row per case with its reason. The one choice outside it is
the backend's: where XLA:CPU widens half precision, a weight the table uses as stored is
fetched on use instead (``fetches_whole``).
"""

from __future__ import annotations

import dataclasses
import enum
from typing import NamedTuple

import jax
import jax.numpy as jnp

from zeroflow.autocast.precision import Precision
from zeroflow.engine.grads.sources import dim_in_layer
from zeroflow.engine.plan import LeafLayout, ZeroPlan, is_layout
from zeroflow.util.tree import is_under, path_str


class Fetch(enum.Enum):
    STORED = "used as stored"
    ON_USE = "fetched on use (gather_on_use)"
    PER_LAYER = "one layer at a time (gather_layer)"


class Reduce(enum.Enum):
    ALL_REDUCE = "whole, all-reduced after the micro-batches"
    ON_USE = "reduce-scattered in the backward pass, on use"
    AFTER = "reduce-scattered after each micro-batch"
    NONE = "frozen: no gradient"


@dataclasses.dataclass(frozen=True)
class Route:
    """How one parameter reaches the loss and how its gradient leaves the backward pass."""

    dim: int | None
    "ZeRO dimension of the (stacked) leaf, None when it is kept whole."
    fetch: Fetch
    reduce: Reduce
    sharded: bool
    "Stage 3: the compute weight is a shard, gathered for each use."
    stream: bool
    "Kept in host memory, copied to the device one layer at a time."
    size: int | None = None
    "The leaf's own length along ``dim``."
    padded: int | None = None
    "Its stored length along ``dim`` when that is padded up to a multiple of N, else None."

    @property
    def frozen(self) -> bool:
        """A frozen weight: fetched for the loss, never differentiated."""
        return self.reduce is Reduce.NONE

    @property
    def cut(self) -> int | None:
        """The length a gathered (padded) weight is cut back to; None when it is not padded."""
        return self.size if self.padded is not None else None

    @property
    def sharded_grad(self) -> bool:
        """The gradient leaves ``local_grads`` split over ``data``."""
        return self.reduce in (Reduce.ON_USE, Reduce.AFTER)

    @property
    def split_dim(self) -> int:
        """``dim`` of a leaf that is split over ``data``: one that is sharded or whose gradient
        is reduce-scattered; such a route always has one."""
        if self.dim is None:
            raise AssertionError(f"{self} keeps its leaf whole: it has no split dimension")
        return self.dim


# -- the table's key -------------------------------------------------------------------------
class Stage(enum.Enum):
    """The ZeRO stage as routes see it: what happens to a trained gradient."""

    ALL_REDUCED = "stage 0, or 1 with micro-batches: whole gradients, all-reduced once per step"
    SCATTERED = "stage 1 with one micro-batch, or 2: whole weights, gradients reduce-scattered"
    GATHERED = "stage 3: weights stored as shards and gathered for each use"


class Memory(enum.Enum):
    """Where the layer stack's compute weights live between steps."""

    DEVICE = "device memory"
    HOST = "host memory (offload='optimizer+params'), copied in one layer at a time"


class Place(enum.Enum):
    """Where a leaf is split over ``data``, and whether it is in the per-layer stack."""

    WHOLE = "not split (no dimension of N entries): whole on every device"
    SPLIT = "split, outside the layer stack"
    STACK_WHOLE = "in the layer stack, not split"
    STACK_BY_LAYER = "in the layer stack, split along its layer axis: each device holds layers"
    STACK_IN_LAYER = "in the layer stack, split within each layer"


ALL_REDUCED, SCATTERED, GATHERED = Stage
DEVICE, HOST = Memory
WHOLE, SPLIT, STACK_WHOLE, STACK_BY_LAYER, STACK_IN_LAYER = Place
TRAINED, FROZEN = True, False


class RouteKey(NamedTuple):
    stage: Stage
    memory: Memory
    "``HOST`` only for the layer stack: any other offloaded weight the step brings in whole."
    place: Place
    trains: bool


class Decision(NamedTuple):
    fetch: Fetch
    reduce: Reduce
    sharded: bool
    stream: bool


def route_key(
    plan: ZeroPlan,
    prec: Precision,
    lay: LeafLayout,
    path: str,
    *,
    per_layer: str | None,
    grad_accum: int = 1,
) -> RouteKey:
    """The table's key for the leaf at ``path`` (``path_str``) of layout ``lay`` (which says
    whether it trains). ``per_layer``: the top-level key of the stack handed to
    ``gather_layer`` (or None).

    Stage 1 reduces gradients once per step: with one micro-batch that is on use, as stage 2
    (a reduce-scatter moves half the bytes of an all-reduce and leaves each device the slice
    its optimizer shard needs); with several it accumulates whole gradients and reduces them
    once at the end, where stage 2 reduce-scatters every micro-batch's."""
    if plan.shards_compute:
        stage = GATHERED
    elif plan.shards_grads or (plan.shards_storage and grad_accum == 1):
        stage = SCATTERED
    else:
        stage = ALL_REDUCED
    in_stack = is_under(path, per_layer)
    # fp32 at stages 1-2 keeps no compute copy: the weights are gathered from the master on
    # the device, so nothing of them stays in host memory.
    host = (
        in_stack
        and plan.offloads_params
        and (plan.keeps_compute_copy(prec.compute_dtype) or not plan.gathers_whole_weights)
    )
    if lay.zero_dim is None:
        place = STACK_WHOLE if in_stack else WHOLE
    elif not in_stack:
        place = SPLIT
    else:
        place = STACK_BY_LAYER if dim_in_layer(lay.zero_dim) is None else STACK_IN_LAYER
    return RouteKey(stage, HOST if host else DEVICE, place, lay.trains)


# -- the table -------------------------------------------------------------------------------
# (stage, stack memory, place, trains): (fetch, reduce, sharded, stream). A frozen weight is
# fetched as the compute weights are and reduces nothing; it never has a gradient to scatter.
ROUTES: dict[RouteKey, Decision] = {
    RouteKey(*k): Decision(*v)
    for k, v in {
        # Stage 0, or stage 1 accumulating micro-batches: every weight is whole on the device and
        # every gradient whole, summed over the micro-batches and all-reduced once.
        (ALL_REDUCED, DEVICE, WHOLE, TRAINED): (Fetch.STORED, Reduce.ALL_REDUCE, False, False),
        (ALL_REDUCED, DEVICE, WHOLE, FROZEN): (Fetch.STORED, Reduce.NONE, False, False),
        (ALL_REDUCED, DEVICE, SPLIT, TRAINED): (Fetch.STORED, Reduce.ALL_REDUCE, False, False),
        (ALL_REDUCED, DEVICE, SPLIT, FROZEN): (Fetch.STORED, Reduce.NONE, False, False),
        (ALL_REDUCED, DEVICE, STACK_WHOLE, TRAINED): (
            Fetch.STORED,
            Reduce.ALL_REDUCE,
            False,
            False,
        ),
        (ALL_REDUCED, DEVICE, STACK_WHOLE, FROZEN): (Fetch.STORED, Reduce.NONE, False, False),
        (ALL_REDUCED, DEVICE, STACK_BY_LAYER, TRAINED): (
            Fetch.STORED,
            Reduce.ALL_REDUCE,
            False,
            False,
        ),
        (ALL_REDUCED, DEVICE, STACK_BY_LAYER, FROZEN): (Fetch.STORED, Reduce.NONE, False, False),
        (ALL_REDUCED, DEVICE, STACK_IN_LAYER, TRAINED): (
            Fetch.STORED,
            Reduce.ALL_REDUCE,
            False,
            False,
        ),
        (ALL_REDUCED, DEVICE, STACK_IN_LAYER, FROZEN): (Fetch.STORED, Reduce.NONE, False, False),
        # ... a stack in host memory is copied in one layer at a time; its gradient stays whole.
        (ALL_REDUCED, HOST, STACK_WHOLE, TRAINED): (
            Fetch.PER_LAYER,
            Reduce.ALL_REDUCE,
            False,
            True,
        ),
        (ALL_REDUCED, HOST, STACK_WHOLE, FROZEN): (Fetch.PER_LAYER, Reduce.NONE, False, True),
        (ALL_REDUCED, HOST, STACK_BY_LAYER, TRAINED): (
            Fetch.PER_LAYER,
            Reduce.ALL_REDUCE,
            False,
            True,
        ),
        (ALL_REDUCED, HOST, STACK_BY_LAYER, FROZEN): (Fetch.PER_LAYER, Reduce.NONE, False, True),
        (ALL_REDUCED, HOST, STACK_IN_LAYER, TRAINED): (
            Fetch.PER_LAYER,
            Reduce.ALL_REDUCE,
            False,
            True,
        ),
        (ALL_REDUCED, HOST, STACK_IN_LAYER, FROZEN): (Fetch.PER_LAYER, Reduce.NONE, False, True),
        # Stage 2 (or 1, one micro-batch): weights whole; a split gradient is reduce-scattered the
        # moment it is complete. Not split: nothing to scatter, all-reduced as at stage 0.
        (SCATTERED, DEVICE, WHOLE, TRAINED): (Fetch.STORED, Reduce.ALL_REDUCE, False, False),
        (SCATTERED, DEVICE, WHOLE, FROZEN): (Fetch.STORED, Reduce.NONE, False, False),
        # Fetched on use: each use's unit reduce-scatters its gradient (per iteration inside a
        # loss's scan, where one reduce-scatter of the stacked gradient would hold the fp32 stack).
        (SCATTERED, DEVICE, SPLIT, TRAINED): (Fetch.ON_USE, Reduce.ON_USE, False, False),
        (SCATTERED, DEVICE, SPLIT, FROZEN): (Fetch.STORED, Reduce.NONE, False, False),
        (SCATTERED, DEVICE, STACK_WHOLE, TRAINED): (Fetch.STORED, Reduce.ALL_REDUCE, False, False),
        (SCATTERED, DEVICE, STACK_WHOLE, FROZEN): (Fetch.STORED, Reduce.NONE, False, False),
        # A layer's slice is not split the same way on every device: the stack is scattered whole.
        (SCATTERED, DEVICE, STACK_BY_LAYER, TRAINED): (Fetch.ON_USE, Reduce.ON_USE, False, False),
        (SCATTERED, DEVICE, STACK_BY_LAYER, FROZEN): (Fetch.STORED, Reduce.NONE, False, False),
        # gather_layer scatters each layer's gradient inside the scan's backward pass.
        (SCATTERED, DEVICE, STACK_IN_LAYER, TRAINED): (
            Fetch.PER_LAYER,
            Reduce.ON_USE,
            False,
            False,
        ),
        (SCATTERED, DEVICE, STACK_IN_LAYER, FROZEN): (Fetch.STORED, Reduce.NONE, False, False),
        # A stack in host memory is copied in one layer at a time ...
        (SCATTERED, HOST, STACK_WHOLE, TRAINED): (Fetch.PER_LAYER, Reduce.ALL_REDUCE, False, True),
        (SCATTERED, HOST, STACK_WHOLE, FROZEN): (Fetch.PER_LAYER, Reduce.NONE, False, True),
        # ... a layer's gradient is whole on each device: the stacked one is scattered after the
        # micro-batch's backward pass,
        (SCATTERED, HOST, STACK_BY_LAYER, TRAINED): (Fetch.PER_LAYER, Reduce.AFTER, False, True),
        (SCATTERED, HOST, STACK_BY_LAYER, FROZEN): (Fetch.PER_LAYER, Reduce.NONE, False, True),
        # ... or, split within the layer, scattered per layer in the backward pass.
        (SCATTERED, HOST, STACK_IN_LAYER, TRAINED): (Fetch.PER_LAYER, Reduce.ON_USE, False, True),
        (SCATTERED, HOST, STACK_IN_LAYER, FROZEN): (Fetch.PER_LAYER, Reduce.NONE, False, True),
        # Stage 3: a split weight is stored as shards, gathered for each use and its gradient
        # reduce-scattered on use; a weight no dimension splits is whole, as at stage 0.
        (GATHERED, DEVICE, WHOLE, TRAINED): (Fetch.STORED, Reduce.ALL_REDUCE, False, False),
        (GATHERED, DEVICE, WHOLE, FROZEN): (Fetch.STORED, Reduce.NONE, False, False),
        (GATHERED, DEVICE, SPLIT, TRAINED): (Fetch.ON_USE, Reduce.ON_USE, True, False),
        (GATHERED, DEVICE, SPLIT, FROZEN): (Fetch.ON_USE, Reduce.NONE, True, False),
        (GATHERED, DEVICE, STACK_WHOLE, TRAINED): (Fetch.STORED, Reduce.ALL_REDUCE, False, False),
        (GATHERED, DEVICE, STACK_WHOLE, FROZEN): (Fetch.STORED, Reduce.NONE, False, False),
        # No layer's slice is split the same way on every device: gather_on_use gathers the stack
        # for the loss's scan.
        (GATHERED, DEVICE, STACK_BY_LAYER, TRAINED): (Fetch.ON_USE, Reduce.ON_USE, True, False),
        (GATHERED, DEVICE, STACK_BY_LAYER, FROZEN): (Fetch.ON_USE, Reduce.NONE, True, False),
        # gather_layer gathers one layer's slice inside the scan.
        (GATHERED, DEVICE, STACK_IN_LAYER, TRAINED): (Fetch.PER_LAYER, Reduce.ON_USE, True, False),
        (GATHERED, DEVICE, STACK_IN_LAYER, FROZEN): (Fetch.PER_LAYER, Reduce.NONE, True, False),
        # A stack in host memory: not split, copied in whole per layer;
        (GATHERED, HOST, STACK_WHOLE, TRAINED): (Fetch.PER_LAYER, Reduce.ALL_REDUCE, False, True),
        (GATHERED, HOST, STACK_WHOLE, FROZEN): (Fetch.PER_LAYER, Reduce.NONE, False, True),
        # split along the layer axis, it cannot be copied in one layer at a time: gathered as above;
        (GATHERED, HOST, STACK_BY_LAYER, TRAINED): (Fetch.ON_USE, Reduce.ON_USE, True, False),
        (GATHERED, HOST, STACK_BY_LAYER, FROZEN): (Fetch.ON_USE, Reduce.NONE, True, False),
        # split within a layer: the layer's shard is copied in, then gathered.
        (GATHERED, HOST, STACK_IN_LAYER, TRAINED): (Fetch.PER_LAYER, Reduce.ON_USE, True, True),
        (GATHERED, HOST, STACK_IN_LAYER, FROZEN): (Fetch.PER_LAYER, Reduce.NONE, True, True),
    }.items()
}


def step_routes(
    layouts,
    plan: ZeroPlan,
    prec: Precision,
    per_layer: str | None,
    grad_accum: int = 1,
):
    """A ``Route`` per leaf of ``layouts`` (``plan.layouts``, frozen leaves marked), as the
    train step takes them: the row of ``ROUTES`` at each leaf's ``route_key``. ``per_layer``:
    the top-level key of the layer stack handed to ``gather_layer`` (or None)."""
    whole_on_use = fetches_whole(plan, prec.compute_dtype)

    def route(path, lay: LeafLayout) -> Route:
        key = route_key(plan, prec, lay, path_str(path), per_layer=per_layer, grad_accum=grad_accum)
        fetch, reduce, sharded, stream = ROUTES[key]
        if fetch is Fetch.STORED and whole_on_use:
            fetch = Fetch.ON_USE
        size = None if lay.zero_dim is None else lay.shape[lay.zero_dim]
        padded = size + lay.pad if size is not None and lay.pad else None
        return Route(lay.zero_dim, fetch, reduce, sharded, stream, size, padded)

    return jax.tree_util.tree_map_with_path(route, layouts, is_leaf=is_layout)


def trained(routes):
    """``routes`` with holes (None) at the frozen leaves: the structure of the gradients."""
    return jax.tree.map(lambda r: None if r.frozen else r, routes, is_leaf=is_route)


def fetches_whole(plan: ZeroPlan, dtype) -> bool:
    """Whether whole (stage 0-2) weights should also be fetched on use: on XLA:CPU, which
    multiplies half-precision matrices in fp32 on converted copies and, because the forward and
    backward pass read the same weight, keeps each copy alive between them (4 bytes per
    parameter of every weight at once). Fetched on use, each use converts its own copy. GPUs
    multiply bf16/fp16 natively, so there it would only cost a pass over the weights."""
    return jnp.dtype(dtype).itemsize < 4 and plan.traits.widens_half_precision


def is_route(x) -> bool:
    """The leaf predicate of a tree of routes."""
    return isinstance(x, Route)
