"""Delayed FP8 scaling (``AutocastPolicy(fp8_scaling="delayed")``, ``fp8_delayed.py``) on
XLA:CPU against a NumPy reference of the recipe written here: per tensor, the scale of this
step is ``max(history) * 2**margin / 448`` (57344 for the e5m2 gradient), the previous scale
(1 at first) while the history is empty; ``x / scale`` is clipped and rounded with ml_dtypes;
then the amax of the tensor cast enters a window of the last ``history`` amaxes. The state
comes back as the gradient with respect to it, one history per scanned layer."""
import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest

import zeroflow as zf
from zeroflow.autocast import fp8_delayed
from fp8_reference import E4M3, E5M2, NpTensor, check_meta, np_bf16

pytestmark = pytest.mark.fast

DIMS_2D = (((1,), (0,)), ((), ()))


def test_the_op_follows_the_recipe_over_steps_first_step_and_saturation_included():
    """Five steps, history 3 (the window wraps), margin 1: the first step casts with scale 1
    (an empty history), and step 3's operand, 8x larger than its history, saturates at 448."""
    rng = np.random.default_rng(0)
    a0 = rng.normal(size=(32, 48)).astype(np.float32)
    b0 = rng.normal(size=(48, 16)).astype(np.float32) * 0.05
    history, margin = 3, 1
    refs = {name: NpTensor(fmt, history, margin) for name, fmt in
            (("lhs", E4M3), ("rhs", E4M3), ("grad", E5M2))}
    meta = fp8_delayed.materialize({"s": fp8_delayed.fresh_meta((), history)}, history)["s"]

    def f(a, b, m):
        return fp8_delayed.scaled_dot_delayed(a, b, m, DIMS_2D, jnp.float32, margin)

    @jax.jit
    def step(a, b, m, c):
        out, vjp = jax.vjp(f, a, b, m)
        return out, vjp(c)

    saturated = False
    for k, (ma, mb, mc) in enumerate([(1, 1, 1), (0.5, 2, 3), (2, 1, 1e-3), (8, 1, 5), (1, 0.25, 1)]):
        a, b = a0 * ma, b0 * mb
        c = rng.normal(size=(32, 16)).astype(np.float32) * mc
        out, (d_a, d_b, meta) = step(a, b, meta, c)
        qa, sa = refs["lhs"].cast(a)
        qb, sb = refs["rhs"].cast(b)
        qg, sg = refs["grad"].cast(c)
        saturated |= bool(np.any(np.abs(qa) == 448.0))
        want = (qa @ qb) * sa * sb
        np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
        want_da, want_db = (qg @ qb.T) * sg * sb, (qa.T @ qg) * sg * sa
        np.testing.assert_allclose(d_a, want_da, rtol=1e-5, atol=1e-5 * np.abs(want_da).max())
        np.testing.assert_allclose(d_b, want_db, rtol=1e-5, atol=1e-5 * np.abs(want_db).max())
        for name in ("lhs", "rhs", "grad"):
            check_meta(getattr(meta, name), refs[name])
        if k == 0:  # the first step: scale 1, so a0 (|x| < 5) keeps e4m3's coarse grid
            assert refs["lhs"].scale == 1.0
    assert saturated


# --------------------------------------------------------------------------- the library path
def two_layer_loss(w, x, c):
    """A first matmul, then a scanned layer stack (two more matmuls, one per layer)."""
    h = x @ w["first"]

    def layer(h, wl):
        return h @ wl, None

    h, _ = jax.lax.scan(layer, h, w["stack"])
    return jnp.sum(h.astype(jnp.float32) * c)


def test_autocast_carries_one_history_per_site_and_layer_through_the_gradient():
    """``zf.autocast(fn, dtype="fp8", policy=AutocastPolicy(fp8_scaling="delayed"))``: three
    steps of a first matmul and a two-layer scan against the NumPy recipe on bf16 operands
    (autocast's half dtype), each scanned layer with its own history."""
    rng = np.random.default_rng(1)
    w = {"first": rng.normal(size=(32, 32)).astype(np.float32) * 0.2,
         "stack": rng.normal(size=(2, 32, 32)).astype(np.float32) * 0.2}
    x0 = rng.normal(size=(16, 32)).astype(np.float32)
    c = rng.normal(size=(16, 32)).astype(np.float32)
    policy = zf.AutocastPolicy(fp8_scaling="delayed", fp8_history=2, fp8_cost_model=False)
    f = zf.autocast(two_layer_loss, dtype="fp8", policy=policy)
    state = f.init(w, x0, c)
    assert sorted(state) == ["dot_0", "dot_1_0"]  # equation 0; equation 0 of the scan's body
    assert state["dot_1_0"].lhs.history.shape == (2, 2)  # a history per layer
    step = jax.jit(jax.value_and_grad(f, argnums=0))
    sites = [NpTensor(E4M3, 2, 0) for _ in range(6)]  # (lhs, rhs) of first, layer 0, layer 1
    for mult in (1.0, 4.0, 0.5):
        x = x0 * mult
        loss, state = step(state, w, x, c)
        h = np_bf16(x)
        for i, wi in enumerate([w["first"], *w["stack"]]):
            qa, sa = sites[2 * i].cast(h)
            qb, sb = sites[2 * i + 1].cast(np_bf16(wi))
            h = np_bf16((qa @ qb) * sa * sb)
        want = float(np.sum(h * c))
        np.testing.assert_allclose(float(loss), want, rtol=2e-2, atol=1e-3 * np.abs(h * c).sum())
        check_meta(state["dot_0"].lhs, sites[0])
        check_meta(state["dot_0"].rhs, sites[1])
        for layer in range(2):
            one = jax.tree.map(lambda a: a[layer], state["dot_1_0"])
            check_meta(one.lhs, sites[2 + 2 * layer], rtol=2 * 2.0**-7)
            check_meta(one.rhs, sites[3 + 2 * layer])
    # the last layer's incoming gradient is c (rounded to bf16): its amaxes are in its history
    last_grad = np.asarray(state["dot_1_0"].grad.history[1])
    np.testing.assert_allclose(last_grad, np.abs(np_bf16(c)).max(), rtol=1e-6)


def test_nested_scans_get_a_history_per_iteration_and_an_untaken_branch_starts_over():
    """Scans in scans: one history per (outer, inner) iteration, each recording its own weight
    slice. A ``cond`` branch not taken gets a zero "gradient", i.e. an empty history: it starts
    over (scale 1) the next time it runs (docs/autocast.md)."""
    def loss(w, x, flag):
        def inner(h, wl):
            return h @ wl, None

        def outer(h, ws):
            return jax.lax.scan(inner, h, ws)[0], None

        h, _ = jax.lax.scan(outer, x, w["stack"])
        h = jax.lax.cond(flag, lambda h: h @ w["yes"], lambda h: h @ w["no"], h)
        return jnp.sum(h)

    rng = np.random.default_rng(3)
    w = {"stack": rng.normal(size=(2, 3, 32, 32)).astype(np.float32) * 0.2,
         "yes": rng.normal(size=(32, 32)).astype(np.float32),
         "no": rng.normal(size=(32, 32)).astype(np.float32)}
    x = rng.normal(size=(16, 32)).astype(np.float32)
    policy = zf.AutocastPolicy(fp8_scaling="delayed", fp8_history=4, fp8_cost_model=False)
    f = zf.autocast(loss, dtype="fp8", policy=policy)
    state = f.init(w, x, True)
    new = jax.jit(jax.grad(f, argnums=0))(state, w, x, True)
    stack, no, yes = (new[k] for k in sorted(new))  # scan's body first; lax.cond: False, True
    assert stack.rhs.history.shape == (2, 3, 4)
    want = np.abs(np_bf16(w["stack"])).max(axis=(2, 3))
    np.testing.assert_array_equal(np.asarray(stack.rhs.history).max(axis=-1), want)
    assert float(yes.rhs.history.max()) == np.abs(np_bf16(w["yes"])).max()
    assert float(no.rhs.history.max()) == 0.0


def test_a_remat_layer_stack_and_a_checkpoint_round_trip_keep_the_state_exact(tmp_path):
    """The layers under ``jax.checkpoint`` (the backward pass recomputes the forward) give the
    same state as without; the state is a plain pytree that orbax saves and restores bit for
    bit, and training on from the restored state matches training on without the round trip."""
    rng = np.random.default_rng(2)
    w = {"first": rng.normal(size=(32, 32)).astype(np.float32) * 0.2,
         "stack": rng.normal(size=(2, 32, 32)).astype(np.float32) * 0.2}
    x = rng.normal(size=(16, 32)).astype(np.float32)
    c = rng.normal(size=(16, 32)).astype(np.float32)

    def remat_loss(w, x, c):
        return jax.checkpoint(two_layer_loss)(w, x, c)

    policy = zf.AutocastPolicy(fp8_scaling="delayed", fp8_history=4, fp8_cost_model=False)
    plain = zf.autocast(two_layer_loss, dtype="fp8", policy=policy)
    remat = zf.autocast(remat_loss, dtype="fp8", policy=policy)

    def run(f, state, steps):
        grad = jax.jit(jax.value_and_grad(f, argnums=(0, 1)))
        wk = w
        for _ in range(steps):
            _, (state, g) = grad(state, wk, x, c)
            wk = jax.tree.map(lambda p, d: p - 0.01 * d, wk, g)
        return state

    s_plain = run(plain, plain.init(w, x, c), 2)
    s_remat = run(remat, remat.init(w, x, c), 2)
    assert jax.tree.map(lambda a: a.shape, s_plain) != {}
    for a, b in zip(jax.tree.leaves(s_plain), jax.tree.leaves(s_remat)):
        np.testing.assert_array_equal(a, b)
    ckpt = ocp.StandardCheckpointer()
    ckpt.save(tmp_path / "fp8", s_plain)
    ckpt.wait_until_finished()
    restored = ckpt.restore(tmp_path / "fp8", jax.tree.map(np.asarray, s_plain))
    for a, b in zip(jax.tree.leaves(s_plain), jax.tree.leaves(restored)):
        assert np.asarray(a).tobytes() == np.asarray(b).tobytes()


# --------------------------------------------------------------------------- bad input
@pytest.mark.parametrize("make,message", [
    (lambda: zf.AutocastPolicy(fp8_scaling="block"),
     r"unknown scaling 'block'; choose one of \['tensor', 'row', 'delayed'\]"),
    (lambda: zf.AutocastPolicy(fp8_scaling="delayed", fp8_history=0),
     r"AutocastPolicy.fp8_history must be an integer >= 1, got 0"),
    (lambda: zf.AutocastPolicy(fp8_scaling="delayed", fp8_margin=-1),
     r"AutocastPolicy.fp8_margin must be an integer >= 0, got -1"),
    (lambda: zf.Precision(autocast="fp8", fp8_scaling="delayed", fp8_history=0),
     r"fp8_history must be an int >= 1, got 0"),
    (lambda: zf.Precision(autocast="none", fp8_scaling="delayed"),
     r"fp8_scaling='delayed' scales FP8 matmuls, and autocast='none' has none"),
])
def test_bad_settings_are_one_line(make, message):
    with pytest.raises(ValueError, match=message) as info:
        make()
    assert "\n" not in str(info.value)


def test_bad_calls_are_one_line():
    policy = zf.AutocastPolicy(fp8_scaling="delayed", fp8_cost_model=False)
    w = {"first": jnp.ones((32, 32)), "stack": jnp.ones((2, 32, 32))}
    x, c = jnp.ones((16, 32)), jnp.ones((16, 32))
    f = zf.autocast(two_layer_loss, dtype="fp8", policy=policy)
    for call, message in [
        (lambda: f(w, x, c), "the first argument must be the fp8 state dict from f.init"),
        (lambda: f({}, w, x, c), "fp8 state has no entry for matmul site 'dot_0'"),
    ]:
        with pytest.raises(ValueError, match=message) as info:
            call()
        assert "\n" not in str(info.value)

    def looped(w, x):
        return jax.lax.while_loop(lambda h: h[0, 0] < 1e3, lambda h: h @ w, x)

    g = zf.autocast(looped, dtype="fp8", policy=policy)
    with pytest.raises(ValueError, match="inside a while loop") as info:
        g.init(w["first"], x)
    assert "\n" not in str(info.value)


def test_config_takes_delayed_and_refuses_it_without_fp8_in_one_line():
    from zeroflow.config.io import ConfigError, load_config
    cfg = load_config(None, ["precision.autocast=fp8", "precision.fp8_scaling=delayed",
                             "precision.fp8_history=16", "precision.fp8_margin=1"])
    policy = zf.Precision.from_config(cfg.precision).autocast_policy()
    assert (policy.fp8_scaling, policy.fp8_history, policy.fp8_margin) == ("delayed", 16, 1)
    for overrides, message in [
        (["precision.fp8_scaling=delayed"], "fp8_scaling='delayed' scales FP8 matmuls"),
        (["precision.autocast=fp8", "precision.fp8_scaling=late"], "precision.fp8_scaling"),
        (["precision.autocast=fp8", "precision.fp8_history=0"], "precision.fp8_history must be"),
    ]:
        with pytest.raises(ConfigError, match=message) as info:
            load_config(None, overrides)
        assert "\n" not in str(info.value)
