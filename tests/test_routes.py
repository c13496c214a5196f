"""zeroflow.engine.grads.routes: how each weight reaches the loss and how its gradient leaves.

The routes over a grid of plans must be those the engine took before the decision became a
table (``_routes_before_the_table``, the earlier code kept as the record).
"""
import itertools

import jax
import jax.numpy as jnp
import pytest

import zeroflow as zf
from zeroflow.engine.grads.routes import Fetch, Reduce, Route, step_routes
from zeroflow.engine.plan import is_layout
from zeroflow.util.tree import path_str

# With data=8: each kind of leaf the table tells apart, outside and inside the layer stack.
PARAMS = {
    "scale": (3,),          # no dimension of 8 entries: whole on every device
    "rows": (16, 4),        # split along dimension 0
    "cols": (4, 16),        # split along dimension 1
    "padded": (10,),        # split along dimension 0, stored padded to 16
    "layers": {
        "w": (2, 16, 8),    # split within a layer (dimension 1)
        "b": (8, 3),        # split along the layer axis
        "ln": (2, 3),       # not split
        "wp": (2, 12),      # split within a layer, padded
        "bp": (12, 2),      # split along the layer axis, padded
    },
}
SHAPES = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s, jnp.float32), PARAMS,
                      is_leaf=lambda x: isinstance(x, tuple))
_PATHS = [path_str(p) for p, _ in jax.tree_util.tree_leaves_with_path(SHAPES)]
# Two complementary masks: every leaf is frozen in one of them.
MASKS = [None] + [jax.tree.unflatten(jax.tree.structure(SHAPES),
                                     [(i + parity) % 2 == 0 for i in range(len(_PATHS))])
                  for parity in (0, 1)]
OFFLOADS = [("none", "device"), ("optimizer", "device"), ("optimizer", "host"),
            ("optimizer+params", "device"), ("optimizer+params", "host")]


def _traits(widens: bool):
    return zf.backend.Traits(platform="cpu" if widens else "gpu", widens_half_precision=widens)


def _routes_before_the_table(layouts, plan, prec, per_layer, grad_accum=1, trainable=None):
    """``step_routes`` as it was written before the table (eight interlocking booleans): the
    record the table reproduces."""
    reduces_on_use = plan.shards_grads or (plan.shards_storage and grad_accum == 1)
    from_host = plan.offloads_params and (prec.params != "fp32" or plan.stage in (0, 3))
    fetch_whole = (jnp.dtype(prec.compute_dtype).itemsize < 4
                   and plan.traits.widens_half_precision)

    def route(path, lay, trains=True):
        under = per_layer is not None and (path_str(path) + "/").startswith(per_layer + "/")
        split = lay.zero_dim is not None
        sharded = plan.shards_compute and split
        scatter = trains and reduces_on_use and not plan.shards_compute and split
        within_layer = under and split and lay.zero_dim > 0
        stream = from_host and under and not (sharded and not within_layer)
        if under and (((sharded or scatter) and within_layer) or stream):
            fetch = Fetch.PER_LAYER
        elif sharded or fetch_whole or scatter:
            fetch = Fetch.ON_USE
        else:
            fetch = Fetch.STORED
        if not trains:
            reduce = Reduce.NONE
        elif sharded or (scatter and (fetch is not Fetch.PER_LAYER or lay.zero_dim > 0)):
            reduce = Reduce.ON_USE
        elif scatter:
            reduce = Reduce.AFTER
        else:
            reduce = Reduce.ALL_REDUCE
        size = None if lay.zero_dim is None else lay.shape[lay.zero_dim]
        padded = size + lay.pad if split and lay.pad else None
        return Route(lay.zero_dim, fetch, reduce, sharded, stream, size, padded)
    if trainable is None:
        return jax.tree_util.tree_map_with_path(route, layouts, is_leaf=is_layout)
    return jax.tree_util.tree_map_with_path(route, layouts, trainable, is_leaf=is_layout)


@pytest.mark.parametrize("data", [1, 8])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_routes_are_those_of_the_code_before_the_table(data, stage):
    mesh = zf.planning_mesh(data)
    checked = 0
    for (offload, update_on), widens, params, accum, per_layer, mask in itertools.product(
            OFFLOADS, (False, True), ("fp32", "bf16"), (1, 2), (None, "layers"), MASKS):
        plan = zf.ZeroPlan(mesh, stage=stage, offload=offload, update_on=update_on,
                           traits=_traits(widens))
        prec = zf.Precision(params=params)
        layouts = plan.layouts(SHAPES, trainable=True if mask is None else mask)
        got = step_routes(layouts, plan, prec, per_layer, accum)
        want = _routes_before_the_table(layouts, plan, prec, per_layer, accum, trainable=mask)
        assert got == want, (offload, update_on, widens, params, accum, per_layer, mask)
        checked += 1
    assert checked == len(OFFLOADS) * 2 * 2 * 2 * 2 * len(MASKS)


# -- every row of the table, against the ZeRO rules ---------------------------------------------
from zeroflow.engine.grads import routes as R  # noqa: E402

_S, _U, _L = Fetch.STORED, Fetch.ON_USE, Fetch.PER_LAYER
_ALL, _RS, _AFTER, _NONE = Reduce.ALL_REDUCE, Reduce.ON_USE, Reduce.AFTER, Reduce.NONE
A, S, G = R.ALL_REDUCED, R.SCATTERED, R.GATHERED
DEV, HOST = R.DEVICE, R.HOST
WHOLE, SPLIT, STACK, BY_LAYER, IN_LAYER = (R.WHOLE, R.SPLIT, R.STACK_WHOLE, R.STACK_BY_LAYER,
                                           R.STACK_IN_LAYER)
T, F = True, False

# (stage, stack memory, place, trains, fetch, reduce, sharded, stream): the whole table.
ROWS = [
    (A, DEV, WHOLE, T, _S, _ALL, F, F), (A, DEV, WHOLE, F, _S, _NONE, F, F),
    (A, DEV, SPLIT, T, _S, _ALL, F, F), (A, DEV, SPLIT, F, _S, _NONE, F, F),
    (A, DEV, STACK, T, _S, _ALL, F, F), (A, DEV, STACK, F, _S, _NONE, F, F),
    (A, DEV, BY_LAYER, T, _S, _ALL, F, F), (A, DEV, BY_LAYER, F, _S, _NONE, F, F),
    (A, DEV, IN_LAYER, T, _S, _ALL, F, F), (A, DEV, IN_LAYER, F, _S, _NONE, F, F),
    (A, HOST, STACK, T, _L, _ALL, F, T), (A, HOST, STACK, F, _L, _NONE, F, T),
    (A, HOST, BY_LAYER, T, _L, _ALL, F, T), (A, HOST, BY_LAYER, F, _L, _NONE, F, T),
    (A, HOST, IN_LAYER, T, _L, _ALL, F, T), (A, HOST, IN_LAYER, F, _L, _NONE, F, T),
    (S, DEV, WHOLE, T, _S, _ALL, F, F), (S, DEV, WHOLE, F, _S, _NONE, F, F),
    (S, DEV, SPLIT, T, _U, _RS, F, F), (S, DEV, SPLIT, F, _S, _NONE, F, F),
    (S, DEV, STACK, T, _S, _ALL, F, F), (S, DEV, STACK, F, _S, _NONE, F, F),
    (S, DEV, BY_LAYER, T, _U, _RS, F, F), (S, DEV, BY_LAYER, F, _S, _NONE, F, F),
    (S, DEV, IN_LAYER, T, _L, _RS, F, F), (S, DEV, IN_LAYER, F, _S, _NONE, F, F),
    (S, HOST, STACK, T, _L, _ALL, F, T), (S, HOST, STACK, F, _L, _NONE, F, T),
    (S, HOST, BY_LAYER, T, _L, _AFTER, F, T), (S, HOST, BY_LAYER, F, _L, _NONE, F, T),
    (S, HOST, IN_LAYER, T, _L, _RS, F, T), (S, HOST, IN_LAYER, F, _L, _NONE, F, T),
    (G, DEV, WHOLE, T, _S, _ALL, F, F), (G, DEV, WHOLE, F, _S, _NONE, F, F),
    (G, DEV, SPLIT, T, _U, _RS, T, F), (G, DEV, SPLIT, F, _U, _NONE, T, F),
    (G, DEV, STACK, T, _S, _ALL, F, F), (G, DEV, STACK, F, _S, _NONE, F, F),
    (G, DEV, BY_LAYER, T, _U, _RS, T, F), (G, DEV, BY_LAYER, F, _U, _NONE, T, F),
    (G, DEV, IN_LAYER, T, _L, _RS, T, F), (G, DEV, IN_LAYER, F, _L, _NONE, T, F),
    (G, HOST, STACK, T, _L, _ALL, F, T), (G, HOST, STACK, F, _L, _NONE, F, T),
    (G, HOST, BY_LAYER, T, _U, _RS, T, F), (G, HOST, BY_LAYER, F, _U, _NONE, T, F),
    (G, HOST, IN_LAYER, T, _L, _RS, T, T), (G, HOST, IN_LAYER, F, _L, _NONE, T, T),
]


def _zero_rules(stage, memory, place, trains):
    """The route the ZeRO rules give, stated field by field without the table."""
    split = place in (SPLIT, BY_LAYER, IN_LAYER)
    # Stage 3 stores every weight it can split as shards, gathered for each use.
    sharded = stage is G and split
    # Only the layer stack is copied in from host memory one layer at a time, and a stage-3
    # stack split along its layer axis cannot be (no device holds a layer's shard).
    stream = memory is HOST and not (stage is G and place is BY_LAYER)
    # A trained gradient that ZeRO splits is scattered at stages 2-3 (and 1 with one
    # micro-batch); a streamed stack split along its layer axis only after the backward pass.
    scattered = trains and split and stage is not A
    if not trains:
        reduce = _NONE                     # a frozen leaf has no gradient
    elif not scattered:
        reduce = _ALL                      # stage 0, or nothing to split: whole, all-reduced
    elif stream and place is BY_LAYER:
        reduce = _AFTER
    else:
        reduce = _RS
    # One layer at a time: a streamed stack, or a layer's own shard to gather or scatter.
    per_layer = stream or (place is IN_LAYER and (sharded or scattered))
    fetch = _L if per_layer else _U if (sharded or scattered) else _S
    return fetch, reduce, sharded, stream


@pytest.mark.parametrize("row", ROWS, ids=lambda r: "-".join(
    str(getattr(x, "name", x)) for x in r[:4]))
def test_every_row_follows_the_zero_rules(row):
    key, decision = R.RouteKey(*row[:4]), R.Decision(*row[4:])
    assert R.ROUTES[key] == decision
    assert _zero_rules(*key) == tuple(decision)


def test_the_rows_are_the_whole_table_and_every_one_is_reached():
    assert len({r[:4] for r in ROWS}) == len(ROWS) == len(R.ROUTES)
    reached = set()
    for stage, (offload, _), params, accum, per_layer, mask in itertools.product(
            range(4), OFFLOADS, ("fp32", "bf16"), (1, 2), (None, "layers"), MASKS):
        plan = zf.ZeroPlan(zf.planning_mesh(8), stage=stage, offload=offload,
                           update_on="device", traits=_traits(False))
        prec = zf.Precision(params=params)
        layouts = plan.layouts(SHAPES, trainable=True if mask is None else mask)
        for path, lay in jax.tree_util.tree_leaves_with_path(layouts, is_leaf=is_layout):
            reached.add(R.route_key(plan, prec, lay, path_str(path), per_layer=per_layer,
                                    grad_accum=accum))
    assert reached == set(R.ROUTES)


@pytest.mark.parametrize("widens", [False, True])
def test_only_the_backend_fetches_a_stored_weight_on_use(widens):
    """Outside the table: on XLA:CPU a half-precision weight used as stored is fetched on use
    (each use converts its own copy); fp32, or a GPU, uses it as stored."""
    plan = zf.ZeroPlan(zf.planning_mesh(8), stage=0, traits=_traits(widens))
    layouts = plan.layouts(SHAPES)
    for params in ("fp32", "bf16"):
        fetches = {r.fetch for r in jax.tree.leaves(
            step_routes(layouts, plan, zf.Precision(params=params), None), is_leaf=R.is_route)}
        assert fetches == {_U if widens and params == "bf16" else _S}
