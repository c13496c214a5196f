"""A step that never needs jax's Pallas Triton module (deprecated in jax 0.11, to be removed):
with the module unimportable, zeroflow imports, trains at every ZeRO stage with XLA attention,
and compiles its step with cuDNN attention for an H100 (tests/without_triton.py)."""
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from fixtures import TINY_TRAINER
from helpers import one_cpu_env

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
SHRUNK = [*TINY_TRAINER, "data.max_bytes=400000", "train.warmup_steps=2", "train.steps=3",
          "train.eval_every=3", "run.plot=false", "run.tensorboard=false"]


def test_train_and_compile_without_the_triton_module(tmp_path):
    env = one_cpu_env()
    # Two CPU devices, so that stages 1-3 shard the state.
    env["XLA_FLAGS"] += " --xla_force_host_platform_device_count=2"
    proc = subprocess.run([sys.executable, str(REPO / "tests" / "without_triton.py"),
                           str(tmp_path), *SHRUNK], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=1500)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert {"__cudnn$fmhaSoftmax", "__cudnn$fmhaSoftmaxBackward"} <= set(report["custom_calls"])
    for stage in range(4):
        rows = [json.loads(line)
                for line in (tmp_path / f"stage{stage}" / "metrics.jsonl").read_text().splitlines()]
        losses = [r["loss"] for r in rows if "loss" in r]
        assert len(losses) == 3 and all(math.isfinite(x) for x in losses), (stage, losses)
        # An untrained byte-level model predicts about uniformly: ln(256) nats per byte.
        assert abs(losses[0] - math.log(256)) < 0.3, (stage, losses)
