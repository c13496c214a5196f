"""``python -m zeroflow.planner --fp8`` for abstract H100s and A100s (XLA:GPU, compiled without a
GPU): a 2-layer GPT of width 2048 at 8 x 1,024 tokens, stage 3, remat full. On the H100 the plan
is the one with FP8 matmuls, its plan without them compiled beside it with a longer XLA:GPU step
estimate; the A100 has no FP8 tensor cores and plans none. The overrides the planner writes,
compiled again, give the plan's peak with FP8 GEMMs in the program; FP8 weight gathers
all-gather e4m3 bytes."""
import json
import os
import subprocess
import sys

import pytest

from helpers import REPO, require_cuda_plugin

pytestmark = pytest.mark.slow

TINY = str(REPO / "configs" / "tiny.yaml")
WIDE = ["precision.params=bf16", "model.embed_dim=2048", "model.mlp_dim=8192",
        "model.num_heads=16", "model.num_layers=2", "model.seq_len=1024", "train.batch_size=8"]
FLAGS = ["--devices", "8", "--stages", "3", "--remats", "full", "--grad-accums", "1",
         "--attentions", "xla", "--no-zeropp", "--fp8"]


@pytest.fixture(scope="module")
def planned(tmp_path_factory):
    """The planner's command, run as typed (it restarts itself with XLA's scheduler logging)."""
    require_cuda_plugin()
    out = tmp_path_factory.mktemp("plans")
    env = {**os.environ, "PYTHONPATH": str(REPO), "JAX_PLATFORMS": "cpu"}
    env.pop("XLA_FLAGS", None)
    cmd = [sys.executable, "-m", "zeroflow.planner", "--config", TINY, "--gpus", "h100,a100",
           *FLAGS, "--out", str(out), *WIDE]
    done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=1200)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = {r["gpu"]: r for r in json.loads((out / "search.json").read_text())["rows"]}
    return rows, out, done.stdout


def compiled(choice_or_overrides):
    from zeroflow.config.io import apply_overrides, load_config
    from zeroflow.planner import where as places
    from zeroflow.planner.problems import ConfigProblem

    cfg = apply_overrides(load_config(TINY), WIDE)
    if isinstance(choice_or_overrides, list):  # as the trainer reads the written file
        from zeroflow.trainer.planning import compile_config

        cfg = apply_overrides(cfg, choice_or_overrides)
        par = cfg.parallel
        return compile_config(cfg, num_devices=8, stage=par.zero_stage, offload=par.offload,
                              update_on=par.update_on, remat=cfg.model.remat, target="h100")
    return ConfigProblem(cfg).compile(choice_or_overrides, places.target("h100", 8), {})


def test_the_h100_plan_has_fp8_matmuls_and_beat_its_plan_without(planned):
    rows, _, _ = planned
    best = rows["h100"]["best"]
    assert best["choice"]["autocast"] == "fp8" and "precision.autocast=fp8" in best["overrides"]
    twin = {**best["choice"], "autocast": None}
    same = [c for c in rows["h100"]["candidates"] if c["choice"] == twin]
    assert same and same[0]["status"] == "compiled", same
    assert best["step_ms"] < same[0]["xla"]["step_ms"]


def test_the_a100_plans_without_fp8_and_says_why(planned):
    rows, _, stdout = planned
    a100 = rows["a100"]
    assert not any(c["choice"]["autocast"] for c in a100["candidates"])
    assert a100["best"]["choice"]["autocast"] is None
    assert "a100 is sm_80" in stdout and "planned without them" in stdout


def test_the_written_overrides_compile_the_plans_peak_with_fp8_gemms(planned):
    from zeroflow.autocast.fp8_hlo import count_gemms
    from zeroflow.memory.measure import analysed, device_peak

    rows, out, _ = planned
    overrides = (out / "h100-x8.overrides").read_text().split()
    step, setup = compiled(overrides)
    peak = float(device_peak(analysed(step), setup.state))
    assert peak == pytest.approx(rows["h100"]["best"]["peak_bytes"], rel=1e-3)
    assert count_gemms(step.as_text()).fp8 > 0


def test_fp8_gathers_all_gather_e4m3_bytes():
    require_cuda_plugin()
    from zeroflow.planner.choices import Choice

    gathers = Choice(3, remat="full", attention="xla", quantize_weights="fp8", autocast="fp8")
    text = compiled(gathers)[0].as_text()
    shapes = [line.split(" = ", 1)[1].split(" all-gather")[0] for line in text.splitlines()
              if " all-gather-start(" in line or " all-gather(" in line]
    assert any("f8e4m3fn" in shape for shape in shapes), shapes[:5]
