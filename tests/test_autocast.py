"""zf.autocast read through its jaxprs: what runs in half precision, what stays fp32, where the
casts are, and that numbers and custom rules survive. Every jaxpr is read recursively (scan /
cond / while / remat / jit / shard_map / custom-call bodies)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.extend import core as jcore
from jax.sharding import PartitionSpec as P

import zeroflow as zf
from helpers import walk
from zeroflow.util.compat import scan_split

pytestmark = pytest.mark.fast

BF16, F32 = jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32)
RNG = np.random.default_rng(0)


def normal(*shape, scale=0.1):
    return jnp.asarray(RNG.normal(size=shape) * scale, jnp.float32)


def eqns(fn, *args, name=None):
    found = list(walk(jax.make_jaxpr(fn)(*args)))
    return [e for e in found if name is None or e.primitive.name == name]


def in_dtypes(eqn):
    return [jnp.dtype(v.aval.dtype) for v in eqn.invars if jnp.issubdtype(v.aval.dtype, jnp.floating)]


def out_dtypes(eqn):
    return [jnp.dtype(v.aval.dtype) for v in eqn.outvars if jnp.issubdtype(v.aval.dtype, jnp.floating)]


def mlp_loss(params, x, labels):
    """Two layers and a softmax cross-entropy, written in fp32 with no dtype anywhere."""
    h = jnp.tanh(x @ params["w1"] + params["b1"])
    logits = h @ params["w2"]
    logp = jax.nn.log_softmax(logits)
    return -jnp.mean(jnp.take_along_axis(logp, labels[:, None], axis=1))


def mlp_setup(n=256, d=32, classes=16):
    params = {"w1": normal(d, 64), "b1": jnp.zeros(64), "w2": normal(64, classes)}
    return params, normal(n, d, scale=1.0), jnp.asarray(RNG.integers(0, classes, n), jnp.int32)


# --------------------------------------------------------------------------- the lists
def test_forward_dots_are_half_and_exp_log_sums_stay_fp32():
    params, x, labels = mlp_setup()
    cast = zf.autocast(mlp_loss, dtype="bf16")
    dots = eqns(cast, params, x, labels, name="dot_general")
    assert len(dots) == 2
    assert all(in_dtypes(e) == [BF16, BF16] and out_dtypes(e) == [BF16] for e in dots)
    for name in ("exp", "log", "reduce_sum"):
        found = eqns(cast, params, x, labels, name=name)
        assert found and all(set(in_dtypes(e) + out_dtypes(e)) == {F32} for e in found), name
    # the same output dtype, and the value of the fp32 function to bf16 accuracy
    out = cast(params, x, labels)
    assert out.dtype == F32
    np.testing.assert_allclose(out, mlp_loss(params, x, labels), rtol=2e-2)
    # control: the unmodified function has no half precision at all
    plain = eqns(mlp_loss, params, x, labels, name="dot_general")
    assert len(plain) == 2 and all(in_dtypes(e) == [F32, F32] for e in plain)


def test_fp32_list_ops_stay_fp32_even_when_a_matmul_uses_them():
    def fn(w, x):
        h = x @ w
        sums = jnp.sum(h, axis=-1, keepdims=True)
        feats = jnp.exp(h) + jnp.log(jnp.abs(h) + 1.0) + jax.lax.rsqrt(h * h + 1.0) + h ** 2.5 + sums
        return jnp.tanh(feats @ w).mean()
    w, x = normal(32, 32), normal(256, 32).astype(BF16)
    found = eqns(zf.autocast(fn), w, x)
    for name in ("exp", "log", "rsqrt", "pow", "reduce_sum"):
        ops = [e for e in found if e.primitive.name == name]
        assert ops and all(set(in_dtypes(e) + out_dtypes(e)) == {F32} for e in ops), name
    # the h * h under rsqrt feeds fp32 ops only, so it runs in fp32 too (fp16 would overflow)
    squares = [e for e in found if e.primitive.name in ("mul", "square", "integer_pow")
               and e.outvars[0].aval.shape == (256, 32)]
    assert squares and all(out_dtypes(e) == [F32] for e in squares)
    dots = [e for e in found if e.primitive.name == "dot_general"]
    assert [in_dtypes(e) for e in dots] == [[BF16, BF16]] * 2
    np.testing.assert_allclose(zf.autocast(fn)(w, x), fn(w, x), rtol=2e-2)


def test_softmax_shift_runs_in_fp32_across_calls():
    params, x, labels = mlp_setup()
    found = eqns(zf.autocast(mlp_loss), params, x, labels)
    (exp,) = [e for e in found if e.primitive.name == "exp"]
    (shift,) = [e for e in found if e.outvars[0] is exp.invars[0]]  # logits - max, inside jit
    assert shift.primitive.name == "sub" and set(in_dtypes(shift)) == {F32}


def test_backward_matmuls_are_half_and_gradients_keep_their_dtype():
    params, x, labels = mlp_setup()
    grad = jax.grad(zf.autocast(mlp_loss))
    dots = eqns(grad, params, x, labels, name="dot_general")
    assert len(dots) >= 5  # 2 forward + 2 per layer backward (the input's grad of layer 1 is unused)
    assert all(in_dtypes(e) == [BF16, BF16] for e in dots)
    g, ref = grad(params, x, labels), jax.grad(mlp_loss)(params, x, labels)
    for k in params:
        assert g[k].dtype == F32
        np.testing.assert_allclose(g[k], ref[k], atol=2e-2 * float(jnp.abs(ref[k]).max()))


def test_fp16_and_bad_dtype():
    params, x, labels = mlp_setup()
    dots = eqns(zf.autocast(mlp_loss, dtype="fp16"), params, x, labels, name="dot_general")
    assert len(dots) == 2 and all(in_dtypes(e) == [jnp.dtype(jnp.float16)] * 2 for e in dots)
    with pytest.raises(ValueError, match=r"autocast dtype must be one of \['bf16', 'fp16', 'fp8'\], got 'fp4'"):
        zf.autocast(mlp_loss, dtype="fp4")


# --------------------------------------------------------------------------- the cost model
VOCAB, WIDTH = 50_000, 16


def tied_lm(table, tokens):
    x = jnp.take(table, tokens, axis=0)  # embedding lookup
    x = jnp.tanh(x)
    logits = x @ table.T  # tied output projection
    return jax.nn.logsumexp(logits, axis=-1).mean()


def _whole_table_casts(jaxpr_eqns):
    """Casts of an array as big as the table (the table itself or its transpose)."""
    return [e for e in jaxpr_eqns if e.primitive.name == "convert_element_type"
            and np.prod(e.invars[0].aval.shape) == VOCAB * WIDTH]


def test_embedding_table_is_never_cast_whole():
    table = normal(VOCAB, WIDTH)
    tokens = jnp.asarray(RNG.integers(0, VOCAB, (2, 4)), jnp.int32)
    for fn in (zf.autocast(tied_lm), jax.grad(zf.autocast(tied_lm))):
        assert not _whole_table_casts(eqns(fn, table, tokens))
    gathers = eqns(zf.autocast(tied_lm), table, tokens, name="gather")
    assert gathers and all(in_dtypes(e) == [F32] for e in gathers)
    # control: without the cost model the head matmul casts the whole table every step
    forced = zf.autocast(tied_lm, policy=zf.AutocastPolicy(cost_model=False))
    assert len(_whole_table_casts(eqns(forced, table, tokens))) == 1


def _head_is_low(n_tokens):
    def head(x, table):
        return (x @ table.T).sum()
    x = jax.ShapeDtypeStruct((n_tokens, WIDTH), jnp.bfloat16)
    table = jax.ShapeDtypeStruct((VOCAB, WIDTH), jnp.float32)
    (dot,) = zf.autocast_report(head, x, table).find("dot_general")
    return dot.decision == "low"


def test_cost_model_decision_follows_the_bytes_formula():
    # Training bytes of x[N, D] (already half) @ table[V, D].T: half precision saves 2 bytes per
    # element of x, table and result in each of 3 matmuls (forward and two backward), and the
    # fp32 version would cast x up and its gradient down (12 bytes per element); converting
    # costs casting the table down and its gradient up (12 bytes per element).
    def worth(n):
        saved = 3 * 2 * (n * WIDTH + VOCAB * WIDTH + n * VOCAB) + 12 * n * WIDTH
        return saved >= 12 * VOCAB * WIDTH
    threshold = next(n for n in range(1, 64) if worth(n))
    assert 2 < threshold < 60
    assert not _head_is_low(threshold - 1)
    assert _head_is_low(threshold)


# --------------------------------------------------------------------------- casts
def test_one_cast_per_weight_and_opposite_casts_cancel():
    def fn(w, x):
        a = x @ w
        b = (a.astype(jnp.float32) * 2.0) @ w.T  # explicit upcast of a half value, then a dot
        return jnp.sum(b @ w) + jnp.sum(x @ w)
    w, x = normal(32, 32), normal(64, 32)
    closed = jax.make_jaxpr(zf.autocast(fn))(w, x)
    w_var = closed.jaxpr.invars[0]
    casts = [e for e in walk(closed) if e.primitive.name == "convert_element_type"]
    assert len([e for e in casts if e.invars[0] is w_var]) == 1  # w used by 4 dots: one cast
    # ... and w.T reuses that cast instead of casting the weight again
    assert len([e for e in casts if e.invars[0].aval.shape == w.shape]) == 1
    # a.astype(f32) feeds only a half op: no bf16 -> f32 -> bf16 round trip is emitted
    made_by = {e.outvars[0]: e for e in casts}
    assert not [e for e in casts if out_dtypes(e) == [BF16] and e.invars[0] in made_by
                and in_dtypes(made_by[e.invars[0]]) == [BF16]]
    # the literal 2.0 became a bf16 literal, not a cast
    muls = [e for e in walk(closed) if e.primitive.name == "mul"]
    assert any(isinstance(v, jcore.Literal) and jnp.dtype(v.aval.dtype) == BF16
               for e in muls for v in e.invars)
    assert not any(isinstance(e.invars[0], jcore.Literal) for e in casts)
    grad_closed = jax.make_jaxpr(jax.grad(zf.autocast(fn)))(w, x)
    w_var = grad_closed.jaxpr.invars[0]
    assert len([e for e in walk(grad_closed) if e.primitive.name == "convert_element_type"
                and e.invars[0] is w_var]) == 1


# --------------------------------------------------------------------------- control flow
def layers_fn(w_stack, w_in, x):
    """A scanned stack of layers with a low carry, an fp32 accumulator carry, and a
    loop-invariant weight used inside the body. ``x`` comes in bf16, as data often does."""
    h0 = x @ w_in

    def body(carry, w):
        h, acc = carry
        h = jnp.tanh(h @ w + h @ w_in)
        return (h, acc + jnp.exp(h).sum()), h.mean()

    (h, acc), means = lax.scan(body, (h0, jnp.zeros(())), w_stack)
    return h.sum() + acc + means.sum()


def test_scan_carries_are_stable_and_invariant_weights_are_cast_outside():
    w_stack, w_in, x = normal(3, 32, 32), normal(32, 32), normal(128, 32).astype(BF16)
    closed = jax.make_jaxpr(zf.autocast(layers_fn))(w_stack, w_in, x)
    (scan,) = [e for e in closed.jaxpr.eqns if e.primitive.name == "scan"]
    body = scan.params["jaxpr"].jaxpr
    n, _ = scan_split(scan.params)  # jax 0.11 has no num_consts
    carry_in = [v.aval.dtype for v in body.invars[n:n + 2]]
    carry_out = [v.aval.dtype for v in body.outvars[:2]]
    assert carry_in == carry_out == [BF16, F32]  # h stays half, the exp accumulator fp32
    body_dots = [e for e in walk(body) if e.primitive.name == "dot_general"]
    assert len(body_dots) == 2 and all(in_dtypes(e) == [BF16, BF16] for e in body_dots)
    # w_in is cast once, outside the loop, and reused inside it
    w_in_var = closed.jaxpr.invars[1]
    assert len([e for e in walk(closed) if e.primitive.name == "convert_element_type"
                and e.invars[0] is w_in_var]) == 1
    assert not [e for e in walk(body) if e.primitive.name == "convert_element_type"
                and e.invars[0] in body.invars[:n]]
    got = zf.autocast(layers_fn)(w_stack, w_in, x)
    np.testing.assert_allclose(got, layers_fn(w_stack, w_in, x), rtol=2e-2)
    g, ref = jax.grad(zf.autocast(layers_fn))(w_stack, w_in, x), jax.grad(layers_fn)(w_stack, w_in, x)
    assert g.dtype == F32
    np.testing.assert_allclose(g, ref, atol=2e-2 * float(jnp.abs(ref).max()))


def control_flow_fn(w, x):
    h = x @ w
    h = lax.cond(h.sum() > 0, lambda a: jnp.tanh(a @ w), lambda a: a * 0.5, h)
    h = lax.fori_loop(0, 2, lambda i, a: jnp.tanh(a @ w), h)  # a scan: static trip count
    h = lax.while_loop(lambda c: c[0] < 2, lambda c: (c[0] + 1, c[1] * 0.9), (0, h))[1]
    h = jax.checkpoint(lambda a: jnp.sin(a @ w))(h)
    h = jax.jit(lambda a: a @ w.T)(h)
    return jnp.sum(h * h)


def test_cond_while_remat_jit():
    w, x = normal(32, 32, scale=0.3), normal(128, 32, scale=1.0).astype(BF16)
    cast = zf.autocast(control_flow_fn)
    found = eqns(cast, w, x)
    kinds = {e.primitive.name for e in found}
    assert {"cond", "while", "scan", "remat2"} <= kinds
    dots = [e for e in found if e.primitive.name == "dot_general"]
    assert len(dots) == 5 and all(in_dtypes(e) == [BF16, BF16] for e in dots)
    np.testing.assert_allclose(cast(w, x), control_flow_fn(w, x), rtol=3e-2)


def test_inside_jit_vmap_and_shard_map():
    params, x, labels = mlp_setup(n=64)
    cast = zf.autocast(mlp_loss)
    ref = jax.vmap(mlp_loss, in_axes=(None, 0, 0))(params, x.reshape(8, 8, -1), labels.reshape(8, 8))
    got = jax.jit(jax.vmap(cast, in_axes=(None, 0, 0)))(params, x.reshape(8, 8, -1), labels.reshape(8, 8))
    np.testing.assert_allclose(got, ref, rtol=2e-2)

    # called inside remat and inside a scan body
    g = jax.grad(jax.checkpoint(cast))(params, x, labels)
    np.testing.assert_allclose(g["w2"], jax.grad(mlp_loss)(params, x, labels)["w2"], atol=3e-2 * float(
        jnp.abs(g["w2"]).max()))
    total, _ = lax.scan(lambda c, xy: (c + cast(params, *xy), None), jnp.zeros(()),
                        (x.reshape(4, 16, -1), labels.reshape(4, 16)))
    ref_total = sum(mlp_loss(params, a, b) for a, b in zip(x.reshape(4, 16, -1), labels.reshape(4, 16)))
    np.testing.assert_allclose(total, ref_total, rtol=2e-2)

    mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Explicit,))

    def per_device(params, x, labels):
        # replicated params: jax sums their per-device gradients over "data" itself
        return jax.grad(cast)(params, x, labels)

    sharded = jax.sharding.NamedSharding(mesh, P("data"))
    step = jax.jit(jax.shard_map(per_device, mesh=mesh, in_specs=(P(), P("data"), P("data")),
                                 out_specs=P()))
    g = step(params, jax.device_put(x, sharded), jax.device_put(labels, sharded))
    ref = sum(jax.grad(mlp_loss)(params, xs, ys)["w1"]
              for xs, ys in zip(x.reshape(8, 8, -1), labels.reshape(8, 8)))
    np.testing.assert_allclose(g["w1"], ref, atol=3e-2 * float(jnp.abs(ref).max()))

    def with_inner_shard_map(w, x):  # and a shard_map inside the autocast function
        inner = jax.shard_map(lambda a: jax.lax.psum((a @ w).sum(), "data"), mesh=mesh,
                              in_specs=P("data"), out_specs=P())
        return inner(x)
    x_sharded = jax.device_put(normal(64, 32), sharded)
    w = normal(32, 32)
    found = eqns(zf.autocast(with_inner_shard_map, policy=zf.AutocastPolicy(cost_model=False)), w, x_sharded)
    assert [in_dtypes(e) for e in found if e.primitive.name == "dot_general"] == [[BF16, BF16]]
    np.testing.assert_allclose(zf.autocast(with_inner_shard_map)(w, x_sharded),
                               with_inner_shard_map(w, x_sharded), rtol=2e-2)


# --------------------------------------------------------------------------- custom rules
def test_custom_jvp_rules_are_intact():
    def fn(w, x):
        return jnp.sum(jax.nn.relu(x @ w) * 3.0)
    w = jnp.eye(32)
    x = jnp.zeros((64, 32), BF16).at[0].set(1.0)  # many exact zeros going into relu
    cast = zf.autocast(fn)
    (call,) = eqns(cast, w, x, name="custom_jvp_call")
    assert in_dtypes(call) == [F32]  # declared dtype kept
    g = jax.grad(cast, 1)(w, x)
    # relu's rule: gradient 0 at 0 (differentiating max(x, 0) would give 1.5 here)
    np.testing.assert_array_equal(g[1:], 0.0)
    np.testing.assert_allclose(g[0], 3.0)
    # opted in: the body runs in half precision, the rule still holds
    opted = zf.autocast(fn, policy=zf.AutocastPolicy(custom_calls=("relu",)))
    (call,) = eqns(opted, w, x, name="custom_jvp_call")
    assert in_dtypes(call) == [BF16]
    np.testing.assert_array_equal(jax.grad(opted, 1)(w, x)[1:], 0.0)


def test_custom_vjp_and_logsumexp():
    @jax.custom_vjp
    def straight_through_round(a):
        return jnp.round(a)
    straight_through_round.defvjp(lambda a: (jnp.round(a), None), lambda _, g: (g,))

    def fn(w, x):
        return jnp.sum(straight_through_round(x @ w) * 2.0) + jax.nn.logsumexp(x @ w)
    w, x = normal(32, 32), normal(64, 32, scale=3.0)
    cast = zf.autocast(fn)
    (call,) = eqns(cast, w, x, name="custom_vjp_call")
    assert in_dtypes(call) == [F32] and out_dtypes(call) == [F32]
    g = jax.grad(cast, 0)(w, x)
    # reference by hand: d/dw of sum(2 * ST(xw)) = x^T 2, of logsumexp(xw) = x^T softmax(xw)
    xw = np.asarray(x, np.float64) @ np.asarray(w, np.float64)
    soft = np.exp(xw - xw.max()) / np.exp(xw - xw.max()).sum()
    ref = np.asarray(x, np.float64).T @ (2.0 + soft)
    np.testing.assert_allclose(g, ref, atol=1e-2 * np.abs(ref).max())  # a bf16 backward matmul
    exp_log = [e for e in eqns(cast, w, x) if e.primitive.name in ("exp", "log")]
    assert {e.primitive.name for e in exp_log} == {"exp", "log"}  # logsumexp's
    assert all(set(in_dtypes(e)) == {F32} for e in exp_log)
    # opted in: the rounding runs in bf16, the straight-through gradient is still the rule's
    opted = zf.autocast(fn, policy=zf.AutocastPolicy(custom_calls=("straight_through_round",)))
    (call,) = eqns(opted, w, x, name="custom_vjp_call")
    assert in_dtypes(call) == [BF16]
    np.testing.assert_allclose(jax.grad(opted, 0)(w, x), ref, atol=1e-2 * np.abs(ref).max())


def test_fp16_masked_softmax_stays_finite():
    def masked_softmax(w, x):
        scores = x @ w
        keep = jnp.arange(scores.shape[0])[:, None] % 4 != 0  # every 4th row fully masked
        return jax.nn.softmax(jnp.where(keep, scores, -1e9), axis=-1)
    w, x = normal(32, 32), normal(64, 32, scale=1.0).astype(jnp.float16)
    got = zf.autocast(masked_softmax, dtype="fp16", policy=zf.AutocastPolicy(cost_model=False))(w, x)
    # the mask only feeds the softmax, so it is applied in fp32: -1e9 never becomes fp16's -inf
    # (a fully masked row would be -inf - -inf = NaN)
    assert bool(jnp.isfinite(got).all())
    np.testing.assert_allclose(got, masked_softmax(w, x), atol=1e-2)


def test_literals_clip_to_the_half_range():
    from zeroflow.autocast.interpret import literal_as
    assert float(literal_as(-1e9, jnp.float16)) == -65504.0  # not -inf
    assert float(literal_as(np.inf, jnp.float16)) == np.inf  # a real infinity stays one
    assert literal_as(2.5, jnp.bfloat16).dtype == BF16


def test_pallas_call_keeps_its_declared_dtypes():
    from jax.experimental import pallas as pl

    def double(x_ref, o_ref):
        o_ref[...] = x_ref[...] * 2.0

    def terms(w, x):
        h = x @ w
        doubled = pl.pallas_call(double, out_shape=jax.ShapeDtypeStruct(h.shape, h.dtype),
                                 interpret=True)(h)
        return jnp.tanh(doubled @ w)

    def fn(w, x):
        return terms(w, x).sum()
    rng = np.random.default_rng(7)  # its own data, whichever tests ran before in this process
    w = jnp.asarray(rng.normal(size=(32, 32)) * 0.1, jnp.float32)
    x = jnp.asarray(rng.normal(size=(128, 32)) * 0.1, BF16)
    found = eqns(zf.autocast(fn), w, x)
    (call,) = [e for e in found if e.primitive.name == "pallas_call"]
    assert in_dtypes(call) == out_dtypes(call) == [F32]
    assert [in_dtypes(e) for e in found if e.primitive.name == "dot_general"] == [[BF16, BF16]] * 2
    # Element by element, not the sum: the 4096 terms (about +-0.06 each) cancel to a sum near 1,
    # so the sum's relative error is the rounding of all of them over a small total. Each term
    # is two bf16 matmuls of 32 products (relative rounding about 3 x 2**-8 of its size,
    # 2.5e-4 here), held to 2% or 2e-3.
    np.testing.assert_allclose(zf.autocast(terms)(w, x), terms(w, x), rtol=2e-2, atol=2e-3)


def test_bf16_weights_in_an_fp32_model_stay_half():
    """Weights stored in bf16 and a model that adds fp32 positional features: jnp promotes
    every matmul after that back to fp32; autocast keeps them in bf16 and casts no weight."""
    def fn(params, tokens):
        x = jnp.take(params["embed"], tokens, axis=0)
        angles = jnp.arange(tokens.shape[-1], dtype=jnp.float32)[:, None] / 100.0
        x = x + jnp.sin(angles + jnp.arange(x.shape[-1], dtype=jnp.float32))  # now fp32
        h = jnp.tanh(x @ params["w1"])
        return jnp.mean((h @ params["w2"]) ** 2)
    params = {"embed": normal(64, 32).astype(BF16), "w1": normal(32, 64).astype(BF16),
              "w2": normal(64, 32).astype(BF16)}
    tokens = jnp.asarray(RNG.integers(0, 64, (8, 32)), jnp.int32)
    plain = eqns(fn, params, tokens, name="dot_general")
    assert len(plain) == 2 and all(F32 in in_dtypes(e) for e in plain)  # control: jnp made them fp32
    closed = jax.make_jaxpr(zf.autocast(fn))(params, tokens)
    dots = [e for e in walk(closed) if e.primitive.name == "dot_general"]
    assert [in_dtypes(e) for e in dots] == [[BF16, BF16]] * 2
    weights = set(closed.jaxpr.invars[:3])
    assert not [e for e in walk(closed) if e.primitive.name == "convert_element_type"
                and e.invars[0] in weights]  # the weights' own bf16 copies are used
    np.testing.assert_allclose(zf.autocast(fn)(params, tokens), fn(params, tokens), rtol=3e-2)


# --------------------------------------------------------------------------- arguments
def test_any_arguments_keys_ints_and_callables_pass_through():
    def fn(params, batch, transform, *, rng, note="x", scale=2.0, nothing=None):
        assert note == "x" and nothing is None and callable(transform)
        noise = jax.random.normal(rng, batch["x"].shape)
        h = transform(batch["x"] + 0.01 * noise) @ params["w"]
        return jnp.mean(h * scale) + jnp.sum(batch["ids"]).astype(jnp.float32), {"ids": batch["ids"]}

    params = {"w": normal(32, 16)}
    batch = {"x": normal(128, 32), "ids": jnp.arange(8, dtype=jnp.int32)}
    key = jax.random.key(3)
    args = (params, batch, jnp.tanh)
    out, aux = zf.autocast(fn)(*args, rng=key, scale=2.0)
    ref, _ = fn(*args, rng=key)
    np.testing.assert_allclose(out, ref, rtol=2e-2)
    assert aux["ids"].dtype == jnp.int32
    found = eqns(lambda p, b, k: zf.autocast(fn)(p, b, jnp.tanh, rng=k), params, batch, key)
    assert not [e for e in found if e.primitive.name == "convert_element_type"
                and not jnp.issubdtype(e.invars[0].aval.dtype, jnp.floating)
                and jnp.issubdtype(e.outvars[0].aval.dtype, jnp.floating)
                and jnp.dtype(e.outvars[0].aval.dtype) == BF16]  # no int or key cast to half


# --------------------------------------------------------------------------- report and policy
def test_report_names_every_decision():
    params, x, labels = mlp_setup()
    report = zf.autocast_report(mlp_loss, params, x, labels, dtype="bf16")
    n_eqns = len(list(walk(jax.make_jaxpr(mlp_loss)(params, x, labels))))
    assert len(report.decisions) == n_eqns
    assert all(d.reason and d.decision for d in report.decisions)
    dots = report.find("dot_general")
    assert [d.decision for d in dots] == ["low", "low"] and all("cost model" in d.reason for d in dots)
    assert {d.decision for d in report.find("exp")} == {"fp32"}
    text = str(report)
    assert text.splitlines()[0].startswith(f"autocast bfloat16: {n_eqns} decisions")
    assert all(d.path in text for d in report.decisions)


def test_policy_overrides_scopes_and_primitives():
    def fn(w, x):
        with jax.named_scope("router"):
            r = x @ w
        h = jnp.tanh(x @ w)
        return jnp.sum(r) + jnp.sum(h)
    w, x = normal(32, 32), normal(128, 32)
    policy = zf.AutocastPolicy(fp32_scopes=("router",), fp32=("tanh",))
    found = eqns(zf.autocast(fn, policy=policy), w, x)
    dots = [e for e in found if e.primitive.name == "dot_general"]
    assert sorted(tuple(in_dtypes(e)) for e in dots) == [(BF16, BF16), (F32, F32)]
    tanhs = [e for e in found if e.primitive.name == "tanh"]
    assert len(tanhs) == 1 and in_dtypes(tanhs[0]) == [F32]
    # a low scope converts a dot the cost model keeps (tiny batch, big weight)
    big, one = normal(32, 4096), normal(1, 32)
    kept = eqns(zf.autocast(lambda w, x: (x @ w).sum()), big, one, name="dot_general")
    forced = eqns(zf.autocast(lambda w, x: (x @ w).sum(), policy=zf.AutocastPolicy(low_scopes=("head",))),
                  big, one, name="dot_general")
    assert in_dtypes(kept[0]) == [F32, F32]

    def scoped(w, x):
        with jax.named_scope("head"):
            return (x @ w).sum()
    forced = eqns(zf.autocast(scoped, policy=zf.AutocastPolicy(low_scopes=("head",))), big, one,
                  name="dot_general")
    assert in_dtypes(forced[0]) == [BF16, BF16]


@pytest.mark.parametrize("kwargs,message", [
    ({"low": ("dot",)}, "AutocastPolicy.low: unknown primitive 'dot'"),
    ({"low": ("exp",), "fp32": ("exp",)}, "primitive 'exp' is in both 'low' and 'fp32'"),
    ({"cost_model": "yes"}, "AutocastPolicy.cost_model must be True or False"),
    ({"fp32_scopes": (3,)}, "AutocastPolicy.fp32_scopes must hold non-empty strings"),
])
def test_bad_policy_is_one_clear_line(kwargs, message):
    with pytest.raises(ValueError, match=message):
        zf.AutocastPolicy(**kwargs)


# --------------------------------------------------------------------------- loss scaling
def sgd_step(params, x, labels, loss_scale, prec, *, marker: bool):
    if marker:
        (loss, grads), _, _ = zf.scaled_value_and_grad(mlp_loss, prec)(loss_scale, params, x, labels)
    else:
        loss, grads = jax.value_and_grad(mlp_loss)(params, x, labels)
    with jax.named_scope("update"):
        return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads), loss


def test_unscaling_marker_keeps_the_update_fp32():
    params, x, labels = mlp_setup()
    prec = zf.Precision(loss_scale=128.0)

    def update_dtypes(marker):
        step = zf.autocast(lambda p, x, y, s: sgd_step(p, x, y, s, prec, marker=marker))
        found = eqns(step, params, x, labels, prec.init_loss_scale())
        return {d for e in found if "update" in str(e.source_info.name_stack)
                for d in in_dtypes(e) + out_dtypes(e)}
    assert update_dtypes(marker=True) == {F32}
    assert BF16 in update_dtypes(marker=False)  # control: the half gradients reach the update


def test_scaled_value_and_grad_rescues_fp16_gradients():
    def tiny_loss(w, x):
        return jnp.mean(x @ w) * 1e-4  # d/d(x @ w) = 3e-9: below fp16's smallest subnormal
    w, x = normal(32, 64), jnp.abs(normal(512, 32, scale=0.01))
    ref = jax.grad(tiny_loss)(w, x)
    unscaled = jax.grad(zf.autocast(tiny_loss, dtype="fp16"))(w, x)
    assert float(jnp.abs(unscaled).max()) == 0.0  # flushed to zero
    prec = zf.Precision(loss_scale="dynamic", autocast="fp16", growth_interval=2)
    grad_fn = jax.jit(zf.scaled_value_and_grad(tiny_loss, prec))
    state = prec.init_loss_scale()
    (loss, g), state, finite = grad_fn(state, w, x)
    assert bool(finite) and g.dtype == F32
    np.testing.assert_allclose(g, ref, rtol=2e-2)
    # fp16's error is relative to the terms of the mean, not to their (cancelling) sum: with the
    # shared RNG the data depends on which tests ran first, and a sum near 0 failed rtol alone
    np.testing.assert_allclose(loss, tiny_loss(w, x), rtol=2e-2,
                               atol=1e-3 * float(jnp.mean(jnp.abs(x @ w))) * 1e-4)
    assert float(loss) != 0.0  # not flushed
    # overflow: a huge scale gives inf, the step reports it and the scale halves
    big = state.replace(scale=jnp.asarray(2.0 ** 100, jnp.float32), good_steps=jnp.asarray(1))
    _, after, finite = grad_fn(big, w * 1e30, x)
    assert not bool(finite) and float(after.scale) == 2.0 ** 99 and int(after.good_steps) == 0
    # clean steps: the scale doubles after growth_interval of them
    _, s1, _ = grad_fn(state, w, x)
    _, s2, _ = grad_fn(s1, w, x)
    assert float(s2.scale) == 2 * float(state.scale)


@pytest.mark.parametrize("kwargs,message", [
    ({"autocast": "fp4"}, r"unknown autocast 'fp4'; choose one of \['none', 'bf16', 'fp16', 'fp8'\]"),
    ({"autocast": "fp16"}, "autocast='fp16' needs loss scaling"),
    ({"params": "bf16", "autocast": "fp16", "loss_scale": "dynamic"}, "mixes two half types"),
])
def test_precision_validates_autocast(kwargs, message):
    with pytest.raises(ValueError, match=message):
        zf.Precision(**kwargs)


def test_trainer_config_key():
    from zeroflow.config.io import ConfigError, load_config
    assert load_config(None, ["precision.autocast=bf16"]).precision.autocast == "bf16"
    with pytest.raises(ConfigError, match="precision.autocast"):
        load_config(None, ["precision.autocast=int8"])
