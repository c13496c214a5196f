"""FuseMix: InfoNCE and latent mixup against numpy written out by hand, the latent cache
(refuses another encoder's latents, resumes an interrupted build), the batch stream (a
function of the step, so resuming mid-epoch is exact), retrieval recall."""
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from zeroflow import make_mesh
from zeroflow.fusemix import cache, model, retrieval, stream

pytestmark = pytest.mark.fast


def _unit(x):
    return x / np.linalg.norm(x, axis=1, keepdims=True)


def _info_nce_numpy(a, b, t):
    loss = 0.0
    n = len(a)
    for logits in (a @ b.T / t, b @ a.T / t):
        for i in range(n):
            row = logits[i] - logits[i].max()
            loss += -(row[i] - np.log(np.exp(row).sum())) / (2 * n)
    return loss


def test_info_nce_matches_numpy():
    rng = np.random.default_rng(0)
    a, b = _unit(rng.normal(size=(6, 5))), _unit(rng.normal(size=(6, 5)))
    for t in (0.07, 1.0):
        ours = float(model.info_nce(jnp.asarray(a, jnp.float32), jnp.asarray(b, jnp.float32), t))
        np.testing.assert_allclose(ours, _info_nce_numpy(a, b, t), rtol=1e-5)
    # Asymmetric scores: the two directions differ, and both count.
    b2 = b.copy()
    b2[0] = a[1]
    one_way = float(np.mean([-np.log(np.exp(r[i]) / np.exp(r).sum()) for i, r in enumerate(a @ b2.T)]))
    assert abs(float(model.info_nce(jnp.asarray(a), jnp.asarray(b2), 1.0)) - one_way) > 1e-4


def test_mixup_shares_lambda_and_partner_across_modalities():
    rng = np.random.default_rng(1)
    batch = {"image": rng.normal(size=(8, 3)).astype(np.float32),
             "text": rng.normal(size=(8, 4)).astype(np.float32)}
    lam, perm = model.draw_mixup(jax.random.key(0), 8, 0.5)
    mixed = model.mix_pairs({k: jnp.asarray(v) for k, v in batch.items()}, lam, perm)
    lam, perm = np.asarray(lam), np.asarray(perm)
    assert sorted(perm) == list(range(8)) and np.all((lam > 0) & (lam < 1))
    for k, v in batch.items():
        expected = np.stack([lam[i] * v[i] + (1 - lam[i]) * v[perm[i]] for i in range(8)])
        np.testing.assert_allclose(mixed[k], expected, rtol=1e-6)


def test_mixup_lambda_follows_beta():
    lam, _ = model.draw_mixup(jax.random.key(1), 20000, 0.4)
    lam = np.asarray(lam)
    # Beta(a, a): mean 1/2, variance 1 / (4 (2a + 1)).
    assert abs(lam.mean() - 0.5) < 0.01 and abs(lam.var() - 1 / (4 * 1.8)) < 0.01


def test_loss_with_mixup_is_info_nce_of_mixed_pairs():
    module, loss = model.make_loss(16, 2, 8, temperature=0.1, mixup_alpha=1.0)
    rng = np.random.default_rng(2)
    batch = {"image": rng.normal(size=(6, 5)).astype(np.float32),
             "text": rng.normal(size=(6, 7)).astype(np.float32)}
    params = module.init(jax.random.key(0), batch["image"], batch["text"])["params"]
    key = jax.random.key(3)
    got, _ = loss(params, batch, rng=key)
    lam, perm = model.draw_mixup(key, 6, 1.0)
    mixed = {k: np.asarray(v) for k, v in model.mix_pairs(batch, lam, perm).items()}
    za, zb = module.apply({"params": params}, mixed["image"], mixed["text"])
    np.testing.assert_allclose(float(got), _info_nce_numpy(np.asarray(za, np.float64),
                                                           np.asarray(zb, np.float64), 0.1),
                               rtol=1e-4)


def _encode(weights, batch):
    return jnp.tanh(batch["x"] @ weights)


def test_cache_refuses_another_encoder_and_resumes(tmp_path):
    mesh = make_mesh(data=-1)
    inputs = {"x": np.random.default_rng(0).normal(size=(50, 3)).astype(np.float32)}
    identity = {"encoder": {"architecture": "CLIPVisionModel", "sha256": "a" * 64},
                "preprocessing": {"image_size": 32}}
    folder = tmp_path / "image"
    weights = np.ones((3, 2), np.float32)
    part = cache.encode_to_cache(folder, identity, _encode, weights, inputs, 2, batch_size=16,
                                 mesh=mesh, progress=False, stop_after=2)
    assert cache.rows_done(folder) == 32 and np.all(part[32:] == 0)  # interrupted after 2 batches
    full = cache.encode_to_cache(folder, identity, _encode, weights, inputs, 2, batch_size=16,
                                 mesh=mesh, progress=False)
    assert cache.rows_done(folder) == 50
    np.testing.assert_allclose(full, np.tanh(inputs["x"] @ np.ones((3, 2))), rtol=1e-5)
    other = json.loads(json.dumps(identity))
    other["encoder"]["sha256"] = "b" * 64
    with pytest.raises(cache.StaleCache, match=r"encoder\.sha256") as e:
        cache.encode_to_cache(folder, other, _encode, weights, inputs, 2, batch_size=16, mesh=mesh,
                              progress=False)
    assert "\n" not in str(e.value)
    changed = {**identity, "preprocessing": {"image_size": 64}}
    with pytest.raises(cache.StaleCache, match="preprocessing.image_size=32"):
        cache.open_cache(folder, changed, 50, 2)


def test_batches_are_a_function_of_the_step():
    rows = np.arange(10, 47)
    steps = [stream.batch_rows(rows, 8, 0, s) for s in range(9)]
    epoch0 = np.concatenate(steps[:4])
    assert len(set(epoch0)) == 32 and set(epoch0) <= set(rows)  # 4 whole batches, no repeat
    assert not np.array_equal(steps[0], steps[4])  # a new order each epoch
    latents = {"image": np.arange(47 * 2, dtype=np.float32).reshape(47, 2),
               "text": np.arange(47, dtype=np.float32).reshape(47, 1)}
    sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    straight = list(stream.device_batches(latents, rows, 8, 0, 0, 9, sharding))
    resumed = list(stream.device_batches(latents, rows, 8, 0, 6, 9, sharding))
    for a, b in zip(straight[6:], resumed):
        np.testing.assert_array_equal(a["image"], b["image"])
    np.testing.assert_array_equal(straight[5]["text"][:, 0], steps[5])


def test_recall_counts_group_matches():
    sim = np.array([[0.9, 0.1, 0.0], [0.8, 0.2, 0.1], [0.0, 0.1, 0.5]])
    groups = np.array([0, 1, 1])
    r = retrieval.recall(sim, groups, ks=(1, 2))
    # image 0 -> text 0 (hit); image 1 -> text 0 (group 0: miss), text 1 second; image 2 -> text 2
    assert r["i2t_r1"] == pytest.approx(2 / 3) and r["i2t_r2"] == 1.0
    assert retrieval.chance(np.arange(10), ks=(1,))["r1"] == pytest.approx(0.1)


def _layer_norm(x, scale, bias, eps):
    mean = x.mean(-1, keepdims=True)
    return (x - mean) / np.sqrt(((x - mean) ** 2).mean(-1, keepdims=True) + eps) * scale + bias


def _gelu(x):
    from math import erf
    return 0.5 * x * (1 + np.vectorize(erf)(x / np.sqrt(2)))


def test_residual_adapter_matches_numpy():
    """The paper's adapter: blocks x + W2 gelu(W1 LN(x)) at the latent's width, LN, projection."""
    module, _ = model.make_loss(0, 2, 6, temperature=0.1, mixup_alpha=0.0, adapter="residual",
                                expansion=3)
    rng = np.random.default_rng(4)
    image, text = rng.normal(size=(5, 4)), rng.normal(size=(5, 3))
    params = module.init(jax.random.key(1), image, text)["params"]
    p = jax.tree.map(lambda v: np.asarray(v, np.float64), params)

    def adapter(q, x):
        for i in range(2):
            b = q[f"block{i}"]
            h = _layer_norm(x, b["norm"]["scale"], b["norm"]["bias"], model.PAPER_NORM_EPS)
            h = _gelu(h @ b["up"]["kernel"] + b["up"]["bias"])
            x = x + h @ b["down"]["kernel"] + b["down"]["bias"]
        x = _layer_norm(x, q["norm"]["scale"], q["norm"]["bias"], model.PAPER_NORM_EPS)
        return _unit(x @ q["project"]["kernel"] + q["project"]["bias"])

    assert p["image_adapter"]["block0"]["up"]["kernel"].shape == (4, 12)
    assert p["text_adapter"]["block1"]["down"]["kernel"].shape == (9, 3)
    za, zb = module.apply({"params": params}, image.astype(np.float32), text.astype(np.float32))
    np.testing.assert_allclose(za, adapter(p["image_adapter"], image), atol=1e-5)
    np.testing.assert_allclose(zb, adapter(p["text_adapter"], text), atol=1e-5)
    with pytest.raises(ValueError, match="choose one of mlp, residual"):
        model.make_loss(8, 2, 4, temperature=0.1, mixup_alpha=0.0, adapter="resnet")
