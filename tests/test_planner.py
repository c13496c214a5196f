"""The planner (zeroflow.planner): its search picks the plan worked out by hand, never compiles
what the ZeRO formula proves cannot fit, lists on one device only the stages that can differ,
turns a refused compile into one line, and writes overrides the trainer runs as they are."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import optax
import pytest

import zeroflow as zf
from zeroflow.config.io import load_config
from zeroflow.planner.choices import Space, enumerate_choices
from zeroflow.planner.compiling import failure_reason
from zeroflow.planner.search import CANNOT_FIT, COMPILED

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parent.parent
WIDTH, LAYERS, BATCH = 256, 4, 32
P = LAYERS * WIDTH * WIDTH  # parameters of the MLP below
NONE = (("none", "device"),)


def mlp_loss(params, batch):
    x = batch["x"]
    for w in params["layers"]:
        x = jnp.tanh(x @ w)
    return jnp.mean((x - batch["y"]) ** 2)


def mlp():
    s = jax.ShapeDtypeStruct
    params = {"layers": [s((WIDTH, WIDTH), jnp.float32) for _ in range(LAYERS)]}
    batch = {"x": s((BATCH, WIDTH), jnp.float32), "y": s((BATCH, WIDTH), jnp.float32)}
    return params, batch


def plan_mlp(device_memory: int, **kw):
    params, batch = mlp()
    return zf.plan(mlp_loss, params, batch, optax.adam(1e-3), devices=(4,), stages=(0, 3),
                   offloads=NONE, grad_accums=(8,), zeropp=False, margin=0.0,
                   device_memory=device_memory, **kw)


def test_stage_0_when_the_model_fits_replicated():
    """fp32 Adam keeps 16 bytes per parameter; 4 GB holds that 1000 times over. Stage 0
    all-reduces the gradients once per step (2 x 4P bytes through each device); stage 3 with 8
    micro-batches gathers the weights twice and reduce-scatters the gradients per micro-batch
    (8 x (2 x 4P + 4P) = 96P bytes), more than one micro-batch's compute can hide: stage 0
    moves fewer bytes and wins."""
    plan = plan_mlp(4 * 10**9, min_compiles=2, max_compiles=2)
    best = plan.summaries()[0].best
    assert best is not None and best.choice.stage == 0
    assert {c.choice.stage for c in plan.rows[0].candidates if c.status == COMPILED} == {0, 3}


def test_stage_3_when_the_replicated_state_does_not_fit():
    """At 18 bytes per parameter the ZeRO formula expects stage 0 to fit (16P: fp32 weights,
    gradients and two moments), so it is compiled first (it moves fewer bytes); XLA's compile
    also holds the step's temporaries and does not fit. Stage 3 keeps 16P / 4 and fits: with one
    compile allowed, it is the last resort's (the open plan the formula predicts smallest)."""
    limit = 18 * P
    plan = plan_mlp(limit, max_compiles=1, min_compiles=1)
    row = plan.rows[0]
    stage0 = next(c for c in row.candidates if c.choice.stage == 0)
    assert stage0.status == COMPILED and stage0.measured.peak_bytes > limit
    assert row.best is not None and row.best.choice.stage == 3
    assert row.best.measured.peak_bytes <= limit


def test_a_peak_compiled_for_one_gpu_rules_the_plan_out_on_another():
    """XLA:GPU's peak of one program hardly depends on the GPU: stage 0 (20.1P bytes on four
    H100s), over the limit (18.5P) by more than ``OTHER_GPU_SPREAD``, is ruled out for four
    A100s with the same limit without a compile of its own; stage 3 (17.9P) is compiled for
    both and fits."""
    from zeroflow.backend import targets
    from zeroflow.planner.search import OTHER_GPU_SPREAD, RULED_OUT
    if not targets.plugin_installed():
        pytest.skip("compiling for GPU targets needs the CUDA plugin (jax-cuda12-plugin)")
    limit = int(18.5 * P)
    params, batch = mlp()
    plan = zf.plan(mlp_loss, params, batch, optax.adam(1e-3), targets=("h100", "a100"),
                   devices=(4,), stages=(0, 3), offloads=NONE, grad_accums=(8,), zeropp=False,
                   margin=0.0, device_memory=limit, min_compiles=1, max_compiles=2)
    h100, a100 = plan.rows
    first = next(c for c in h100.candidates if c.choice.stage == 0)
    assert first.status == COMPILED
    assert first.measured.peak_bytes > limit * (1 + OTHER_GPU_SPREAD)
    again = next(c for c in a100.candidates if c.choice.stage == 0)
    assert again.status == RULED_OUT and "on h100" in again.reason
    assert all(key[1:] != (a100.where, again.choice) for key in plan.compiler.results)
    assert a100.best is not None and a100.best.choice.stage == 3


def test_two_problems_compiled_in_the_same_plan_are_kept_apart(tmp_path):
    """The advice compiles one plan of a config with LoRA and with LoRA on 4-bit frozen
    weights: each problem keeps its own compile. Two models of different widths in the same
    plan (XLA:CPU, two devices): two compiles, the wider holding more; two configs differ in
    their key exactly where their settings differ."""
    from zeroflow.config.io import apply_overrides
    from zeroflow.planner import where as places
    from zeroflow.planner.choices import Choice
    from zeroflow.planner.compiling import Compiler, problem_key
    from zeroflow.planner.problems import ConfigProblem
    from zeroflow.planner.problems import ModelProblem
    params, batch = mlp()
    wide = {"layers": [jax.ShapeDtypeStruct((WIDTH, 2 * WIDTH), jnp.float32),
                       jax.ShapeDtypeStruct((2 * WIDTH, WIDTH), jnp.float32)]}
    compiler, here = Compiler(str(tmp_path)), places.local(2)
    choice = Choice(stage=3)
    narrow_got, wide_got = (
        compiler.measure(ModelProblem(mlp_loss, p, batch, optax.adam(1e-3), zf.Precision()),
                         choice, here) for p in (params, wide))
    assert compiler.compiles == 2 and wide_got.peak_bytes > narrow_got.peak_bytes
    lora = load_config(REPO / "configs" / "tiny.yaml", ["model.lora.rank=4"])
    nf4 = apply_overrides(lora, ["model.lora.quantize=nf4"])
    keys = [problem_key(ConfigProblem(c)) for c in (lora, nf4, apply_overrides(nf4, []))]
    assert keys[0] != keys[1] and keys[1] == keys[2]


def test_what_the_formula_rules_out_is_never_compiled():
    """Below 12P / 4 bytes (stage 3's sharded fp32 weights and moments) even the smallest
    plan's state cannot fit: nothing is compiled."""
    plan = plan_mlp(2 * P)
    row = plan.rows[0]
    assert plan.compiler.compiles == 0
    assert {c.status for c in row.candidates} == {CANNOT_FIT}
    assert row.best is None and "ZeRO formula" in row.candidates[0].reason


@pytest.mark.parametrize("dtype, stages", [("bf16", {0, 3}), ("fp32", {0})])
def test_one_device_lists_only_stages_that_differ(dtype, stages):
    """On one device every split is whole; stage 3 differs from stage 0 only by dropping the
    half-precision copy of the weights, which fp32 training never keeps."""
    found = enumerate_choices(Space(offloads=NONE), devices=1, batch_size=8, hosts=1,
                              compute_dtype=dtype)
    assert {c.stage for c in found} == stages
    assert all(c.quantize_weights is None and c.quantize_grads is None for c in found)
    assert {c.stage for c in enumerate_choices(Space(offloads=NONE), devices=2, batch_size=8,
                                               hosts=1, compute_dtype=dtype)} == {0, 1, 2, 3}


def test_plans_xla_refuses_are_skipped_with_its_reason():
    """XLA:GPU cannot schedule remat offload_dots at stages 0-1; on XLA:CPU it compiles."""
    from zeroflow.planner.choices import Choice, known_failure
    refused = known_failure(Choice(stage=1, remat="offload_dots"), gpu=True)
    assert "FindAndExtractBestNodeAvailable" in refused
    assert known_failure(Choice(stage=2, remat="offload_dots"), gpu=True) is None
    assert known_failure(Choice(stage=0, remat="offload_dots"), gpu=False) is None


def test_a_refused_compile_is_one_readable_line():
    xla = RuntimeError("INTERNAL: FindAndExtractBestNodeAvailable failed to find a node to "
                       "schedule\n\tat ... 40 more lines")
    assert "offload_dots" in failure_reason(xla) and "\n" not in failure_reason(xla)
    other = ValueError("batch size 8 does not divide by data axis size 3\nmore")
    assert failure_reason(other) == "ValueError: batch size 8 does not divide by data axis size 3"


def test_written_overrides_train(tmp_path):
    """The planner's overrides for this machine run the trainer as they are."""
    from helpers import one_cpu_env  # here: GPU_PLAN's process imports this module without tests/

    # Every program to the test run's compilation cache: the trainer loads the step the
    # planner compiled where the two are the same program.
    env = one_cpu_env(cache_every_program=True)
    # The config's model shrunk for both commands: what is checked is that the planner's
    # overrides run the trainer, which no model size changes; compiling is the time here.
    shrunk = ["model.num_layers=1", "model.embed_dim=32", "model.num_heads=2", "model.mlp_dim=64",
              "model.seq_len=32", "train.batch_size=8"]
    out = tmp_path / "plan"
    planned = subprocess.run(
        [sys.executable, "-m", "zeroflow.planner", "--config", "configs/tiny.yaml", *shrunk,
         "--devices", "1", "--out", str(out), "--remats", "full", "--max-compiles", "1",
         "--min-compiles", "1"], cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert planned.returncode == 0, planned.stderr[-2000:]
    assert "No --gpus given" in planned.stdout
    # piped: its own progress, a line per compile
    assert re.search(r"^zeroflow\.planner: compile \d+ of \d+ done", planned.stderr, re.M)
    overrides = (out / "cpu-x1.overrides").read_text().split()
    assert "parallel.data=1" in overrides and "model.remat=full" in overrides
    run = tmp_path / "run"
    trained = subprocess.run(
        [sys.executable, "-m", "zeroflow.train", "--config", "configs/tiny.yaml", *shrunk,
         *overrides, "data.max_bytes=100000", "train.steps=2", "train.eval_every=0",
         "checkpoint.every=0", "run.plot=false", f"run.dir={run}"],  # plot: not read here
        cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert trained.returncode == 0, trained.stderr[-2000:]
    assert (run / "metrics.jsonl").exists()
    saved = load_config(out / "cpu-x1.yaml")
    assert saved.parallel.data == 1 and saved.model.remat == "full"


def test_bad_device_counts_are_one_line():
    params, batch = mlp()
    with pytest.raises(ValueError, match="positive ints"):
        zf.plan(mlp_loss, params, batch, optax.adam(1e-3), devices=(0,))
    with pytest.raises(ValueError, match="margin"):
        zf.plan(mlp_loss, params, batch, optax.adam(1e-3), devices=(2,), margin=1.5)


GPU_PLAN = """
import json, jax, jax.numpy as jnp, optax
import zeroflow as zf
from tests.test_planner import mlp, mlp_loss, NONE
params, batch = mlp()
plan = zf.plan(mlp_loss, params, batch, optax.adam(1e-3), targets=("h100",), devices=(2,),
               stages=(0, 3), offloads=NONE, grad_accums=(8,), zeropp=False,
               min_compiles=2, max_compiles=2)
s = plan.summaries()[0]
row = plan.as_json()["rows"][0]
print(json.dumps({"best": s.best.choice.stage, "costed": s.step_costed_by,
                  "steps": {c["choice"]["stage"]: c["xla"]["step_ms"] for c in row["candidates"]
                            if "xla" in c},
                  "exposed": {c["choice"]["stage"]: c["xla"]["exposed_ms"]
                              for c in row["candidates"] if "xla" in c}}))
"""


def test_xla_gpu_estimate_picks_stage_0_over_stage_3():
    """The same hand ranking by XLA:GPU's own step estimate for 2 abstract H100s: stage 3's
    per-micro-batch gathers and reductions wait on the interconnect where stage 0's single
    all-reduce does not (two small XLA:GPU compiles, in a process started with the
    scheduler's logging, which XLA reads at start-up)."""
    from zeroflow.backend import targets
    from zeroflow.xla import schedule
    if not targets.plugin_installed():
        pytest.skip("compiling for GPU targets needs the CUDA plugin (jax-cuda12-plugin)")
    env = schedule.enable({**os.environ, "PYTHONPATH": str(REPO), "JAX_PLATFORMS": "cpu"})
    env.pop("XLA_FLAGS", None)
    done = subprocess.run([sys.executable, "-c", GPU_PLAN], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=1200)
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert got["best"] == 0, got
    assert got["steps"]["0"] < got["steps"]["3"], got
    assert got["costed"] in ("xla", "xla-target"), got
