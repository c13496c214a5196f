"""The trainer's GPT at ZeRO stage 3 with FP8 weight gathers and FP8 matmuls
(``parallel.quantize_weights=fp8``, ``precision.autocast=fp8``, remat full) fetches its weights
on use, so each FP8 matmul reads the all-gathered e4m3 weight as it came off the wire (no
dequantize of the whole weight and cast again), on the 8 emulated devices; and it trains as the
same GPT does at stage 0 with FP8 matmuls and nothing gathered."""

import numpy as np
import pytest

from zeroflow.config.io import load_config
from zeroflow.trainer import build_run

pytestmark = pytest.mark.fast

WIDTH, HEADS, MLP, LAYERS, SEQ, BATCH = 64, 4, 128, 2, 32, 8
SHAPE = [
    f"model.embed_dim={WIDTH}",
    f"model.num_heads={HEADS}",
    f"model.mlp_dim={MLP}",
    f"model.num_layers={LAYERS}",
    f"model.seq_len={SEQ}",
    f"train.batch_size={BATCH}",
    "train.warmup_steps=0",
    "train.lr=3e-3",
    "precision.params=bf16",
    "precision.autocast=fp8",
    "precision.fp8_select=all",
    "model.remat=full",
]
STAGE3_FP8_GATHERS = ["parallel.zero_stage=3", "parallel.quantize_weights=fp8"]
HEAD_DIM = WIDTH // HEADS
# Each scanned layer's matrices, whole (as gathered): query/key/value, attention output, MLP.
LAYER_MATRICES = [
    f"{WIDTH}x{HEADS}x{HEAD_DIM}",
    f"{HEADS}x{HEAD_DIM}x{WIDTH}",
    f"{WIDTH}x{MLP}",
    f"{MLP}x{WIDTH}",
]


def config(*extra):
    return load_config("configs/tiny.yaml", SHAPE + list(extra))


def tokens(step):
    """Rows counting up from a random start (mod 256): learnable in a few steps."""
    start = np.random.default_rng(step).integers(0, 256, size=(BATCH, 1))
    return ((start + np.arange(SEQ + 1)) % 256).astype(np.int32)


def lowered_step(cfg):
    run = build_run(cfg, with_data=False)
    state = run.init_state()
    return run.make_step().lower(state, run.global_batch(tokens(0))).as_text()


@pytest.mark.parametrize("scaling", ["tensor", "delayed"])
def test_fp8_matmuls_read_the_gathered_e4m3_layer_weights_directly(scaling):
    text = lowered_step(config(*STAGE3_FP8_GATHERS, f"precision.fp8_scaling={scaling}"))
    assert "all_gather" in text
    for whole in LAYER_MATRICES:
        e4m3 = f"tensor<{whole}xf8E4M3FN>"
        assert f"{e4m3}) -> tensor<{whole}xf32>" not in text  # never dequantized whole
        assert f"{e4m3}) -> tensor<{whole}xbf16>" not in text
        # ... but read by a matmul as gathered (a reshape of the gathered shards)
        assert f", {e4m3}) -> tensor<" in text or f"({e4m3}, " in text, whole


def test_save_dots_keeps_the_per_layer_gather_and_its_dequantize():
    """Where fetching on use was not measured to help (remat save_dots: a 40% larger peak for
    gpt-1b with delayed scaling and 2 micro-batches), the layer is gathered whole by the model
    and each gathered e4m3 matrix dequantized before autocast casts it again."""
    text = lowered_step(config(*STAGE3_FP8_GATHERS, "model.remat=save_dots"))
    whole = f"{WIDTH}x{MLP}"
    assert f"tensor<{whole}xf8E4M3FN>) -> tensor<{whole}xf32>" in text


STEPS = 4


def losses(cfg):
    run = build_run(cfg, with_data=False)
    state, step, out = run.init_state(), run.make_step(), []
    for k in range(STEPS):
        state, metrics = step(state, run.global_batch(tokens(k)))
        out.append(float(metrics["loss"]))
    return np.array(out)


@pytest.mark.parametrize("scaling", ["tensor", "delayed"])
def test_training_matches_stage_0_fp8_without_gathers(scaling):
    """The same GPT, batches and FP8 recipe at stage 0 (weights whole on every device, nothing
    gathered; stage 3 without FP8 gathers gives its losses exactly) is the reference. With one
    scale per whole weight the gathered e4m3 matrices are rounded as stage 0's FP8 matmuls
    round them; what differs is the rounding to e4m3 of the matrices no FP8 matmul reads (the
    embedding and the head, gathered in e4m3 and read in bf16: up to 1/16 relative per entry),
    which reaches the loss through the updates. Measured: at most 0.0014 (current scaling) and
    0.001 (delayed) nats over four steps, 0.0029 for the per-layer route; 0.01 is ~3x the
    largest of those and 1/50 of the ~0.55 the four steps move the loss."""
    scale = f"precision.fp8_scaling={scaling}"
    got = losses(config(*STAGE3_FP8_GATHERS, scale))
    want = losses(config("parallel.zero_stage=0", scale))
    assert want[0] - want[-1] > 0.4  # the steps really train
    np.testing.assert_allclose(got, want, rtol=0, atol=0.01)
