"""FP8 matmuls (``zf.autocast(fn, dtype="fp8")``, ``zeroflow/autocast/fp8.py``) on XLA:CPU, which
computes with the float8 types: each product against a NumPy reference that quantizes the same
way (written here from the recipe, with ml_dtypes' float8 types), the error against the exact
product within the format's bound, the gradients of a small model against bf16, the choices of
the cost model, loss scaling and skipped steps through the engine, and the bad-input lines."""
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest

import zeroflow as zf
from helpers import walk
from zeroflow.autocast import fp8

pytestmark = pytest.mark.fast

E4M3_MAX, E5M2_MAX = 448.0, 57344.0
E4M3_U = 2.0**-4  # unit roundoff: 3 mantissa bits
E4M3_TINY = 2.0**-9  # smallest subnormal


def np_quantize(x, fmt, top, axes=None):
    """The recipe in NumPy: scale = amax / largest finite (1 for an all-zero slice), x / scale
    clipped, rounded to ``fmt``; returns the rounded values (as float64) and the scale."""
    amax = np.max(np.abs(x), axis=axes, keepdims=axes is not None).astype(np.float32)
    scale = np.where(amax > 0, amax / np.float32(top), np.float32(1.0)).astype(np.float32)
    q = np.clip(x.astype(np.float32) / scale, -top, top).astype(fmt).astype(np.float64)
    return q, scale.astype(np.float64)


def np_fp8_matmul(a, b, rowwise=False):
    """[m, k] @ [k, n] as the recipe computes it: e4m3 operands, scales multiplied back."""
    qa, sa = np_quantize(a, ml_dtypes.float8_e4m3fn, E4M3_MAX, axes=(1,) if rowwise else None)
    qb, sb = np_quantize(b, ml_dtypes.float8_e4m3fn, E4M3_MAX, axes=(0,) if rowwise else None)
    return (qa @ qb) * sa * sb, (qa, sa, qb, sb)


def operands(m=48, k=64, n=32, seed=0, outlier_row=True):
    rng = np.random.default_rng(seed)
    a = rng.normal(size=(m, k)).astype(np.float32)
    b = rng.normal(size=(k, n)).astype(np.float32) * 0.1
    if outlier_row:
        a[3] *= 3e4  # one loud row: one scale per tensor pushes the others into subnormals
    return a, b


DIMS_2D = (((1,), (0,)), ((), ()))


@pytest.mark.parametrize("scaling", ["tensor", "row"])
def test_forward_matches_a_reference_that_quantizes_the_same_way(scaling):
    a, b = operands()
    got = np.asarray(fp8.scaled_dot(jnp.asarray(a), jnp.asarray(b), DIMS_2D, jnp.float32, scaling))
    want, _ = np_fp8_matmul(a, b, rowwise=scaling == "row")
    # same quantized operands; only the fp32 accumulation order differs
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


@pytest.mark.parametrize("scaling", ["tensor", "row"])
def test_error_against_the_exact_product_is_within_e4m3s_bound(scaling):
    a, b = operands()
    exact = a.astype(np.float64) @ b.astype(np.float64)
    got = np.asarray(fp8.scaled_dot(jnp.asarray(a), jnp.asarray(b), DIMS_2D, jnp.float32, scaling))
    _, (_, sa, _, sb) = np_fp8_matmul(a, b, rowwise=scaling == "row")
    # each operand element is off by at most u |x| (normal range) or half a subnormal step
    # times its scale; the product of two such errors, summed over k
    err_a = E4M3_U * np.abs(a) + 0.5 * E4M3_TINY * sa
    err_b = E4M3_U * np.abs(b) + 0.5 * E4M3_TINY * sb
    bound = err_a @ np.abs(b) + np.abs(a) @ err_b + err_a @ err_b
    bound += 1e-6 * (np.abs(a) @ np.abs(b))  # fp32 accumulation
    assert np.all(np.abs(got - exact) <= bound)
    if scaling == "row":  # the loud row no longer costs the quiet rows their precision
        tensor = np.asarray(fp8.scaled_dot(a, b, DIMS_2D, jnp.float32, "tensor"))
        quiet = np.arange(len(a)) != 3
        assert np.abs(got - exact)[quiet].mean() < 0.5 * np.abs(tensor - exact)[quiet].mean()


def test_backward_quantizes_the_gradient_to_e5m2_and_reuses_the_e4m3_operands():
    a, b = operands(outlier_row=False)
    g = np.random.default_rng(1).normal(size=(a.shape[0], b.shape[1])).astype(np.float32)
    _, vjp = jax.vjp(lambda x, y: fp8.scaled_dot(x, y, DIMS_2D, jnp.float32, "tensor"), a, b)
    da, db = (np.asarray(t) for t in vjp(jnp.asarray(g)))
    _, (qa, sa, qb, sb) = np_fp8_matmul(a, b)
    qg, sg = np_quantize(g, ml_dtypes.float8_e5m2, E5M2_MAX)
    np.testing.assert_allclose(da, (qg @ qb.T) * sg * sb, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(db, (qa.T @ qg) * sa * sg, rtol=1e-5, atol=1e-6)


def test_batch_and_several_contracted_dims_follow_dot_general():
    rng = np.random.default_rng(2)
    a = rng.normal(size=(4, 16, 2, 32)).astype(np.float32)
    b = rng.normal(size=(2, 32, 4, 8)).astype(np.float32)
    dims = (((3,), (1,)), ((0, 2), (2, 0)))
    exact = np.asarray(jax.lax.dot_general(a, b, dims, precision="highest"))
    for scaling in ("tensor", "row"):
        got = np.asarray(fp8.scaled_dot(a, b, dims, jnp.float32, scaling))
        assert got.shape == exact.shape
        assert np.abs(got - exact).max() < 0.1 * np.abs(exact).max()
        grads = jax.grad(lambda x, y: fp8.scaled_dot(x, y, dims, jnp.float32, scaling).sum(),
                         (0, 1))(a, b)
        assert [x.shape for x in grads] == [a.shape, b.shape]


def test_zeros_stay_zero_and_a_non_finite_gradient_stays_non_finite():
    a, b = operands(outlier_row=False)
    zero = fp8.scaled_dot(np.zeros_like(a), b, DIMS_2D, jnp.float32, "tensor")
    assert np.all(np.asarray(zero) == 0)
    _, vjp = jax.vjp(lambda x, y: fp8.scaled_dot(x, y, DIMS_2D, jnp.float32, "tensor"), a, b)
    g = np.ones((a.shape[0], b.shape[1]), np.float32)
    g[0, 0] = np.inf  # an overflowed gradient: loss scaling must still see it
    assert not any(np.isfinite(np.asarray(t)).all() for t in vjp(jnp.asarray(g)))


# --------------------------------------------------------------------------- autocast
def mlp_loss(params, x, y):
    h = jax.nn.gelu(x @ params["w1"])
    h = jax.nn.gelu(h @ params["w2"])
    return jnp.mean((h @ params["w3"] - y) ** 2)


def mlp_setup(tokens=256, width=64):
    k = jax.random.split(jax.random.key(0), 5)
    params = {"w1": jax.random.normal(k[0], (width, 128)) / 8,
              "w2": jax.random.normal(k[1], (128, 128)) / 11,
              "w3": jax.random.normal(k[2], (128, 32)) / 11}
    return params, jax.random.normal(k[3], (tokens, width)), jax.random.normal(k[4], (tokens, 32))


ALL_FP8 = zf.AutocastPolicy(fp8_cost_model=False)


def f8_dots(closed):
    return [e for e in walk(closed) if e.primitive.name == "dot_general"
            and all("float8" in jnp.dtype(v.aval.dtype).name for v in e.invars)]


def test_every_matmul_and_both_backward_products_are_fp8():
    params, x, y = mlp_setup()
    grad_fn = jax.grad(zf.autocast(mlp_loss, dtype="fp8", policy=ALL_FP8))
    dots = f8_dots(jax.make_jaxpr(grad_fn)(params, x, y))
    kinds = sorted(tuple(jnp.dtype(v.aval.dtype).name for v in e.invars) for e in dots)
    assert kinds.count(("float8_e4m3fn", "float8_e4m3fn")) == 3  # forward
    assert len(dots) == 9  # and two e5m2 x e4m3 products each in the backward pass
    assert all("float8_e5m2" in k for k in kinds if k != ("float8_e4m3fn", "float8_e4m3fn"))


def rel_err(got, want):
    return float(jnp.linalg.norm(got - want) / jnp.linalg.norm(want))


def test_gradients_of_a_small_model_against_fp32_and_bf16():
    """Stated tolerance, for each weight's gradient against fp32 through three layers: relative
    L2 error at most 15% and cosine similarity at least 0.99 (e5m2 keeps 2 mantissa bits:
    up to 2^-3 relative rounding per gradient element, compounded layer by layer; measured
    6-10%, cosine 0.995-0.998); bf16's error, for scale, at most 2%."""
    params, x, y = mlp_setup()
    want = jax.grad(mlp_loss)(params, x, y)
    bf16 = jax.grad(zf.autocast(mlp_loss, dtype="bf16", policy=zf.AutocastPolicy(cost_model=False)))(
        params, x, y)
    for scaling in ("tensor", "row"):
        policy = zf.AutocastPolicy(fp8_cost_model=False, fp8_scaling=scaling)
        got = jax.jit(jax.grad(zf.autocast(mlp_loss, dtype="fp8", policy=policy)))(params, x, y)
        for name in params:
            assert got[name].dtype == jnp.float32
            assert rel_err(bf16[name], want[name]) < 0.02
            assert rel_err(got[name], want[name]) < 0.15, (scaling, name)
            g, w = got[name].ravel(), want[name].ravel()
            assert g @ w / (jnp.linalg.norm(g) * jnp.linalg.norm(w)) > 0.99


def test_the_cost_model_sends_large_matmuls_to_fp8_and_keeps_small_skinny_batched_and_head():
    def f(w_big, w_small, w_skinny, w_head, x_big, x_small, q):
        big = x_big @ w_big  # 8192 tokens x 4096 x 4096: compute-bound, FP8 wins
        small = x_small @ w_small  # 256 x 64 x 64: memory-bound, bf16
        skinny = x_big @ w_skinny  # n = 8
        scores = jnp.einsum("bqd,bkd->bqk", q, q)  # batched: attention-like
        with jax.named_scope("lm_head"):
            head = x_big @ w_head
        return big.sum() + small.sum() + skinny.sum() + scores.sum() + head.sum()

    s = jax.ShapeDtypeStruct
    args = [s((4096, 4096), jnp.float32), s((64, 64), jnp.float32), s((4096, 8), jnp.float32),
            s((4096, 4096), jnp.float32), s((8192, 4096), jnp.bfloat16),
            s((256, 64), jnp.bfloat16), s((4, 256, 64), jnp.bfloat16)]
    report = zf.autocast_report(f, *args, dtype="fp8")
    decisions = [d for d in report.find("dot_general")]
    assert [d.decision for d in decisions] == ["fp8", "low", "low", "low", "low"]
    assert "fp8 roofline: kept bf16" in decisions[1].reason
    assert "skinny" in decisions[2].reason and "batched" in decisions[3].reason
    assert "fp8_keep_scopes" in decisions[4].reason
    forced = zf.autocast_report(f, *args, dtype="fp8", policy=zf.AutocastPolicy(
        fp8_cost_model=False, fp8_keep_scopes=()))
    assert [d.decision for d in forced.find("dot_general")] == ["fp8", "fp8", "low", "low", "fp8"]


def test_the_roofline_follows_its_formula():
    # [m, k] @ [k, n] in training: 3 GEMMs at 2 m k n flops, compute-bound at these sizes;
    # FP8 pays 5 bytes per element of both operands and the gradient to quantize them
    from zeroflow.autocast import cost

    for (m, k, n), wins in (((8192, 4096, 4096), True), ((8192, 1024, 1024), False)):
        v = cost.judge_fp8(1, m, k, n, train=True)
        flops = 2 * m * k * n
        assert v.bf16_seconds == pytest.approx(3 * flops / 989e12)
        quant = 5 * (m * k + k * n + m * n) / 3.35e12
        assert v.fp8_seconds == pytest.approx(3 * flops / 1979e12 + quant)
        assert v.convert == wins


# --------------------------------------------------------------------------- the engine
def test_loss_scaling_and_skipped_steps_behave_as_in_bf16():
    params, x, y = mlp_setup()
    tx = optax.adam(1e-3)
    plan = zf.ZeroPlan(zf.make_mesh(data=-1, model=1), stage=0)

    def loss(p, batch):
        return mlp_loss(p, batch["x"], batch["y"]) * batch["poison"].mean()

    batches = [{"x": x, "y": y, "poison": jnp.full((len(x),), v, jnp.float32)}
               for v in (1, np.inf, 1, np.nan, 1)]
    runs = {}
    for autocast in ("bf16", "fp8"):
        prec = zf.Precision(loss_scale="dynamic", autocast=autocast, fp8_select="all",
                            growth_interval=2)
        state = zf.init_train_state(params, tx, plan, prec)
        step = zf.make_train_step(loss, tx, plan, prec)
        if autocast == "fp8":
            assert len(f8_dots(step.trace(state, batches[0]).jaxpr)) == 9
        rows = []
        for batch in batches:
            before = np.asarray(state.master["w1"])  # the state is donated
            state, metrics = step(state, batch)
            changed = bool(np.any(np.asarray(state.master["w1"]) != before))
            rows.append((int(metrics["skipped"]), float(state.loss_scale.scale), changed))
        runs[autocast] = rows
    assert [r[0] for r in runs["fp8"]] == [0, 1, 0, 1, 0]
    assert [r[2] for r in runs["fp8"]] == [True, False, True, False, True]
    assert runs["fp8"] == runs["bf16"]


# --------------------------------------------------------------------------- bad input
@pytest.mark.parametrize("make,message", [
    (lambda: zf.AutocastPolicy(fp8_scaling="block"),
     r"AutocastPolicy.fp8_scaling: unknown scaling 'block'; choose one of \['tensor', 'row', 'delayed'\]"),
    (lambda: zf.Precision(autocast="bf16", fp8_scaling="delayed"),
     r"fp8_scaling='delayed' scales FP8 matmuls, and autocast='bf16' has none"),
    (lambda: zf.Precision(autocast="fp8", fp8_select="some"),
     r"unknown fp8_select 'some'; choose one of \['cost', 'all'\]"),
    (lambda: zf.Precision(autocast="fp8", params="fp16", loss_scale="dynamic"),
     r"autocast='fp8' runs around bf16, not params='fp16'"),
    (lambda: zf.AutocastPolicy(fp8_cost_model="yes"), "fp8_cost_model must be True or False"),
])
def test_bad_fp8_settings_are_one_line(make, message):
    with pytest.raises(ValueError, match=message) as info:
        make()
    assert "\n" not in str(info.value)


def test_config_keys():
    from zeroflow.config.io import ConfigError, load_config
    cfg = load_config(None, ["precision.autocast=fp8", "precision.fp8_scaling=row"])
    assert zf.Precision.from_config(cfg.precision).autocast_policy().fp8_scaling == "row"
    with pytest.raises(ConfigError, match="precision.fp8_scaling") as info:
        load_config(None, ["precision.autocast=fp8", "precision.fp8_scaling=block"])
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("policy", ["everything_saveable", "nothing_saveable", "dots_saveable"])
def test_under_remat_policies_values_and_gradients_are_unchanged(policy):
    """A remat policy that saves the e4m3 residuals (the GPT's layers save everything but the
    fetched weights) must not alter them: entries above 240 used to come back non-finite."""
    a, b = operands(outlier_row=False)
    a = jnp.asarray(a * 10)  # entries of both signs up to 448 after scaling

    def body(x, y):
        return jnp.tanh(fp8.scaled_dot(x, y, DIMS_2D, jnp.float32, "tensor"))

    def plain(x, y):
        return body(x, y).sum()

    def remat(x, y):
        return jax.checkpoint(body, policy=getattr(jax.checkpoint_policies, policy))(x, y).sum()

    want = jax.jit(jax.value_and_grad(plain, (0, 1)))(a, b)
    got = jax.jit(jax.value_and_grad(remat, (0, 1)))(a, b)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        assert np.isfinite(np.asarray(g)).all()
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-6)
