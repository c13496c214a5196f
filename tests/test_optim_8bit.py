"""AdamW with 8-bit (blockwise dynamic quantization) and bf16 moments: the scheme against a
numpy version written here from the paper's description, one update against a numpy Adam on
that scheme, ZeRO-3 on 8 devices against one device, checkpoints onto other meshes, the state's
bytes, and the trainer's ``train.optimizer``."""
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import zeroflow as zf
from helpers import REPO, assert_leaves_equal, bytes_on, train_losses

pytestmark = pytest.mark.fast

# --- the scheme in numpy (Dettmers et al. 2022, section 2 and appendix) -------------------------


def reference_map(signed):
    """Dynamic tree map: in decade ``10**-6 .. 10**0`` number ``k`` (k = 0..6), the centres of
    ``2**k`` (signed; ``2**(k+1)`` unsigned) equal intervals of [0.1, 1], scaled by
    ``10**(k-6)``, with their negatives when signed; plus 0 and 1."""
    out = [0.0, 1.0]
    for k in range(7):
        n = 2 ** k if signed else 2 ** (k + 1)
        for j in range(n):
            centre = (0.1 + 0.9 * j / n + 0.1 + 0.9 * (j + 1) / n) / 2 * 10.0 ** (k - 6)
            out.append(centre)
            if signed:
                out.append(-centre)
    return np.array(sorted(out), np.float32)


def reference_quantize(x, block, signed):
    """Codes (nearest map entry, by brute force) and per-block absmax: a row of the last axis
    (length L) holds n = ceil(L / block) interleaved blocks, block b = entries b, b + n, ..."""
    table = reference_map(signed).astype(np.float64)
    x = np.asarray(x, np.float32)
    rows = x.reshape(-1, x.shape[-1])
    n = max(1, -(-x.shape[-1] // block))
    codes = np.zeros(rows.shape, np.uint8)
    scales = np.zeros((rows.shape[0], n), np.float32)
    for r, row in enumerate(rows):
        for b in range(n):
            part = row[b::n]
            absmax = np.max(np.abs(part))
            scales[r, b] = absmax
            normed = (part / (absmax if absmax else np.float32(1))).astype(np.float64)
            codes[r, b::n] = np.argmin(np.abs(normed[:, None] - table[None, :]), axis=1)
    return codes.reshape(x.shape), scales.reshape(x.shape[:-1] + (n,))


def block_scale_of_each_entry(scales, length):
    n = scales.shape[-1]
    return np.take(scales, np.arange(length) % n, axis=-1)


def reference_dequantize(codes, scales, block, signed):
    return reference_map(signed)[codes] * block_scale_of_each_entry(scales, codes.shape[-1])


def reference_adam_8bit_step(g, state, step, *, b1, b2, eps, block):
    """One Adam step on dequantized moments, the new moments quantized again, v as its square
    root: (direction, (m codes, m scales, sqrt(v) codes, sqrt(v) scales))."""
    m = reference_dequantize(*state[:2], block, True)
    v = np.square(reference_dequantize(*state[2:], block, False))
    m = np.float32(b1) * m + np.float32(1 - b1) * g
    v = np.float32(b2) * v + np.float32(1 - b2) * g * g
    # Bias corrections in fp32, as an fp32 program computes them.
    c1, c2 = (np.float32(1) - np.float32(b) ** np.float32(step) for b in (b1, b2))
    direction = (m / c1) / (np.sqrt(v / c2) + np.float32(eps))
    return direction, (*reference_quantize(m, block, True),
                       *reference_quantize(np.sqrt(v), block, False))


# --- the scheme ---------------------------------------------------------------------------------

@pytest.mark.parametrize("signed", [True, False])
def test_maps_match_the_papers(signed):
    np.testing.assert_allclose(zf.optim.dynamic_map(signed), reference_map(signed), rtol=1e-6)


@pytest.mark.parametrize("shape,block", [((3, 600), 256), ((2, 4, 100), 32), ((7,), 256),
                                         ((2, 5, 512), 256)])
def test_round_trip_matches_numpy(shape, block):
    rng = np.random.default_rng(0)
    # Magnitudes over six decades, so every part of the map is used.
    x = (rng.normal(size=shape) * 10.0 ** rng.uniform(-6, 0, size=shape)).astype(np.float32)
    for signed, values in ((True, x), (False, x * x)):
        codes, scales = zf.optim.quantize(jnp.asarray(values), block, signed)
        want_codes, want_scales = reference_quantize(values, block, signed)
        assert codes.dtype == jnp.uint8 and scales.dtype == jnp.float32
        np.testing.assert_array_equal(np.asarray(scales), want_scales)
        np.testing.assert_array_equal(np.asarray(codes), want_codes)
        back = zf.optim.dequantize(codes, scales, block, signed)
        np.testing.assert_allclose(np.asarray(back), reference_dequantize(want_codes, want_scales,
                                                                          block, signed), rtol=1e-6)
        # Each entry is off by at most half the map's widest gap (the top decade's: 0.9 / 64
        # signed, 0.9 / 128 unsigned) times its block's scale.
        err = np.abs(np.asarray(back) - values)
        half_gap = 0.9 / (64 if signed else 128) / 2
        assert np.all(err <= block_scale_of_each_entry(want_scales, shape[-1]) * half_gap
                      * (1 + 1e-5))


def test_update_steps_match_numpy_adam_on_the_scheme():
    b1, b2, eps, block, lr, wd = 0.9, 0.99, 1e-8, 64, 1e-2, 0.1
    rng = np.random.default_rng(1)
    params = {"w": rng.normal(size=(6, 200)).astype(np.float32),
              "b": rng.normal(size=(5,)).astype(np.float32),
              "stack": rng.normal(size=(3, 4, 200)).astype(np.float32)}
    assert zf.optim.adam.by_slices(params["stack"].shape)  # updated one layer at a time
    tx = zf.optim.adamw_8bit(lr, b1=b1, b2=b2, eps=eps, weight_decay=wd, block_size=block,
                             min_8bit_size=0)
    state = tx.init(params)
    update = jax.jit(tx.update)
    for step in range(1, 4):
        grads = jax.tree.map(lambda p: (rng.normal(size=p.shape) * 10.0 ** rng.uniform(-4, 0, p.shape)
                                        ).astype(np.float32), params)
        adam = state[0]
        updates, state = update(grads, state, params)
        for name in params:
            before = tuple(np.asarray(t[name]) for t in (adam.mu_codes, adam.mu_scales,
                                                         adam.nu_codes, adam.nu_scales))
            direction, after = reference_adam_8bit_step(grads[name], before, step, b1=b1, b2=b2,
                                                        eps=eps, block=block)
            np.testing.assert_allclose(np.asarray(updates[name]),
                                       -lr * (direction + wd * params[name]), rtol=2e-6, atol=1e-9)
            got = state[0]
            for a, b in zip((got.mu_codes, got.mu_scales, got.nu_codes, got.nu_scales), after):
                if name == "stack" and a[name].dtype == jnp.uint8:
                    # One entry of this stack's moments lands within an fp32 rounding of a
                    # midpoint of the map, where XLA and numpy pick neighbouring codes (the
                    # whole-array update does the same): codes agree to one step, almost all
                    # exactly.
                    off = np.abs(np.asarray(a[name]).astype(int) - b.astype(int))
                    assert off.max() <= 1 and np.mean(off > 0) < 1e-3, (name, off.max())
                    continue
                np.testing.assert_allclose(np.asarray(a[name]), b, rtol=1e-6)
        assert int(state[0].count) == step
        params = optax.apply_updates(params, updates)


def test_small_parameters_keep_fp32_moments_like_optax():
    """Below ``min_8bit_size`` entries a parameter's moments stay fp32 and its updates are
    optax.adamw's; at or above, the moments are 8-bit codes."""
    rng = np.random.default_rng(3)
    params = {"small": rng.normal(size=(4, 255)).astype(np.float32),   # 1020 entries
              "large": rng.normal(size=(4, 256)).astype(np.float32)}   # 1024 entries
    tx = zf.optim.adamw_8bit(1e-2, weight_decay=0.1, min_8bit_size=1024)
    ref = optax.adamw(1e-2, weight_decay=0.1)
    state, ref_state = tx.init(params), ref.init(params)
    for _ in range(3):
        grads = jax.tree.map(lambda p: rng.normal(size=p.shape).astype(np.float32), params)
        updates, state = tx.update(grads, state, params)
        want, ref_state = ref.update(grads, ref_state, params)
        # The moments are optax's to the bit; 1 - b2**t is rounded differently in fp32 (one ulp
        # of b2**t, 2e-5 of 1 - b2**t at t=3), which moves the direction by up to 1e-5.
        np.testing.assert_allclose(np.asarray(updates["small"]), np.asarray(want["small"]),
                                   rtol=1e-6, atol=1e-2 * 2e-5)
        np.testing.assert_array_equal(np.asarray(state[0].mu_codes["small"]),
                                      np.asarray(ref_state[0].mu["small"]))
        params = optax.apply_updates(params, updates)
    adam = state[0]
    assert adam.mu_codes["small"].dtype == adam.nu_codes["small"].dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(adam.nu_codes["small"]), np.asarray(ref_state[0].nu["small"]),
                               rtol=1e-6)
    assert adam.mu_codes["large"].dtype == adam.nu_codes["large"].dtype == jnp.uint8


@pytest.mark.parametrize("bad", [-1, 1.5, True])
def test_rejects_a_bad_min_8bit_size_in_one_line(bad):
    with pytest.raises(ValueError, match="min_8bit_size must be an integer >= 0") as err:
        zf.optim.adamw_8bit(1e-3, min_8bit_size=bad)
    assert "\n" not in str(err.value)


def test_bf16_moments_update_matches_adam_rounded_to_bf16():
    rng = np.random.default_rng(2)
    params = {"w": rng.normal(size=(8, 24)).astype(np.float32)}
    grads = {"w": rng.normal(size=(8, 24)).astype(np.float32)}
    tx = zf.optim.adamw_bf16(1e-2, b2=0.99)
    updates, state = tx.update(grads, tx.init(params), params)
    g = grads["w"]
    m, v = np.float32(0.1) * g, np.float32(0.01) * g * g
    want = -1e-2 * (m / np.float32(0.1)) / (np.sqrt(v / np.float32(0.01)) + np.float32(1e-8))
    np.testing.assert_allclose(np.asarray(updates["w"]), want, rtol=1e-6)
    adam = state[0]
    assert adam.mu["w"].dtype == adam.nu["w"].dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(adam.mu["w"]), m.astype(jnp.bfloat16))
    np.testing.assert_array_equal(np.asarray(adam.nu["w"]), v.astype(jnp.bfloat16))


# --- on the engine ------------------------------------------------------------------------------

def init_params():
    k = jax.random.split(jax.random.key(0), 4)
    return {
        "inp": jax.random.normal(k[0], (24, 600)) * 0.1,  # 3 blocks of 200 per row
        # ZeRO splits the last axis (512 / 8 = 64 per device): every device has part of each
        # of a row's two blocks.
        "stack": jax.random.normal(k[1], (2, 12, 512)) * 0.05,
        "odd": jax.random.normal(k[2], (300, 13)) * 0.08,  # stored padded (300 -> 304)
        "bias": jnp.zeros((13,)),
    }


def loss_fn(params, batch):
    h = jnp.tanh(batch["x"] @ params["inp"])[:, :512]
    h = jnp.tanh(h @ params["stack"][0].T @ params["stack"][1])[:, :300]
    out = h @ params["odd"] + params["bias"]
    return jnp.mean((out[:, :3] - batch["y"]) ** 2)


BATCHES = [{"x": np.random.default_rng(s).normal(size=(16, 24)).astype(np.float32),
            "y": np.random.default_rng(s + 9).normal(size=(16, 3)).astype(np.float32)}
           for s in range(4)]
# min_8bit_size=1000: "odd" (3,900 entries) is quantized too, "bias" keeps fp32 moments.
MAKERS = {"8bit": lambda: zf.optim.adamw_8bit(3e-3, weight_decay=0.1, min_8bit_size=1000),
          "bf16": lambda: zf.optim.adamw_bf16(3e-3, weight_decay=0.1)}


def engine_run(tx, plan, batches=BATCHES):
    prec = zf.Precision()
    state = zf.init_train_state(init_params(), tx, plan, prec)
    return train_losses(zf.make_train_step(loss_fn, tx, plan, prec), state, batches)


@pytest.mark.parametrize("moments", list(MAKERS))
def test_stage3_on_8_devices_matches_one_device(moments):
    tx = MAKERS[moments]()
    one = zf.ZeroPlan(zf.make_mesh(devices=jax.devices()[:1]), stage=0)
    eight = zf.ZeroPlan(zf.make_mesh(), stage=3)
    losses_one, state_one, _ = engine_run(tx, one)
    losses, state, _ = engine_run(tx, eight)
    # The quantized state is split over the devices with its parameter: codes like the
    # parameter (padded with it), each device holding an eighth.
    codes = state.opt_state[0].mu_codes if moments == "8bit" else state.opt_state[0].mu
    for name in ("inp", "stack", "odd"):
        assert codes[name].sharding.is_equivalent_to(state.master[name].sharding, codes[name].ndim)
        assert math.prod(codes[name].addressable_shards[0].data.shape) * 8 == codes[name].size
    # Eight devices sum the gradient in another order than one, so values differ in their last
    # bits; where that moves a moment across a rounding boundary of its 8-bit code or bf16 value
    # (a few entries in 10,000 here), that entry's update differs by about one step of the map:
    # under 1.5% of the learning rate.
    np.testing.assert_allclose(losses, losses_one, rtol=1e-5)
    for got, want in zip(jax.tree.leaves(state.master_params), jax.tree.leaves(state_one.master_params)):
        got, want = np.asarray(got), np.asarray(want)
        assert np.mean(~np.isclose(got, want, rtol=1e-5, atol=1e-8)) < 0.005
        np.testing.assert_allclose(got, want, atol=len(BATCHES) * 3e-3 * 0.015)
    unpadded = zf.padding.unpad(state.opt_state, state.padding.opt_state)
    for got, want in zip(jax.tree.leaves(unpadded), jax.tree.leaves(state_one.opt_state)):
        got, want = np.asarray(got), np.asarray(want)
        if got.dtype == np.float32 and moments != "8bit":
            np.testing.assert_allclose(got, want, rtol=1e-5)
        elif got.dtype == np.float32:  # the scales, the bias's fp32 moments
            # A scale is its block's largest |moment|, a decayed sum of gradients that are each
            # a sum of 16 per-example products, split into 8 partial sums on 8 devices: fp32
            # rounds each order differently by up to 15 * 2**-24 (9e-7) of the sum of the
            # terms' magnitudes, so an entry whose terms cancel k-fold moves by k * 9e-7. 1e-4
            # allows k up to 100 (the largest seen, on AMD EPYC at AVX512, AVX2 and AVX: 3.7e-5
            # on "odd", whose output columns past the third get no gradient). How many scales
            # move past 1e-5 is not bounded: that counts the CPU's rounding events, not a property.
            np.testing.assert_allclose(got, want, rtol=1e-4)
        else:  # codes and bf16 moments
            assert np.mean(got != want) < 1e-3
            if got.dtype == np.uint8:
                assert np.max(np.abs(got.astype(int) - want.astype(int))) <= 1


def test_8bit_trains_like_fp32_adamw():
    batches = BATCHES * 5
    one = zf.ZeroPlan(zf.make_mesh(devices=jax.devices()[:1]), stage=0)
    ref, _, _ = engine_run(optax.adamw(3e-3, weight_decay=0.1), one, batches)
    got, _, _ = engine_run(MAKERS["8bit"](), one, batches)
    assert ref[-1] < 0.7 * ref[0]  # it does learn
    # Quantization changes each moment by at most 0.35% of its block's largest entry.
    np.testing.assert_allclose(got, ref, rtol=0.02)


def state_bytes(opt_state) -> int:
    return sum(x.nbytes for x in jax.tree.leaves(opt_state) if x.ndim)


def test_state_bytes_per_parameter():
    params = {"w": jnp.zeros((64, 1024)), "v": jnp.zeros((4, 8, 512)), "b": jnp.zeros((1024,))}
    n = sum(x.size for x in jax.tree.leaves(params))
    plan = zf.ZeroPlan(zf.make_mesh(), stage=3)
    sizes = {}
    for name, tx in {"fp32": optax.adamw(1e-3), "8bit": zf.optim.adamw_8bit(1e-3),
                     "8bit_all": zf.optim.adamw_8bit(1e-3, min_8bit_size=0),
                     "bf16": zf.optim.adamw_bf16(1e-3)}.items():
        state = zf.init_train_state(params, tx, plan, zf.Precision())
        sizes[name] = state_bytes(state.opt_state) / n
        # Split over the 8 devices, but for the step counter (and, all quantized, "b"'s four
        # scales per moment).
        on_one = bytes_on(jax.devices()[0], [x for x in jax.tree.leaves(state.opt_state) if x.ndim])
        assert on_one * 8 == state_bytes(state.opt_state) + (7 * 2 * 4 * 4 if name == "8bit_all"
                                                             else 0)
    assert sizes["fp32"] == 8 and sizes["bf16"] == 4
    # Two one-byte codes per parameter and two fp32 scales per 256 entries.
    assert sizes["8bit_all"] == pytest.approx(2 + 2 * 4 / 256)
    # By default "b" (1,024 < 4,096 entries) keeps two fp32 moments: 8 bytes per entry.
    quantized = 64 * 1024 + 4 * 8 * 512
    assert sizes["8bit"] == pytest.approx((quantized * (2 + 2 * 4 / 256) + 1024 * 8) / n)


def test_checkpoint_restores_onto_other_meshes_and_stages(tmp_path):
    tx = MAKERS["8bit"]()
    _, state, _ = engine_run(tx, zf.ZeroPlan(zf.make_mesh(), stage=3), BATCHES[:2])
    zf.save_checkpoint(tmp_path / "ckpt", state)
    saved = jax.device_get(zf.padding.unpad(state.opt_state, state.padding.opt_state))
    prec, step = zf.Precision(), zf.make_train_step  # the step donates ``state``
    _, want, _ = train_losses(step(loss_fn, tx, zf.ZeroPlan(zf.make_mesh(), stage=3), prec),
                              state, BATCHES[2:])
    for plan in (zf.ZeroPlan(zf.make_mesh(devices=jax.devices()[:4]), stage=1),
                 zf.ZeroPlan(zf.make_mesh(devices=jax.devices()[:1]), stage=0)):
        like = zf.init_train_state(init_params(), tx, plan, prec)
        restored = zf.restore_checkpoint(tmp_path / "ckpt", like)
        assert_leaves_equal(zf.padding.unpad(restored.opt_state, restored.padding.opt_state), saved)
        _, resumed, _ = train_losses(step(loss_fn, tx, plan, prec), restored, BATCHES[2:])
        # The restored state is bit-equal (above); the two steps after it sum each gradient in
        # another order on another mesh, so fp32 values differ in their last bits (rtol 1e-6),
        # and where that moves a moment across a boundary of its 8-bit code, that entry's
        # update moves by up to one step of the map: under 1.5% of the learning rate (3e-3) a
        # step. Such entries are rare (a few in 10,000: at most 1 in 1,000 allowed).
        for got, wanted in zip(jax.tree.leaves(resumed.master_params),
                               jax.tree.leaves(want.master_params)):
            got, wanted = np.asarray(got), np.asarray(wanted)
            assert np.mean(~np.isclose(got, wanted, rtol=1e-6, atol=1e-7)) < 1e-3
            np.testing.assert_allclose(got, wanted, atol=len(BATCHES[2:]) * 3e-3 * 0.015)


# --- the trainer --------------------------------------------------------------------------------

@pytest.mark.parametrize("name,state_type", [("adamw_8bit", zf.optim.ScaleByAdam8bitState),
                                             ("adamw_bf16", zf.optim.ScaleByAdamBf16State)])
def test_trainer_optimizer_choice(name, state_type):
    from zeroflow.config.io import apply_overrides, load_config
    from zeroflow.trainer.setup import build_run
    cfg = apply_overrides(load_config(REPO / "configs" / "tiny.yaml"), [f"train.optimizer={name}"])
    state = build_run(cfg, with_data=False).abstract_state()
    adam = [s for s in jax.tree.leaves(state.opt_state, is_leaf=lambda s: isinstance(s, state_type))
            if isinstance(s, state_type)]
    assert len(adam) == 1


def test_trainer_rejects_an_unknown_optimizer_in_one_line():
    from zeroflow.config.io import apply_overrides, load_config
    with pytest.raises(ValueError, match=r"adamw_8bit") as err:
        apply_overrides(load_config(REPO / "configs" / "tiny.yaml"), ["train.optimizer=adamw8bit"])
    assert "\n" not in str(err.value)


# --- the estimators -----------------------------------------------------------------------------

def real_state_bytes_per_param(cfg) -> float:
    """From the trainer's real (abstract) state: per-parameter optimizer leaves over parameters."""
    from zeroflow.trainer.setup import build_run
    state = build_run(cfg, with_data=False).abstract_state()
    params = sum(math.prod(x.shape) for x in jax.tree.leaves(state.master))
    return sum(math.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(state.opt_state)
               if x.shape != ()) / params


@pytest.mark.parametrize("model", [[], ["model.norm=layernorm", "model.attn_bias=all",
                                        "model.mlp_bias=true", "model.tie_embeddings=false",
                                        "model.positions=learned", "model.mlp_activation=gelu",
                                        "model.num_kv_heads=2", "model.embed_dim=96"]])
def test_estimate_config_counts_the_configs_optimizer_state(model):
    from zeroflow.config.io import apply_overrides, load_config
    from zeroflow.models.spec import optimizer_bytes_per_param
    base = apply_overrides(load_config(REPO / "configs" / "tiny.yaml"),
                           model + ["parallel.zero_stage=1", "parallel.data=8"])
    fp32 = zf.memory.estimate_config(base)
    for name in zf.optim.ADAMW_CHOICES:
        cfg = apply_overrides(base, [f"train.optimizer={name}"])
        per_param = real_state_bytes_per_param(cfg)
        assert optimizer_bytes_per_param(cfg.model, name) == pytest.approx(per_param, rel=1e-9)
        est = zf.memory.estimate_config(cfg)
        # Stage 1 splits the state over the 8 devices: the ZeRO formula with this state.
        assert est.device.optimizer == pytest.approx(per_param * est.num_params / 8, rel=1e-9)
        assert est.device.master == fp32.device.master
    assert optimizer_bytes_per_param(base.model, "adamw_8bit") < 2.5
