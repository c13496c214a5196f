"""The tiny config trained by the trainer with delayed FP8 scaling (every eligible matmul in
FP8, the amax histories carried in the train state) against its own bf16 run on the same
batches: the mean loss of the last 20 steps within 2%. 60 steps each here; the 300-step
comparison is ``experiments/fp8.py``'s "fp8 delayed" run (experiments/results/fp8.md)."""
from pathlib import Path

import numpy as np
import pytest

from zeroflow.config.io import load_config
from zeroflow.trainer import build_run, train
from zeroflow.trainer.checkpoints import RunCheckpoints

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
STEPS = 60
COMMON = [f"train.steps={STEPS}", "train.log_every=1", "train.eval_every=0",
          "checkpoint.every=0", "run.tensorboard=false", "run.plot=false", "run.progress=false"]


def tiny_run(run_dir, precision):
    cfg = load_config(REPO / "configs" / "tiny.yaml", COMMON + precision + [f"run.dir={run_dir}"])
    result = train(cfg)
    return cfg, np.array([result.losses[k] for k in sorted(result.losses)])


def test_tiny_config_with_delayed_fp8_scaling_trains_within_2_percent_of_bf16(tmp_path):
    _, ref = tiny_run(tmp_path / "bf16", ["precision.autocast=bf16"])
    cfg, got = tiny_run(tmp_path / "fp8", ["precision.autocast=fp8", "precision.fp8_select=all",
                                          "precision.fp8_scaling=delayed"])
    assert len(ref) == len(got) == STEPS
    assert ref[-20:].mean() < 0.75 * ref[:5].mean()  # it learned something
    assert abs(got[-20:].mean() - ref[-20:].mean()) < 0.02 * ref[-20:].mean()
    assert not np.array_equal(got, ref)  # the FP8 rounding changed the run
    # the final checkpoint carries a filled amax history per FP8 matmul
    checkpoints = RunCheckpoints(cfg.run.dir + "/checkpoints", 3, read_only=True)
    state, _ = checkpoints.read(build_run(cfg, with_data=False).abstract_state(), STEPS)
    checkpoints.close()
    assert state.fp8
    for site in state.fp8.values():
        for meta in site:
            assert np.all(np.asarray(meta.history).max(axis=-1) > 0)
