"""Tensor parallelism composed with ZeRO, and checkpoints that reshard, on 8 emulated devices."""
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import zeroflow as zf
from zeroflow.engine.checkpoint import CheckpointError
from zeroflow.config.schema import ModelConfig
from zeroflow.models import init_params, make_loss_fn
from zeroflow.models.rules import gpt_tensor_rules
from fixtures import BATCHES, init_params as mlp_params, loss_fn as mlp_loss, make_tx
from helpers import assert_leaves_close, one_cpu_env, train_losses

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
GPT_CFG = ModelConfig(vocab_size=256, seq_len=16, num_layers=1, embed_dim=32, num_heads=2,
                      mlp_dim=64, tie_embeddings=False)
# Rules for a model zeroflow has never seen: the engine tests' Flax MLP.
MLP_RULES = [("Dense_0/kernel", P(None, "model")), ("Dense_0/bias", P("model")),
             ("Dense_1/kernel", P("model", None))]


def gpt_batches(n=2):
    rng = np.random.default_rng(0)
    return [{"tokens": rng.integers(0, 256, size=(16, GPT_CFG.seq_len + 1), dtype=np.int32)} for _ in range(n)]


def run_gpt(data, model, stage):
    plan = zf.ZeroPlan(zf.make_mesh(data=data, model=model), stage=stage,
                       tensor_rules=gpt_tensor_rules(GPT_CFG, model) if model > 1 else ())
    prec, tx = zf.Precision(), optax.adamw(1e-2)
    params, _ = init_params(GPT_CFG, jax.random.key(0))
    state = zf.init_train_state(params, tx, plan, prec)
    step = zf.make_train_step(make_loss_fn(GPT_CFG), tx, plan, prec)
    losses, state, _ = train_losses(step, state, gpt_batches())
    return np.array(losses), state


@pytest.mark.parametrize("stage", [1, 3])
def test_mlp_tensor_parallel_matches_data_parallel(stage):
    ref, ref_state = _mlp_run(zf.ZeroPlan(zf.make_mesh(data=8, model=1), stage=stage), zf.Precision(), BATCHES)
    plan = zf.ZeroPlan(zf.make_mesh(data=4, model=2), stage=stage, tensor_rules=MLP_RULES)
    got, state = _mlp_run(plan, zf.Precision(), BATCHES)
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-6)
    assert_leaves_close(state.master_params, ref_state.master_params, rtol=1e-4, atol=1e-5)
    kernel = state.master["Dense_0"]["kernel"]
    assert kernel.sharding.spec == P("data", "model")  # column-parallel and ZeRO at once
    assert kernel.addressable_shards[0].data.shape == (24 // 4, 64 // 2)


def test_gpt_tensor_parallel_matches_data_parallel():
    """The GPT's logical-axis rules table: heads/mlp/vocab over model, ZeRO-3 over data."""
    stage = 3
    ref, ref_state = run_gpt(8, 1, stage)
    got, state = run_gpt(4, 2, stage)
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-6)
    # Adam divides by sqrt(nu), so for a weight whose gradient is near zero a different
    # summation order (TP splits the matmuls) can move it by ~1e-5: 0.1% of one lr=1e-2 step.
    assert_leaves_close(state.master_params, ref_state.master_params, rtol=1e-4, atol=1e-4)
    query = state.master["layers"]["attn"]["query"]["kernel"]  # [layers, embed, heads, head_dim]
    assert query.sharding.spec[2] == "model"  # heads split over model
    assert query.addressable_shards[0].data.shape[2] == GPT_CFG.num_heads // 2
    down = state.master["layers"]["mlp"]["down"]["kernel"]  # [layers, mlp, embed]: row-parallel
    assert down.sharding.spec[1] == "model"
    assert "data" in tuple(query.sharding.spec)  # ...and ZeRO over data at the same time
    mu = state.opt_state[0].mu["layers"]["attn"]["query"]["kernel"]
    assert mu.sharding == query.sharding  # optimizer state follows its parameter


def _mlp_run(plan, prec, batches, state=None):
    tx = make_tx()
    state = state if state is not None else zf.init_train_state(mlp_params(), tx, plan, prec)
    step = zf.make_train_step(mlp_loss, tx, plan, prec)
    losses, state, _ = train_losses(step, state, batches)
    return losses, state


def test_checkpoint_from_8x1_stage3_resumes_on_4x2_stage1(tmp_path):
    batches = BATCHES + BATCHES[:2]  # 6 steps
    straight, _ = _mlp_run(zf.ZeroPlan(zf.make_mesh(), stage=3), zf.Precision(), batches)

    first, state = _mlp_run(zf.ZeroPlan(zf.make_mesh(data=8, model=1), stage=3), zf.Precision(), batches[:3])
    zf.save_checkpoint(tmp_path / "ckpt", state)

    target_plan = zf.ZeroPlan(zf.make_mesh(data=4, model=2), stage=1, tensor_rules=MLP_RULES)
    like = zf.init_train_state(mlp_params(), make_tx(), target_plan, zf.Precision())
    restored = zf.restore_checkpoint(tmp_path / "ckpt", like=like)
    assert int(restored.step) == 3
    kernel = restored.master["Dense_0"]["kernel"]
    assert kernel.sharding.spec == P("data", "model")
    rest, _ = _mlp_run(target_plan, zf.Precision(), batches[3:], state=restored)
    np.testing.assert_allclose(first + rest, straight, rtol=1e-5, atol=1e-6)


def test_checkpoint_restores_onto_one_device_and_with_offload(tmp_path):
    _, state = _mlp_run(zf.ZeroPlan(zf.make_mesh(), stage=3), zf.Precision(params="bf16"), BATCHES[:1])
    zf.save_checkpoint(tmp_path / "ckpt", state)
    one = zf.ZeroPlan(zf.make_mesh(devices=jax.devices()[:1]), stage=0)
    like = zf.init_train_state(mlp_params(), make_tx(), one, zf.Precision())
    restored = zf.restore_checkpoint(tmp_path / "ckpt", like=like)
    assert len(restored.master["Dense_0"]["kernel"].sharding.device_set) == 1
    np.testing.assert_array_equal(np.asarray(restored.master["Dense_0"]["kernel"]),
                                  np.asarray(state.master["Dense_0"]["kernel"]))
    off = zf.ZeroPlan(zf.make_mesh(), stage=1, offload="optimizer")
    like = zf.init_train_state(mlp_params(), make_tx(), off, zf.Precision(params="bf16"))
    restored = zf.restore_checkpoint(tmp_path / "ckpt", like=like)
    assert restored.master["Dense_0"]["kernel"].sharding.memory_kind == "pinned_host"
    assert restored.params["Dense_0"]["kernel"].dtype == jnp.bfloat16


def test_restore_onto_mismatched_tree_is_a_clear_error(tmp_path):
    _, state = _mlp_run(zf.ZeroPlan(zf.make_mesh(), stage=1), zf.Precision(), BATCHES[:1])
    zf.save_checkpoint(tmp_path / "ckpt", state)
    plan = zf.ZeroPlan(zf.make_mesh(), stage=1)
    other = zf.init_train_state({"w": jnp.ones((8, 8))}, make_tx(), plan, zf.Precision())
    with pytest.raises(CheckpointError, match="does not match the target state: missing in checkpoint: master/w"):
        zf.restore_checkpoint(tmp_path / "ckpt", like=other)
    with pytest.raises(CheckpointError, match="no checkpoint at"):
        zf.restore_checkpoint(tmp_path / "nothing", like=other)


def test_cli_trains_with_tensor_parallel_model_axis(tmp_path):
    env = one_cpu_env()
    proc = subprocess.run(
        [sys.executable, "-m", "zeroflow.train", "--config", "configs/tiny.yaml", "--cpu-devices", "4",
         "parallel.data=2", "parallel.model=2", "parallel.zero_stage=3", "model.num_layers=1",
         "model.embed_dim=32", "model.num_heads=2", "model.mlp_dim=64", "model.seq_len=32",
         "train.batch_size=8", "train.steps=3", "train.eval_every=0", "train.log_every=1",
         "data.max_bytes=400000", "run.progress=false", f"run.dir={tmp_path}",
         "run.plot=false"],  # not read here; drawing it costs the run about 2 s of CPU
        cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    assert "mesh: {'data': 2, 'model': 2}" in proc.stdout.replace("\n", "")
    assert (tmp_path / "metrics.jsonl").read_text().count('"loss"') == 3
