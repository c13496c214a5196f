"""zeroflow.engine.grads.routes: how each weight reaches the loss and how its gradient leaves.

The ZeRO rules (Rajbhandari et al. 2020; ZeRO++, Wang et al. 2023) stated as properties and
checked on every row of the ``ROUTES`` table:

- what a stage shards: stage 1 the optimizer state, stage 2 the gradients too, stage 3 the
  parameters too, stage 0 nothing;
- what it fetches: stage 3 gathers each weight it stores as shards for compute; stages 0-2 keep
  whole (replicated) compute weights and use them as stored;
- what it reduces: stage 0 all-reduces whole gradients; stage 2 (and stage 1 with one
  micro-batch) reduce-scatters them, so each device keeps only its shard's gradient; stage 3
  reduce-scatters in the backward pass as each gradient is complete;
- how the options change that: a frozen weight keeps its storage and has no gradient;
  offloaded compute weights of the layer stack are copied in one layer at a time; ZeRO++
  changes how stage 3's collectives move bytes, not what is sharded, fetched or reduced.

Each property is a predicate on one row; a planted wrong row shows each one can fail. Plans of
every stage and option then show that the rows the engine reaches obey the same rules.
"""
import ast
import inspect
import itertools

import jax
import jax.numpy as jnp
import pytest

import zeroflow as zf
from zeroflow.engine.grads import routes as R
from zeroflow.engine.grads.routes import Decision, Fetch, Reduce, RouteKey, step_routes
from zeroflow.engine.plan import is_layout
from zeroflow.util.tree import path_str

pytestmark = pytest.mark.fast

A, S, G = R.ALL_REDUCED, R.SCATTERED, R.GATHERED
DEV, HOST = R.DEVICE, R.HOST
WHOLE, SPLIT, STACK, BY_LAYER, IN_LAYER = (R.WHOLE, R.SPLIT, R.STACK_WHOLE, R.STACK_BY_LAYER,
                                           R.STACK_IN_LAYER)
T, F = True, False
SPLIT_PLACES = {SPLIT, BY_LAYER, IN_LAYER}
STACK_PLACES = {STACK, BY_LAYER, IN_LAYER}


def is_split(key: RouteKey) -> bool:
    return key.place in SPLIT_PLACES


def scatters(d: Decision) -> bool:
    return d.reduce in (Reduce.ON_USE, Reduce.AFTER)


# -- the rules, one predicate per row --------------------------------------------------------
def only_stage_3_shards_the_weights(key, d):
    """ZeRO-3 partitions the parameters; stages 0-2 keep the compute weights whole on every
    device. A weight no dimension splits stays whole at every stage."""
    return d.sharded == (key.stage is G and is_split(key))


def a_sharded_weight_is_gathered_for_compute(key, d):
    """Stage 3 all-gathers a weight it stores as shards before the loss reads it."""
    return not d.sharded or d.fetch is not Fetch.STORED


def gradients_are_split_from_stage_2(key, d):
    """A trained gradient leaves split over ``data`` (each device keeps its shard's part)
    exactly where ZeRO partitions gradients, for every weight it can split; stage 0 (and stage
    1 accumulating micro-batches) keeps whole gradients."""
    return not key.trains or scatters(d) == (is_split(key) and key.stage is not A)


def stage_0_all_reduces(key, d):
    """Plain data parallelism: every trained gradient is all-reduced whole."""
    return key.stage is not A or not key.trains or d.reduce is Reduce.ALL_REDUCE


def stage_3_reduce_scatters_in_the_backward_pass(key, d):
    """Stage 3 reduce-scatters each sharded weight's gradient as soon as it is complete."""
    if key.stage is G and key.trains and is_split(key):
        return d.reduce is Reduce.ON_USE
    return True


def a_weight_kept_whole_is_all_reduced(key, d):
    """A trained weight no dimension splits has no shard to scatter to, at any stage."""
    return not key.trains or is_split(key) or d.reduce is Reduce.ALL_REDUCE


def only_trained_weights_have_gradients(key, d):
    return (d.reduce is Reduce.NONE) == (not key.trains)


def a_frozen_weight_keeps_its_storage(key, d):
    """Freezing removes the gradient and nothing else: the weight is stored as its trained
    twin is, and fetched as it is stored (gathered if a shard, copied in if on the host, else
    used as stored: a twin's fetch that only carries a reduce-scatter is not needed)."""
    if key.trains:
        return True
    twin = R.ROUTES[key._replace(trains=True)]
    fetch = twin.fetch if (twin.sharded or twin.stream) else Fetch.STORED
    return (d.sharded, d.stream, d.fetch) == (twin.sharded, twin.stream, fetch)


def a_gradient_is_scattered_per_layer_only_from_a_split_layer(key, d):
    """Fetched one layer at a time, a gradient is reduce-scattered layer by layer in the
    backward pass when each layer is split over the devices. A stack split along its layer
    axis holds whole layers on each device: streamed from the host at stage 2 its gradient is
    reduce-scattered after the micro-batch's backward pass, the only gradient that waits."""
    if d.reduce is Reduce.AFTER:
        return key.stage is S and d.stream and key.place is BY_LAYER
    if d.reduce is Reduce.ON_USE and d.fetch is Fetch.PER_LAYER:
        return key.place is IN_LAYER
    return True


def a_weight_is_fetched_only_for_a_reason(key, d):
    """Whole compute weights (stages 0-2) are used as stored. A weight goes through a fetch
    only to be gathered from shards (stage 3), copied in from the host (offload) or to carry
    its reduce-scatter into the backward pass; each of those needs the fetch."""
    needs = d.sharded or d.stream or d.reduce is Reduce.ON_USE
    return (d.fetch is not Fetch.STORED) == needs


def one_layer_at_a_time_only_inside_the_stack(key, d):
    """``gather_layer`` fetches the layer stack's slices: a host copy of a layer, or a layer's
    shard, which exists only when the stack is split within each layer."""
    if d.fetch is not Fetch.PER_LAYER:
        return True
    return key.place in STACK_PLACES and (d.stream or key.place is IN_LAYER)


def a_stack_split_within_layers_is_fetched_one_layer_at_a_time(key, d):
    """Gathered or scattered, a stack split within each layer moves one layer at a time, so at
    most one layer's whole weights (or gradient) exist at once."""
    return key.place is not IN_LAYER or d.fetch in (Fetch.STORED, Fetch.PER_LAYER)


def a_stack_in_host_memory_streams_one_layer_at_a_time(key, d):
    """Offloaded compute weights of the layer stack are copied to the device one layer at a
    time, except a stage-3 stack split along its layer axis (no device holds a layer's
    shard: it is gathered for the loss instead); nothing on the device streams."""
    if d.stream:
        return key.memory is HOST and d.fetch is Fetch.PER_LAYER
    return key.memory is DEV or (d.sharded and key.place is BY_LAYER)


RULES = [only_stage_3_shards_the_weights, a_sharded_weight_is_gathered_for_compute,
         gradients_are_split_from_stage_2, stage_0_all_reduces,
         stage_3_reduce_scatters_in_the_backward_pass, a_weight_kept_whole_is_all_reduced,
         only_trained_weights_have_gradients, a_frozen_weight_keeps_its_storage,
         a_gradient_is_scattered_per_layer_only_from_a_split_layer,
         a_weight_is_fetched_only_for_a_reason, one_layer_at_a_time_only_inside_the_stack,
         a_stack_split_within_layers_is_fetched_one_layer_at_a_time,
         a_stack_in_host_memory_streams_one_layer_at_a_time]


def rows_breaking(rule) -> list:
    """The keys of the table (read at call time) whose row breaks ``rule``."""
    return [key for key, d in R.ROUTES.items() if not rule(key, d)]


@pytest.mark.parametrize("rule", RULES, ids=lambda r: r.__name__)
def test_every_row_follows_the_rule(rule):
    assert rows_breaking(rule) == []


# A wrong row for each rule: the rule must name it.
PLANTED = [
    (only_stage_3_shards_the_weights, (G, DEV, SPLIT, T),
     Decision(Fetch.ON_USE, Reduce.ON_USE, False, False)),
    (only_stage_3_shards_the_weights, (S, DEV, SPLIT, T),
     Decision(Fetch.ON_USE, Reduce.ON_USE, True, False)),
    (a_sharded_weight_is_gathered_for_compute, (G, DEV, SPLIT, F),
     Decision(Fetch.STORED, Reduce.NONE, True, False)),
    (gradients_are_split_from_stage_2, (S, DEV, SPLIT, T),
     Decision(Fetch.ON_USE, Reduce.ALL_REDUCE, False, False)),
    (gradients_are_split_from_stage_2, (S, HOST, STACK, T),
     Decision(Fetch.PER_LAYER, Reduce.AFTER, False, True)),
    (stage_0_all_reduces, (A, DEV, SPLIT, T), Decision(Fetch.ON_USE, Reduce.ON_USE, False, False)),
    (stage_3_reduce_scatters_in_the_backward_pass, (G, DEV, BY_LAYER, T),
     Decision(Fetch.ON_USE, Reduce.AFTER, True, False)),
    (a_weight_kept_whole_is_all_reduced, (G, DEV, WHOLE, T),
     Decision(Fetch.ON_USE, Reduce.ON_USE, False, False)),
    (only_trained_weights_have_gradients, (S, DEV, WHOLE, F),
     Decision(Fetch.STORED, Reduce.ALL_REDUCE, False, False)),
    (only_trained_weights_have_gradients, (S, DEV, WHOLE, T),
     Decision(Fetch.STORED, Reduce.NONE, False, False)),
    (a_frozen_weight_keeps_its_storage, (G, HOST, IN_LAYER, F),
     Decision(Fetch.PER_LAYER, Reduce.NONE, True, False)),
    (a_frozen_weight_keeps_its_storage, (S, DEV, SPLIT, F),
     Decision(Fetch.ON_USE, Reduce.NONE, False, False)),
    (a_gradient_is_scattered_per_layer_only_from_a_split_layer, (S, DEV, BY_LAYER, T),
     Decision(Fetch.ON_USE, Reduce.AFTER, False, False)),
    (a_gradient_is_scattered_per_layer_only_from_a_split_layer, (S, HOST, BY_LAYER, T),
     Decision(Fetch.PER_LAYER, Reduce.ON_USE, False, True)),
    (a_weight_is_fetched_only_for_a_reason, (A, DEV, SPLIT, T),
     Decision(Fetch.ON_USE, Reduce.ALL_REDUCE, False, False)),
    (a_weight_is_fetched_only_for_a_reason, (S, DEV, SPLIT, T),
     Decision(Fetch.STORED, Reduce.ON_USE, False, False)),
    (one_layer_at_a_time_only_inside_the_stack, (S, DEV, SPLIT, T),
     Decision(Fetch.PER_LAYER, Reduce.ON_USE, False, False)),
    (a_stack_split_within_layers_is_fetched_one_layer_at_a_time, (G, DEV, IN_LAYER, T),
     Decision(Fetch.ON_USE, Reduce.ON_USE, True, False)),
    (a_stack_in_host_memory_streams_one_layer_at_a_time, (G, HOST, BY_LAYER, T),
     Decision(Fetch.ON_USE, Reduce.ON_USE, True, True)),
    (a_stack_in_host_memory_streams_one_layer_at_a_time, (S, HOST, IN_LAYER, T),
     Decision(Fetch.PER_LAYER, Reduce.ON_USE, False, False)),
]


@pytest.mark.parametrize("rule,key,wrong", PLANTED,
                         ids=lambda x: getattr(x, "__name__", None) if callable(x) else None)
def test_a_planted_wrong_row_breaks_its_rule(rule, key, wrong, monkeypatch):
    key = RouteKey(*key)
    assert R.ROUTES[key] != wrong
    monkeypatch.setattr(R, "ROUTES", {**R.ROUTES, key: wrong})
    assert rows_breaking(rule) == [key]


def test_every_rule_has_a_planted_wrong_row():
    assert {rule for rule, _, _ in PLANTED} == set(RULES)


def test_the_rules_leave_each_row_one_decision():
    """Together the rules decide every row: any other decision in any row breaks one, so no
    wrong row can pass them all."""
    decisions = [Decision(*c) for c in itertools.product(Fetch, Reduce, (T, F), (T, F))]
    for key, d in R.ROUTES.items():
        allowed = [c for c in decisions if all(rule(key, c) for rule in RULES)]
        assert allowed == [d], key


# -- the table's keys ------------------------------------------------------------------------
# Host memory is a place of the layer stack only (``RouteKey.memory``).
ALL_KEYS = {RouteKey(*k) for k in itertools.product(R.Stage, R.Memory, R.Place, (T, F))
            if k[1] is DEV or k[2] in STACK_PLACES}


def rows_written() -> int:
    """The entries of the ``ROUTES`` literal in the source: a key written twice would be
    counted twice here and once in the dict."""
    tree = ast.parse(inspect.getsource(R))
    (table,) = [node.value for node in ast.walk(tree)
                if isinstance(node, ast.AnnAssign) and getattr(node.target, "id", "") == "ROUTES"]
    (literal,) = [n for n in ast.walk(table) if isinstance(n, ast.Dict)]
    return len(literal.keys)


def table_problems() -> list[str]:
    problems = [f"missing {k}" for k in ALL_KEYS - set(R.ROUTES)]
    problems += [f"not a key {k}" for k in set(R.ROUTES) - ALL_KEYS]
    if rows_written() != len(R.ROUTES):
        problems.append(f"{rows_written()} rows written, {len(R.ROUTES)} in the table")
    return problems


def test_the_table_has_every_key_once():
    assert len(ALL_KEYS) == 3 * 5 * 2 + 3 * 3 * 2  # device: every place; host: the stack's
    assert table_problems() == []


@pytest.mark.parametrize("change", ["drop", "host outside the stack"])
def test_a_missing_or_impossible_key_is_found(change, monkeypatch):
    table = dict(R.ROUTES)
    if change == "drop":
        del table[RouteKey(G, HOST, IN_LAYER, F)]
    else:
        table[RouteKey(A, HOST, SPLIT, T)] = Decision(Fetch.PER_LAYER, Reduce.ALL_REDUCE, F, T)
    monkeypatch.setattr(R, "ROUTES", table)
    assert len(table_problems()) == 2  # the key itself, and the count against the source


# -- plans: every stage and option, through step_routes ------------------------------------
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
SPLIT_LEAVES = {"rows", "cols", "padded", "layers/w", "layers/b", "layers/wp", "layers/bp"}
BY_LAYER_LEAVES = {"layers/b", "layers/bp"}
# Two complementary masks: every leaf is frozen in one of them.
MASKS = [None] + [jax.tree.unflatten(jax.tree.structure(SHAPES),
                                     [(i + parity) % 2 == 0 for i in range(len(_PATHS))])
                  for parity in (0, 1)]
OFFLOADS = [("none", "device"), ("optimizer", "device"), ("optimizer", "host"),
            ("optimizer+params", "device"), ("optimizer+params", "host")]


def _traits(widens: bool):
    return zf.backend.Traits(platform="cpu" if widens else "gpu", widens_half_precision=widens)


def routes_by_path(plan, params="bf16", per_layer=None, grad_accum=1, trainable=None):
    layouts = plan.layouts(SHAPES, trainable=True if trainable is None else trainable)
    routes = step_routes(layouts, plan, zf.Precision(params=params), per_layer, grad_accum)
    leaves = jax.tree_util.tree_leaves_with_path(routes, is_leaf=R.is_route)
    return {path_str(p): r for p, r in leaves}


def test_the_leaves_are_the_kinds_they_are_named_for():
    plan = zf.ZeroPlan(zf.planning_mesh(8), stage=3, traits=_traits(False))
    layouts = jax.tree_util.tree_leaves_with_path(plan.layouts(SHAPES), is_leaf=is_layout)
    split = {path_str(p) for p, lay in layouts if lay.zero_dim is not None}
    by_layer = {path_str(p) for p, lay in layouts if path_str(p).startswith("layers/")
                and lay.zero_dim == 0}
    assert (split, by_layer) == (SPLIT_LEAVES, BY_LAYER_LEAVES)


# What the ZeRO paper's stages partition: (optimizer state, gradients, parameters).
PARTITIONED = {0: (False, False, False), 1: (True, False, False), 2: (True, True, False),
               3: (True, True, True)}


def _holds_shards(sharding) -> bool:
    return any("data" in (axis if isinstance(axis, tuple) else (axis,))
               for axis in sharding.spec if axis is not None)


@pytest.mark.parametrize("grad_accum", [1, 2])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_each_stage_partitions_what_zero_says(stage, grad_accum):
    """Stage 1 with one micro-batch reduce-scatters its gradient as stage 2 does: the
    equivalent of the all-reduce each device then slices, with half its bytes."""
    opt_state, grads, weights = PARTITIONED[stage]
    if stage == 1 and grad_accum == 1:
        grads = True
    plan = zf.ZeroPlan(zf.planning_mesh(8), stage=stage, traits=_traits(False))
    storage = {path_str(p): s for p, s in jax.tree_util.tree_leaves_with_path(
        plan.storage_shardings(SHAPES, padded=True))}
    compute = {path_str(p): s for p, s in jax.tree_util.tree_leaves_with_path(
        plan.compute_shardings(SHAPES, padded=True))}
    checked = 0
    for params, per_layer in itertools.product(("fp32", "bf16"), (None, "layers")):
        routes = routes_by_path(plan, params, per_layer, grad_accum)
        assert set(routes) == set(_PATHS)
        for path, route in routes.items():
            split = path in SPLIT_LEAVES
            assert _holds_shards(storage[path]) == (opt_state and split), path
            assert _holds_shards(compute[path]) == route.sharded == (weights and split), path
            assert route.sharded_grad == (grads and split), path
            want_reduce = ({Reduce.ON_USE, Reduce.AFTER} if route.sharded_grad
                           else {Reduce.ALL_REDUCE})
            assert route.reduce in want_reduce, path
            assert (route.fetch is Fetch.STORED) == (not route.sharded and not route.sharded_grad)
            checked += 1
    assert checked == 4 * len(_PATHS)


@pytest.mark.parametrize("options", [
    dict(hierarchical=True), dict(quantize_weights="int8"), dict(quantize_grads="int8"),
    dict(hierarchical=True, quantize_weights="int8", quantize_grads="int8")], ids=str)
@pytest.mark.parametrize("per_layer", [None, "layers"])
def test_zeropp_keeps_what_stage_3_shards_fetches_and_reduces(options, per_layer):
    """hpZ keeps a second copy within each host, qwZ gathers int8 weights, qgZ reduces int8
    gradients: each changes how stage 3's gathers and reduce-scatters move bytes, never which
    weights are shards, fetched on use, or reduce-scattered."""
    plan = zf.ZeroPlan(zf.planning_mesh(8), stage=3, hosts=2, traits=_traits(False), **options)
    routes = routes_by_path(plan, "bf16", per_layer)
    assert set(routes) == set(_PATHS)
    for path, route in routes.items():
        split = path in SPLIT_LEAVES
        assert route.sharded == split and route.sharded_grad == split, path
        assert (route.fetch is not Fetch.STORED) == split, path
        assert route.reduce is (Reduce.ON_USE if split else Reduce.ALL_REDUCE), path
        assert not route.stream, path


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("offload,update_on", OFFLOADS)
def test_offload_streams_only_the_stacks_compute_weights(stage, offload, update_on):
    """Offloading the optimizer moves no compute weight; offloading the parameters keeps the
    layer stack's bf16 compute weights in host memory and copies them in one layer at a time,
    except at stage 3 the stack split along its layer axis, which is gathered whole. Weights
    outside the stack are brought in whole and never stream."""
    plan = zf.ZeroPlan(zf.planning_mesh(8), stage=stage, offload=offload, update_on=update_on,
                       traits=_traits(False))
    for per_layer in (None, "layers"):
        routes = routes_by_path(plan, "bf16", per_layer)
        streamed = {path for path, route in routes.items() if route.stream}
        in_stack = {path for path in _PATHS if per_layer and path.startswith("layers/")}
        if offload != "optimizer+params":
            want = set()
        else:
            want = in_stack - (BY_LAYER_LEAVES if stage == 3 else set())
        assert streamed == want, per_layer
        for path in streamed:
            assert routes[path].fetch is Fetch.PER_LAYER, path


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_a_frozen_weight_has_no_gradient_and_its_trained_storage(stage):
    plan = zf.ZeroPlan(zf.planning_mesh(8), stage=stage, traits=_traits(False))
    trained = routes_by_path(plan, "bf16", "layers")
    for mask in MASKS[1:]:
        frozen = {path_str(p) for p, t in jax.tree_util.tree_leaves_with_path(mask) if not t}
        routes = routes_by_path(plan, "bf16", "layers", trainable=mask)
        assert frozen and {p for p, r in routes.items() if r.frozen} == frozen
        for path in frozen:
            assert routes[path].reduce is Reduce.NONE
            assert routes[path].sharded == trained[path].sharded == (stage == 3
                                                                      and path in SPLIT_LEAVES)


def test_every_row_is_reached():
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
    for params in ("fp32", "bf16"):
        fetches = {r.fetch for r in routes_by_path(plan, params).values()}
        assert fetches == {Fetch.ON_USE if widens and params == "bf16" else Fetch.STORED}
