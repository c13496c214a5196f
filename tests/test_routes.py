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
    is_layout = lambda x: isinstance(x, zf.engine.plan.LeafLayout)  # noqa: E731
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
        layouts = plan.layouts(SHAPES)
        got = step_routes(layouts, plan, prec, per_layer, accum, trainable=mask)
        want = _routes_before_the_table(layouts, plan, prec, per_layer, accum, trainable=mask)
        assert got == want, (offload, update_on, widens, params, accum, per_layer, mask)
        checked += 1
    assert checked == len(OFFLOADS) * 2 * 2 * 2 * 2 * len(MASKS)
