"""The model FLOPs behind an MFU are one count, read alike by the trainer's reports and the
planner: with LoRA or train.freeze a frozen weight costs 4 per token (forward 2, its input's
gradient 2), a trained one 6, an adapter element 6. Checked against a count by hand of
configs/tiny.yaml's GPT (4 layers, width 128, 4 heads of 32, SwiGLU 384, 256 bytes, tied)."""
from pathlib import Path

import pytest

from zeroflow.config.io import apply_overrides, load_config

pytestmark = pytest.mark.fast

REPO = Path(__file__).resolve().parent.parent
L, E, H, D, M, V, S, BATCH = 4, 128, 4, 32, 384, 256, 128, 16
ATTN_W, MLP_W, HEAD_W = L * 4 * E * H * D, L * 3 * E * M, V * E  # head: the tied embedding
ATTN = 12 * L * H * D * S  # scores and weighted values, forward and backward
R = 4
ADAPTERS = L * R * (4 * (E + H * D) + 3 * (E + M))  # r x (in + out) per adapted projection
HAND = {
    "train.freeze=attn/": 4 * ATTN_W + 6 * (MLP_W + HEAD_W) + ATTN,
    f"model.lora.rank={R}": 4 * (ATTN_W + MLP_W + HEAD_W) + 6 * ADAPTERS + ATTN,
}


def _config(override: str, run_dir: Path):
    cfg = load_config(REPO / "configs" / "tiny.yaml", [override])
    return apply_overrides(cfg, [f"run.dir={run_dir}", "run.plot=false"])


@pytest.mark.parametrize("override", list(HAND))
def test_the_trainers_reports_count_frozen_weights_at_4(override, tmp_path):
    from zeroflow.trainer.loop import _reporter
    from zeroflow.trainer.setup import build_run

    run = build_run(_config(override, tmp_path), with_data=False)
    reporter = _reporter(run, 0, False, resumed=False)
    try:
        assert reporter.flops_per_token == pytest.approx(HAND[override], rel=1e-9)
    finally:
        reporter.close(failing=False)


@pytest.mark.parametrize("override", list(HAND))
def test_the_planner_counts_the_same(override, tmp_path):
    from zeroflow.planner.problems import ConfigProblem

    problem = ConfigProblem(_config(override, tmp_path))
    assert problem.model_flops() == pytest.approx(HAND[override] * BATCH * S, rel=1e-9)


def test_zf_plans_count_is_6_per_trained_and_4_per_frozen_param():
    """``zf.plan``'s problem (any JAX loss): two 8 x 8 weights, the first frozen, 4 examples of
    3 tokens."""
    import jax
    import jax.numpy as jnp
    import optax

    from zeroflow.autocast.precision import Precision
    from zeroflow.planner.problems import ModelProblem

    def loss(params, batch):
        return jnp.mean((batch["x"] @ params["a"] @ params["b"]) ** 2)

    s = jax.ShapeDtypeStruct
    params = {"a": s((8, 8), jnp.float32), "b": s((8, 8), jnp.float32)}
    problem = ModelProblem(loss, params, {"x": s((4, 8), jnp.float32)}, optax.adam(1e-3),
                           Precision(), trainable=lambda path, _: path != "a",
                           tokens_per_example=3)
    assert problem.model_flops() == (4 * 64 + 6 * 64) * 4 * 3
