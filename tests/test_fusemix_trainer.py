"""``python -m zeroflow.train`` with ``fusemix.enabled``: tiny CLIP vision and BERT folders made
with transformers, the digits encoded into the cache once, adapters trained at ZeRO-2 over 8
emulated devices; a run stopped mid-epoch and resumed equals the uninterrupted run."""
import json
import shutil

import pytest

pytestmark = pytest.mark.slow

pytest.importorskip("sklearn", reason="the digits come with scikit-learn (the fusemix extra)")
pytest.importorskip("transformers", reason="the encoders are made with transformers")

from helpers import REPO, load_script  # noqa: E402
from zeroflow.config.io import load_config  # noqa: E402
from zeroflow.fusemix.cache import rows_done  # noqa: E402
from zeroflow.fusemix.trainer import train_fusemix  # noqa: E402


@pytest.fixture(scope="module")
def encoders(tmp_path_factory):
    out = tmp_path_factory.mktemp("encoders")
    load_script("make_tiny_encoders").main(["--out", str(out), "--width", "32"])
    return out


@pytest.fixture(scope="module")
def latents(encoders, tmp_path_factory):
    """The digits' latent cache, encoded by the first run that asks for it and shared by the
    module's runs after (each finds it full and reads it): encoding 1797 pairs through both
    encoders is the same work for every test and proves nothing new the second time."""
    return tmp_path_factory.mktemp("fusemix") / "latents"


def _cfg(encoders, cache, run_dir, steps):
    return load_config(REPO / "configs" / "fusemix.yaml", [
        f"fusemix.image_encoder={encoders / 'vision'}", f"fusemix.text_encoder={encoders / 'text'}",
        f"fusemix.cache={cache}", f"run.dir={run_dir}", f"train.steps={steps}",
        "train.batch_size=64", "train.log_every=1", "train.eval_every=0", "checkpoint.every=3",
        "fusemix.adapter_hidden=32", "fusemix.shared_dim=16", "fusemix.val_pairs=100",
        "run.progress=false"])


def _losses(run_dir):
    return {r["step"]: r["loss"] for r in map(json.loads, open(run_dir / "metrics.jsonl"))
            if "loss" in r}


def test_resume_mid_epoch_is_exact(encoders, latents, tmp_path):
    cache = latents
    straight = train_fusemix(_cfg(encoders, cache, tmp_path / "a", 6))
    assert rows_done(cache / "image") == rows_done(cache / "text") == 1797
    # Interrupted after step 3 (22 batches an epoch): its folder holds step 3's checkpoint only.
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    shutil.rmtree(tmp_path / "b" / "checkpoints" / "6")
    (tmp_path / "b" / "metrics.jsonl").unlink()
    resumed = train_fusemix(_cfg(encoders, cache, tmp_path / "b", 6))
    a, b = _losses(tmp_path / "a"), _losses(tmp_path / "b")
    assert sorted(b) == [4, 5, 6] and [a[s] for s in (4, 5, 6)] == [b[s] for s in (4, 5, 6)]
    assert resumed.eval == straight.eval and set(straight.eval) == {
        f"{d}_r{k}" for d in ("i2t", "t2i") for k in (1, 5, 10)}
    assert a[1] != a[2]  # each step draws its own batch and mixup


def test_the_papers_residual_adapter_is_a_config_key(encoders, latents, tmp_path):
    # fusemix.adapter=residual trains the paper's adapter (its blocks at the latent's width,
    # each widened adapter_expansion times) through the trainer, not only in the experiments.
    import jax
    import numpy as np
    from zeroflow.fusemix.trainer import build_fusemix

    cfg = load_config(REPO / "configs" / "fusemix.yaml", [
        f"fusemix.image_encoder={encoders / 'vision'}", f"fusemix.text_encoder={encoders / 'text'}",
        f"fusemix.cache={latents}", f"run.dir={tmp_path / 'run'}", "train.steps=2",
        "train.batch_size=64", "train.eval_every=0", "fusemix.shared_dim=16",
        "fusemix.val_pairs=100", "run.progress=false", "fusemix.adapter=residual",
        "fusemix.adapter_layers=3", "fusemix.adapter_expansion=2"])
    run = build_fusemix(cfg, progress=False)
    params = jax.device_get(run.init_state().params)
    image = params["image_adapter"]
    assert sorted(k for k in image if k.startswith("block")) == ["block0", "block1", "block2"]
    width = run.latents["image"].shape[1]
    assert np.shape(image["block0"]["up"]["kernel"]) == (width, 2 * width)
    result = train_fusemix(cfg)
    # steps 2 and log_every 20: the first step (always) and the last are the ones logged
    assert result.step == 2 and list(result.losses) == [1, 2]
    assert all(np.isfinite(v) for v in result.losses.values())


# Every ``parallel`` key that configures the plan, with a value other than its default, and
# the ZeroPlan field it must reach; two groups because offload and ZeRO++ exclude each other.
PLAN_KEYS = {
    "zero_stage": "stage", "offload": "offload", "update_on": "update_on",
    "quantize_weights": "quantize_weights", "quantize_block": "quantize_block",
    "hierarchical": "hierarchical", "quantize_grads": "quantize_grads", "hosts": "hosts",
}
SETTINGS = [
    {"zero_stage": 3, "quantize_weights": "int8", "quantize_block": 128, "hierarchical": True,
     "quantize_grads": "int8", "hosts": 2},
    {"zero_stage": 2, "offload": "optimizer", "update_on": "host"},
]


def test_the_settings_cover_every_plan_key():
    # A parallel key added to the config but not to PLAN_KEYS fails here, not silently later.
    import dataclasses
    from zeroflow.config.schema import ParallelConfig
    mesh_and_batch = {"data", "context", "model", "grad_accum"}
    assert {f.name for f in dataclasses.fields(ParallelConfig)} - mesh_and_batch == set(PLAN_KEYS)
    assert set().union(*SETTINGS) == set(PLAN_KEYS)


@pytest.mark.parametrize("settings", SETTINGS, ids=["zero++", "offload"])
def test_fusemix_and_the_gpt_trainer_honour_every_parallel_setting(encoders, latents, tmp_path,
                                                                  settings):
    from zeroflow.fusemix.trainer import build_fusemix
    from zeroflow.trainer.setup import build_run

    overrides = [f"parallel.{k}={str(v).lower()}" for k, v in settings.items()]
    cfg = load_config(REPO / "configs" / "fusemix.yaml", [
        f"fusemix.image_encoder={encoders / 'vision'}", f"fusemix.text_encoder={encoders / 'text'}",
        f"fusemix.cache={latents}", f"run.dir={tmp_path / 'run'}",
        "run.progress=false", "precision.params=bf16", *overrides])
    gpt_cfg = load_config(REPO / "configs" / "tiny.yaml",
                          [f"run.dir={tmp_path / 'gpt'}", "precision.params=bf16", *overrides])
    for plan in (build_fusemix(cfg, progress=False).plan, build_run(gpt_cfg, with_data=False).plan):
        for key, value in settings.items():
            assert getattr(plan, PLAN_KEYS[key]) == value, (key, plan)
