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
A frozen weight (``zeroflow.engine.frozen``) is fetched like any other stored weight but has no
gradient: its route reduces nothing (``Reduce.NONE``).
"""
from __future__ import annotations

import dataclasses
import enum

import jax
import jax.numpy as jnp

from zeroflow.engine.plan import LeafLayout, ZeroPlan

from zeroflow.util.tree import path_str
from zeroflow.engine.precision import Precision


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
    def layer_dim(self) -> int:
        return self.dim - 1


def step_routes(layouts, plan: ZeroPlan, prec: Precision, per_layer: str | None,
                grad_accum: int = 1, trainable=None):
    """A ``Route`` per leaf of ``layouts`` (``plan.layouts``), as the train step takes them.
    ``per_layer``: the top-level key of the layer stack handed to ``gather_layer`` (or None).
    ``trainable``: a mask of bools matching ``layouts`` (None: every leaf trains); a frozen
    leaf is fetched as the compute weights are and reduces nothing.

    Stage 1 reduces gradients once per step: with one micro-batch that is on use, as stage 2
    (a reduce-scatter moves half the bytes of an all-reduce and leaves each device the slice
    its optimizer shard needs); with several it accumulates whole gradients and reduces them
    once at the end, where stage 2 reduce-scatters every micro-batch's.
    """
    reduces_on_use = plan.shards_grads or (plan.shards_storage and grad_accum == 1)
    # Offloaded compute weights stay in host memory; fp32 at stages 1-2 keeps no compute copy:
    # it is gathered from the master on the device.
    from_host = plan.offloads_params and (prec.params != "fp32" or plan.stage in (0, 3))
    fetch_whole = fetches_whole(plan, prec.compute_dtype)

    def route(path, lay: LeafLayout, trains: bool = True) -> Route:
        under = per_layer is not None and (path_str(path) + "/").startswith(per_layer + "/")
        split = lay.zero_dim is not None
        sharded = plan.shards_compute and split
        scatter = trains and reduces_on_use and not plan.shards_compute and split
        within_layer = under and split and lay.zero_dim > 0  # a layer's slice is itself split
        # A stage-3 stack split along its layer axis cannot be fetched one layer at a time.
        stream = from_host and under and not (sharded and not within_layer)
        if under and (((sharded or scatter) and within_layer) or stream):
            fetch = Fetch.PER_LAYER
        elif sharded or fetch_whole or scatter:
            # Whole stage-2 weights go through gather_on_use too: each use's unit reduce-
            # scatters its gradient (per iteration inside a loss's scan, where one reduce-
            # scatter of the stacked gradient after the scan would hold the whole fp32 stack).
            fetch = Fetch.ON_USE
        else:
            fetch = Fetch.STORED
        if not trains:
            reduce = Reduce.NONE
        elif sharded or (scatter and (fetch is not Fetch.PER_LAYER or lay.zero_dim > 0)):
            reduce = Reduce.ON_USE
        elif scatter:  # a streamed stack split along its layer axis: whole per layer
            reduce = Reduce.AFTER
        else:
            reduce = Reduce.ALL_REDUCE
        size = None if lay.zero_dim is None else lay.shape[lay.zero_dim]
        padded = size + lay.pad if split and lay.pad else None
        return Route(lay.zero_dim, fetch, reduce, sharded, stream, size, padded)
    if trainable is None:
        return jax.tree_util.tree_map_with_path(route, layouts, is_leaf=_is_layout)
    return jax.tree_util.tree_map_with_path(route, layouts, trainable, is_leaf=_is_layout)


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
    return isinstance(x, Route)


def _is_layout(x) -> bool:
    return isinstance(x, LeafLayout)
