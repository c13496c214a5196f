"""zeroflow.engine.grads.gather_on_use: weights fetched just before each use, in a loss zeroflow never
saw, give the loss and gradients of plain jax on the whole weights."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import zeroflow as zf
from zeroflow.engine.grads import gather_on_use
from zeroflow.engine.grads.collectives import varying
from zeroflow.engine.grads.sources import Stage3Collectives
from zeroflow.backend.mesh import DATA

pytestmark = pytest.mark.fast

N = 8
PLAIN = Stage3Collectives(reduce_dtype=jnp.float32)  # stage 3 without ZeRO++, summing in fp32


def tricky_loss(w, batch):
    """Weights used twice (tied), through a transpose and a reshape, inside a nested jit and a
    remat, against a constant, as a gather table, and as a broadcast bias."""
    table, proj, bias, scale = w["table"], w["proj"], w["bias"], w["scale"]
    x = jnp.take(table, batch["ids"], axis=0)                       # [b, s, d]
    x = x * (scale * jnp.arange(1, 17, dtype=jnp.float32))          # weight x constant

    @jax.jit
    def layer(x, proj, bias):
        return jnp.tanh(x @ proj.T.reshape(16, 16) + bias)
    x = layer(x, proj, bias)
    x = jax.checkpoint(lambda x, p: jax.nn.gelu(x @ p))(x, proj)
    logits = x @ table.T                                            # tied with the lookup
    return jnp.mean(jax.nn.logsumexp(logits, axis=-1)) + 0.01 * jnp.sum(proj ** 2)


def _weights(seed=0):
    k = jax.random.split(jax.random.key(seed), 4)
    return {"table": jax.random.normal(k[0], (40, 16)), "proj": jax.random.normal(k[1], (16, 16)) / 4,
            "bias": jax.random.normal(k[2], (16,)), "scale": jax.random.normal(k[3], (16,))}


def _batch():
    return {"ids": np.random.default_rng(0).integers(0, 40, size=(N * 2, 5)).astype(np.int32)}


def _sharded_grads(weights, batch):
    """Loss and fp32 gradient shards through gather_on_use inside shard_map over data, each
    leaf split along dim 0 (the engine's stage-3 layout)."""
    mesh = zf.make_mesh(data=N)
    sources = [gather_on_use.Sharded(0, jnp.float32, collectives=PLAIN) for _ in jax.tree.leaves(weights)]
    treedef = jax.tree.structure(weights)

    def per_device(shards, batch):
        stand_ins = [varying(jnp.zeros(s.shape, jnp.float32)) for s in shards]

        def loss(stand_ins):
            stored = [(varying(s), z) for s, z in zip(shards, stand_ins)]
            out = gather_on_use.call(lambda ws, b: tricky_loss(jax.tree.unflatten(treedef, ws), b),
                                     stored, sources, batch)
            return out
        value, grads = jax.value_and_grad(loss)(stand_ins)
        return jax.lax.pmean(value, DATA), grads

    shards = jax.tree.leaves(weights)
    f = jax.shard_map(per_device, mesh=mesh, in_specs=([P(DATA)] * len(shards), P(DATA)),
                      out_specs=(P(), [P(DATA)] * len(shards)), axis_names={DATA})
    value, grads = jax.jit(f)(shards, batch)
    return value, jax.tree.unflatten(treedef, grads)


def test_loss_and_gradients_equal_plain_jax():
    weights, batch = _weights(), _batch()
    value, grads = _sharded_grads(weights, batch)
    # Reference: the mean over devices of each device's loss on its rows, on whole weights.
    per_device = lambda w: jnp.mean(jnp.stack([  # noqa: E731
        tricky_loss(w, {"ids": batch["ids"][i * 2:(i + 1) * 2]}) for i in range(N)]))
    want_value, want_grads = jax.value_and_grad(per_device)(weights)
    np.testing.assert_allclose(value, want_value, rtol=1e-5)
    for name in weights:  # the engine's gradient is the sum over devices
        np.testing.assert_allclose(grads[name], want_grads[name] * N, rtol=2e-4, atol=1e-5,
                                   err_msg=name)


def _gathers_and_producers(jaxpr):
    """``(all_gather equation, the equation that made its operand)`` pairs, in every sub-jaxpr."""
    made = {}
    pairs = []
    for eqn in jaxpr.eqns:
        for var in eqn.outvars:
            made[var] = eqn
        if eqn.primitive.name == "all_gather":
            producer = made.get(eqn.invars[0])
            while producer is not None and producer.primitive.name == "convert_element_type":
                producer = made.get(producer.invars[0])
            pairs.append((eqn, producer))
        for value in eqn.params.values():
            inner = getattr(value, "jaxpr", value)
            if hasattr(inner, "eqns"):
                pairs += _gathers_and_producers(inner)
    return pairs


def test_every_gather_waits_for_the_values_it_meets():
    """Each operation that meets data is one custom_vjp unit, and every all-gather (forward, and
    backward after differentiation) reads a shard passed through ``after``'s select: none can
    be hoisted to the start of the step."""
    weights, batch = _weights(), _batch()
    jaxpr = jax.make_jaxpr(_sharded_grads)(weights, batch)
    # Weight fetches gather a shard; an embedding's row lookup (zeroflow.engine.grads.row_lookup)
    # gathers the tokens and the rows' cotangents instead, data that exists when it runs.
    shards = {(w.shape[0] // N, *w.shape[1:]) for w in jax.tree.leaves(weights)}
    pairs = [(g, p) for g, p in _gathers_and_producers(jaxpr.jaxpr)
             if tuple(g.invars[0].aval.shape) in shards]
    # six weights used once each: a fetch in the forward pass and one in the backward pass
    assert len(pairs) >= 12, len(pairs)
    def is_select(eqn):  # jnp.where is select_n, or a jit of it named _where
        return eqn is not None and (eqn.primitive.name == "select_n"
                                    or "where" in str(eqn.params.get("name", "")))
    assert all(is_select(p) for _, p in pairs), [getattr(p, "primitive", None) for _, p in pairs]


def test_after_orders_without_changing_values():
    x = jnp.arange(6.0).reshape(2, 3)
    for anchor in (jnp.array([np.nan]), jnp.array([-np.inf, 1.0]), jnp.array([0], jnp.int32),
                   jnp.array([False])):
        np.testing.assert_array_equal(jax.jit(gather_on_use.after)(x, anchor), x)
    assert gather_on_use.after(x, []) is x  # nothing to wait for


@pytest.mark.parametrize("remat", [False, True])
def test_bf16_units_reduce_in_fp32(remat):
    """Half-precision weights are gathered in bf16 but their gradients are summed in fp32: one
    device's gradient of 256 and seven of 1 sum to 263, which bf16 cannot hold (its spacing
    there is 2)."""
    mesh = zf.make_mesh(data=N)

    def loss(w, b):
        f = (lambda w, b: jnp.sum(w * b)) if not remat else jax.checkpoint(lambda w, b: jnp.sum(w * b))
        return f(w, b)

    def per_device(shard, batch):
        def scaled(z):
            return gather_on_use.call(lambda ws, b: loss(ws[0], b), [(varying(shard), z)],
                                      [gather_on_use.Sharded(0, jnp.bfloat16, collectives=PLAIN)], batch)
        return jax.grad(scaled)(varying(jnp.zeros(shard.shape, jnp.float32)))

    f = jax.shard_map(per_device, mesh=mesh, in_specs=(P(DATA), P(DATA)), out_specs=P(DATA),
                      axis_names={DATA})
    w = jnp.ones((N,), jnp.bfloat16)
    b = jnp.ones((N, N), jnp.bfloat16).at[0].set(256)  # device i's gradient is its batch row
    grads = jax.jit(f)(w, b)
    assert grads.dtype == jnp.float32
    np.testing.assert_array_equal(grads, np.full((N,), 256 + N - 1, np.float32))


@pytest.mark.parametrize("frozen", [False, True])
def test_row_lookup_moves_rows_not_the_table(frozen):
    """An embedding table split by rows is looked up where its rows are (row_lookup): the step
    gathers tokens and rows, never the table, and trains as plain optax does (fp32, so the sums
    are exact up to their order); a repeated token's rows add up in the table's gradient."""
    from helpers import walk
    vocab, width = 64, 8
    k = jax.random.split(jax.random.key(1), 2)
    params = {"table": jax.random.normal(k[0], (vocab, width)),
              "head": jax.random.normal(k[1], (width, 3)) / 4}
    ids = np.random.default_rng(1).integers(0, vocab, size=(N * 2, 6)).astype(np.int32)
    ids[:, 0] = 5  # one row read by every device
    batches = [{"ids": ids, "y": np.arange(N * 2 * 6).reshape(N * 2, 6) % 3}]

    def loss(p, b):
        logits = jnp.tanh(p["table"][b["ids"]]) @ p["head"]
        return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), b["y"][..., None], -1))

    plan, prec, tx = zf.ZeroPlan(zf.make_mesh(), stage=3), zf.Precision(), optax.sgd(0.5)
    trainable = {"table": not frozen, "head": True}
    state = zf.init_train_state(params, tx, plan, prec, trainable=trainable)
    step = zf.make_train_step(loss, tx, plan, prec)
    gathered = [tuple(e.outvars[0].aval.shape) for e in walk(step.trace(state, batches[0]).jaxpr)
                if e.primitive.name == "all_gather"]
    assert (vocab, width) not in gathered and gathered, gathered
    state, metrics = step(state, batches[0])

    def reference(table, head):
        return loss({"table": table, "head": head}, batches[0])
    want_loss, (d_table, d_head) = jax.value_and_grad(reference, argnums=(0, 1))(
        params["table"], params["head"])
    np.testing.assert_allclose(metrics["loss"], want_loss, rtol=1e-6)
    want_table = params["table"] if frozen else params["table"] - 0.5 * d_table
    np.testing.assert_allclose(state.params["table"], want_table, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(state.params["head"], params["head"] - 0.5 * d_head,
                               rtol=1e-5, atol=1e-6)


def test_a_wide_embedding_table_is_looked_up_where_its_rows_are():
    """A Flax embedding table with a small vocabulary is wider than tall (16 x 256 here, as
    256 x 2048 in configs/gpt-1b.yaml) but is looked up, not multiplied: it is split by rows
    and read through row_lookup (no all-gather of the table), while a head of the same shape
    is split by columns. Equal to plain SGD."""
    from helpers import walk
    vocab, width = 16, 256
    k = jax.random.split(jax.random.key(3), 3)
    params = {"embedding": jax.random.normal(k[0], (vocab, width)),
              "down": jax.random.normal(k[1], (width, vocab)) / 16,
              "head": jax.random.normal(k[2], (vocab, width)) / 4}
    batch = {"ids": (np.arange(N * 2 * 4).reshape(N * 2, 4) * 7 % vocab).astype(np.int32)}

    def loss(p, b):
        h = jnp.tanh(p["embedding"][b["ids"]]) @ p["down"]  # (rows, 4, vocab)
        return jnp.mean(jnp.tanh(h @ p["head"]) ** 2)

    plan, prec, tx = zf.ZeroPlan(zf.make_mesh(), stage=3), zf.Precision(), optax.sgd(0.5)
    layouts = plan.layouts(params)
    assert (layouts["embedding"].zero_dim, layouts["head"].zero_dim) == (0, 1)
    state = zf.init_train_state(params, tx, plan, prec)
    step = zf.make_train_step(loss, tx, plan, prec)
    gathered = [tuple(e.outvars[0].aval.shape) for e in walk(step.trace(state, batch).jaxpr)
                if e.primitive.name == "all_gather"]
    assert (vocab, width) not in gathered, gathered
    state, metrics = step(state, batch)
    want_loss, grads = jax.value_and_grad(loss)(params, batch)
    np.testing.assert_allclose(metrics["loss"], want_loss, rtol=1e-5)
    np.testing.assert_allclose(state.params["embedding"],
                               params["embedding"] - 0.5 * grads["embedding"], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("frozen", [False, True])
def test_wide_head_is_multiplied_where_its_columns_are(frozen):
    """A vocabulary-shaped weight (at least ``plan.WIDE`` times wider than tall) is split by
    columns, and ``x @ W`` is computed where the columns are (split_columns): activations and
    outputs move, the weight is never gathered; its gradient is complete on each device (no
    reduce-scatter of it). Padded columns (1001 over 8 devices) included. Equal to plain SGD."""
    from helpers import walk
    width, vocab = 7, 1001
    k = jax.random.split(jax.random.key(2), 3)
    params = {"w": jax.random.normal(k[0], (16, width)) / 4,
              "head": jax.random.normal(k[1], (width, vocab)) / 4}
    batch = {"x": np.asarray(jax.random.normal(k[2], (N * 2, 16))),
             "y": (np.arange(N * 2) * 37) % vocab}

    def loss(p, b):
        logits = (jnp.tanh(b["x"] @ p["w"]) @ p["head"]).astype(jnp.float32)
        return optax.softmax_cross_entropy_with_integer_labels(logits, b["y"]).mean()

    plan, prec, tx = zf.ZeroPlan(zf.make_mesh(), stage=3), zf.Precision(), optax.sgd(0.5)
    assert plan.layouts(params)["head"].zero_dim == 1
    state = zf.init_train_state(params, tx, plan, prec, trainable={"w": True, "head": not frozen})
    step = zf.make_train_step(loss, tx, plan, prec)
    eqns = list(walk(step.trace(state, batch).jaxpr))
    gathered = [tuple(e.outvars[0].aval.shape) for e in eqns if e.primitive.name == "all_gather"]
    assert not any(s[-1] >= vocab for s in gathered), gathered
    assert any(e.primitive.name == "all_to_all" for e in eqns)
    state, metrics = step(state, batch)
    want_loss, (d_w, d_head) = jax.value_and_grad(
        lambda w, h: loss({"w": w, "head": h}, batch), argnums=(0, 1))(params["w"], params["head"])
    np.testing.assert_allclose(metrics["loss"], want_loss, rtol=1e-6)
    want_head = params["head"] if frozen else params["head"] - 0.5 * d_head
    np.testing.assert_allclose(state.params["head"], want_head, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(state.params["w"], params["w"] - 0.5 * d_w, rtol=1e-5, atol=1e-6)
