"""The GPU report's fp8 stage (scripts/gpureport/stages/fp8.py): what it plans for a GPU with
and without FP8 tensor cores, the targets and tables it computes from records, the GEMM item
run on the CPU (XLA:CPU computes with the float8 types), and (slow) every item of the stage
run by the report in --quick, each in its own process as on the GPU."""
from __future__ import annotations

import dataclasses
import json
import math
import sys
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / "scripts")]

from benchlib import fp8 as bench_fp8  # noqa: E402
from benchlib.gpt import spec_key  # noqa: E402
from benchlib.isolate import load_target  # noqa: E402
from gpureport import files, render, targets  # noqa: E402
from gpureport.profiles import FULL, QUICK, STAGE_ORDER  # noqa: E402
from gpureport.runner import Context, Item, Outcome, Runner, Summary  # noqa: E402
from gpureport.session import RunOptions, run_report  # noqa: E402
from gpureport.stages import fp8  # noqa: E402
from helpers import one_cpu_env, printed_by  # noqa: E402

A100 = {"backend": "gpu", "device_kind": "NVIDIA A100-SXM4-80GB", "compute_capability": "8.0"}
H100 = {"backend": "gpu", "device_kind": "NVIDIA H100 80GB HBM3", "compute_capability": "9.0"}
FP8_TARGETS = ("FP8 GEMM", "FP8 step")


def _env_record(env: dict) -> dict:
    return {"stage": "env", "item": "environment", "case": "", "status": "ok", "result": env,
            "seconds": 1.0, "elapsed_s": 1.0}


def _planned(profile, env: dict) -> list:
    """The fp8 plan's steps for a run whose env stage found ``env``, every item answered ok."""
    steps = fp8.plan(Context(profile, host={}, records=[_env_record(env)], stages=STAGE_ORDER))
    out, sent = [], None
    while True:
        try:
            step = steps.send(sent)
        except StopIteration:
            return out
        out.append(step)
        sent = None if isinstance(step, Summary) else Outcome("ok", [])


def _fp8_targets(records: list[dict]) -> dict:
    return {t.name.split(" ")[0] + " " + t.name.split(" ")[1]: t for t in targets.evaluate(records)
            if t.name.startswith(FP8_TARGETS)}


# --------------------------------------------------------------------------- the plan
@pytest.mark.fast
def test_a_gpu_without_fp8_tensor_cores_gets_one_not_applicable_record(tmp_path):
    """An A100 (sm_80): no item starts; one record says why, and the report's section and both
    FP8 targets show it. Without a compute capability in the env record, the accelerator
    table decides."""
    report = files.ReportFiles(tmp_path, render.render, render.summarize, echo=lambda line: None)
    report.add(_env_record(A100))
    runner = Runner(report.add, lambda line: None, deadline=math.inf, workdir=tmp_path, child_vars={})
    ctx = Context(FULL, host={}, records=report.records, stages=STAGE_ORDER)
    runner.run_stage("fp8", fp8.plan, ctx, budget_s=FULL.budgets["fp8"])
    [record] = [r for r in report.records if r["stage"] == "fp8"]
    assert (record["item"], record["status"]) == ("fp8", "unavailable")
    assert record["note"].startswith("not applicable: ") and "sm_80" in record["note"]
    assert "needs FP8 tensor cores" in record["note"] and "A100" in record["note"]
    text = (tmp_path / files.REPORT_MD).read_text()
    assert "## FP8\n\n_Not applicable: " in text
    found = _fp8_targets(report.records)
    assert len(found) == 2
    assert all(t.value == record["note"] and t.met is None for t in found.values())

    without_capability = {k: v for k, v in A100.items() if k != "compute_capability"}
    [summary] = _planned(FULL, without_capability)
    assert isinstance(summary, Summary) and summary.status == "unavailable"
    assert summary.note == ("not applicable: NVIDIA A100-SXM4-80GB has no FP8 tensor cores "
                            "(zeroflow/backend/accelerators.py)")


@pytest.mark.fast
@pytest.mark.parametrize("env", [H100, {**H100, "compute_capability": "8.9", "device_kind": "NVIDIA L4"},
                                 {"backend": "cpu", "device_kind": "cpu"}])
def test_a_gpu_with_fp8_and_the_cpu_get_every_item_in_priority_order(env):
    steps = _planned(FULL, env)
    assert all(isinstance(step, Item) for step in steps)
    assert [s.name for s in steps] == ["fp8 GEMM 8192^3", "fp8 step", "fp8 saved activations save_dots/compute",
                                       "fp8 saved activations save_dots/fp8"]
    for step in steps:
        load_target(step.target)
        json.dumps(step.kwargs)
        assert step.timeout_s <= 2 * FULL.budgets["fp8"] and step.min_s < FULL.budgets["fp8"] / 2
    gemm, step, compute, saved = steps
    # only the headline may run past the stage's budget
    assert [s.timeout_s <= FULL.budgets["fp8"] for s in steps] == [True, False, True, True]
    assert gemm.kwargs == {"size": 8192, "warmup": 3, "iters": 20}
    labels = [(label, autocast, fields.get("fp8_scaling", "tensor")) for label, autocast, fields
              in step.kwargs["variants"]]
    assert labels == [("bf16 autocast", "bf16", "tensor"), ("fp8 tensor", "fp8", "tensor"),
                      ("fp8 delayed", "fp8", "delayed")]
    assert step.kwargs["base"]["params"] == "bf16" and step.kwargs["base"]["model"]["num_layers"] == 18
    # the compute-dtype run is the training stage's run of the same configuration (reused)
    [training] = [spec for label, spec in FULL.training_runs
                  if label == "gpt-1b cudnn remat=save_dots batch=16"]
    assert compute.key == spec_key(training) and saved.key != compute.key
    assert saved.kwargs["model"]["remat_dtype"] == "fp8"


@pytest.mark.fast
def test_the_stage_runs_right_after_training_within_the_time_limit():
    """fp8 comes after training, so that a first call reaches it: the budgets of the stages up
    to it fit the 540 s limit."""
    assert STAGE_ORDER.index("fp8") == STAGE_ORDER.index("training") + 1
    before = STAGE_ORDER[:STAGE_ORDER.index("fp8") + 1]
    assert sum(FULL.budgets[s] for s in before) <= FULL.time_limit_s + FULL.budgets["env"] / 2


# --------------------------------------------------------------------------- targets and tables
def _record(item, result, case=""):
    return {"stage": "fp8", "item": item, "case": case, "status": "ok", "result": result}


def _records():
    gemm = {"size": 8192, "pass": "fwd", "bf16": {"ms": 2.0, "tflops": 550.0, "speedup": 1.0},
            "e4m3": {"ms": 1.18, "tflops": 932.0, "speedup": 2.0 / 1.18},
            "scaled_dot": {"ms": 1.6, "tflops": 687.0, "speedup": 2.0 / 1.6}}
    variant = {"compiled": {"temp_bytes": 5e9}, "gemms": {"fp8": 0, "other": 126}, "speedup_iqr": [1, 1],
               "loss": 10.3, "loss_finite": True}
    head = {"baseline": "bf16 autocast", "params": 0.99e9, "tokens_per_step": 8192, "steps": 8}
    # one case per FP8 variant, each against the baseline timed in its own rounds
    tensor = {**head, "allocated_peak_all": 40e9, "variants": {
        "bf16 autocast": {**variant, "step_s": 0.4, "tokens_per_s": 20480.0, "speedup": 1.0},
        "fp8 tensor": {**variant, "step_s": 0.35, "tokens_per_s": 23405.7, "speedup": 0.4 / 0.35}}}
    delayed = {**head, "allocated_peak_all": 50e9, "variants": {
        "bf16 autocast": {**variant, "step_s": 0.41, "tokens_per_s": 19980.5, "speedup": 1.0},
        "fp8 delayed": {**variant, "step_s": 0.32, "tokens_per_s": 25600.0, "speedup": 0.4 / 0.32}}}
    saved = [_record(f"fp8 saved activations save_dots/{dtype}",
                     {"params": 0.99e9, "tokens_per_s": 30000.0, "loss": 10.3,
                      "memory": {"allocated_peak": peak, "compiled": {"total_bytes": total}}})
             for dtype, peak, total in (("compute", 40e9, 38e9), ("fp8", 32e9, 30.4e9))]
    return [_record("fp8 GEMM 8192^3", gemm, "8192^3 fwd"),
            _record("fp8 step", tensor, "bf16 autocast vs fp8 tensor"),
            _record("fp8 step", delayed, "bf16 autocast vs fp8 delayed")] + saved


@pytest.mark.fast
def test_fp8_targets_from_records():
    found = _fp8_targets(_records())
    gemm, step = found["FP8 GEMM"], found["FP8 step"]
    assert gemm.value.startswith("1.69x at 8192^3 (932 TFLOP/s)") and gemm.met  # 2.0 / 1.18
    assert "(scaled_dot) 1.25x" in gemm.value
    assert step.value == "fp8 tensor 1.14x, fp8 delayed 1.25x" and step.met  # 0.4/0.35, 0.4/0.32
    slower = _records()
    slower[2]["result"]["variants"]["fp8 delayed"]["speedup"] = 1.1
    assert _fp8_targets(slower)["FP8 step"].met is False
    assert {t.value for t in _fp8_targets([]).values()} == {"not measured"}


@pytest.mark.fast
def test_fp8_section_tables_from_records():
    text = "\n".join(fp8.render(_records()))
    assert "| 8192^3 | fwd | e4m3 | 2.000 | 1.180 | 550.0 | 932.0 | 1.69x |" in text
    assert "| fp8 delayed | 25,600 | 320.0 | 1.25x | 1.00-1.00 | 0/126 | 5.00 GB | 10.300 |" in text
    assert "| bf16 autocast | 20,480 | 400.0 | 1.00x |" in text  # the first comparison's baseline
    assert text.count("| bf16 autocast |") == 1 and "(all variants): 50.00 GB." in text
    # allocated peak 32 / 40 GB, compiled 30.4 / 38 GB
    assert "| save_dots/fp8 | 990M | 32.00 GB | 0.80x | 30.40 GB | 0.80x | 30,000 | 10.300 |" in text
    assert "not applicable" not in text.lower()


# --------------------------------------------------------------------------- the GEMM item, here
@pytest.mark.fast
def test_the_gemm_item_computes_fp8_products_on_the_cpu():
    """The GEMM item's cases on the CPU: every figure the renderer reads, each speed-up the
    ratio of the medians; and its e4m3 product is the quantized operands' product (NumPy)."""
    results = {case.name: case.run() for case in bench_fp8.gemm_cases(32, warmup=1, iters=2)}
    assert list(results) == ["32^3 fwd", "32^3 fwd+bwd"]
    forward, backward = results.values()
    for res, impls, flops in ((forward, ("bf16", "e4m3", "scaled_dot"), 2 * 32**3),
                              (backward, ("bf16", "scaled_dot"), 6 * 32**3)):
        for impl in impls:
            got = res[impl]
            assert got["tflops"] == pytest.approx(flops / (got["ms"] / 1e3) / 1e12)
            assert got["speedup"] == pytest.approx(res["bf16"]["ms"] / got["ms"], rel=1e-9)
    # the progress line's figure: the FP8 GEMM alone forward, scaled_dot forward+backward
    assert (forward["fp8_speedup"], backward["fp8_speedup"]) == (
        forward["e4m3"]["speedup"], backward["scaled_dot"]["speedup"])
    import jax.numpy as jnp

    from zeroflow.autocast import fp8 as zf_fp8
    a, b, _ = bench_fp8.random_operands(32)
    s_a, s_b = zf_fp8.scale_of(a, zf_fp8.E4M3), zf_fp8.scale_of(b, zf_fp8.E4M3)
    q_a, q_b = zf_fp8.quantize(a, s_a, zf_fp8.E4M3), zf_fp8.quantize(b, s_b, zf_fp8.E4M3)
    want = (np.asarray(q_a, np.float32) @ np.asarray(q_b, np.float32)) * float(s_a) * float(s_b)
    got = np.asarray(bench_fp8.e4m3_product(q_a, q_b, s_a, s_b), np.float32)
    assert q_a.dtype == jnp.float8_e4m3fn
    np.testing.assert_allclose(got, want, rtol=2**-7, atol=2**-7 * np.abs(want).max())


@pytest.mark.fast
def test_the_gemm_items_programs_are_fp8_gemms_on_an_h100():
    """Before a GPU visit: the GEMM item's programs at the GPU profile's size, compiled for an
    abstract H100, run their products as FP8 GEMMs (e4m3 x e4m3 forward; e5m2 x e4m3 and
    e4m3 x e5m2 for scaled_dot's two gradients) and the baseline as a bf16 one."""
    from helpers import require_cuda_plugin
    require_cuda_plugin()
    import jax
    import jax.numpy as jnp
    from benchlib.timing import forward_and_backward
    from jax.sharding import NamedSharding, PartitionSpec

    from zeroflow.autocast.fp8_hlo import count_gemms
    from zeroflow.backend import target_mesh

    on_h100 = NamedSharding(target_mesh("h100", data=1), PartitionSpec())
    n = FULL.fp8["gemm"]["size"]

    def gemms(fn, *dtypes):
        args = [jax.ShapeDtypeStruct((n, n) if dt != jnp.float32 else (), dt, sharding=on_h100)
                for dt in dtypes]
        with jax.sharding.use_abstract_mesh(on_h100.mesh.abstract_mesh):
            found = count_gemms(jax.jit(fn).trace(*args).lower().compile().as_text())
        return found.fp8, found.other, sorted(found.fp8_operand_types)

    bf16, e4m3, f32 = jnp.bfloat16, jnp.float8_e4m3fn, jnp.float32
    assert gemms(jnp.dot, bf16, bf16) == (0, 1, [])
    assert gemms(bench_fp8.e4m3_product, e4m3, e4m3, f32, f32) == (1, 0, [("f8e4m3fn", "f8e4m3fn")])
    assert gemms(bench_fp8.scaled_dot_bf16, bf16, bf16) == (1, 0, [("f8e4m3fn", "f8e4m3fn")])
    both = forward_and_backward(bench_fp8.scaled_dot_bf16)
    assert gemms(both, bf16, bf16, bf16) == (3, 0, [("f8e4m3fn", "f8e4m3fn"), ("f8e4m3fn", "f8e5m2"),
                                                    ("f8e5m2", "f8e4m3fn")])


# --------------------------------------------------------------------------- end to end (slow)
@pytest.mark.slow
def test_quick_fp8_stage_runs_every_item_in_its_own_process(tmp_path):
    """The report's --quick profile, env and fp8 stages: every item runs in a child process on
    the CPU and records what the section and the targets read."""
    options = RunOptions(out=tmp_path, command="python scripts/gpu_report.py --quick --stages fp8",
                         stages=("env", "fp8"), time_limit_s=300000,
                         budgets={"fp8": 30000}, require_gpu=False, timeout_scale=1000)
    profile = dataclasses.replace(QUICK, child_vars={**QUICK.child_vars,
                                                     "XLA_FLAGS": one_cpu_env()["XLA_FLAGS"]})
    printed = printed_by(run_report, profile, options)
    report = json.loads((tmp_path / files.REPORT_JSON).read_text())
    assert "fp8 step | bf16 autocast vs fp8 delayed -> ok" in printed
    assert "x bf16" in printed.split("fp8 delayed -> ok")[1].splitlines()[0]
    own = [r for r in report["records"] if r["stage"] == "fp8"]
    assert [(r["item"], r["status"]) for r in own] == [
        ("fp8 GEMM 64^3", "ok"), ("fp8 GEMM 64^3", "ok"), ("fp8 step", "ok"), ("fp8 step", "ok"),
        ("fp8 saved activations save_dots/compute", "ok"), ("fp8 saved activations save_dots/fp8", "ok")]
    step = fp8.step_result(own)
    assert list(step["variants"]) == ["bf16 autocast", "fp8 tensor", "fp8 delayed"]
    for var in step["variants"].values():
        assert var["tokens_per_s"] == pytest.approx(step["tokens_per_step"] / var["step_s"])
        assert var["loss_finite"] and var["compiled"]["total_bytes"] > 0
    args = {label: var["compiled"]["argument_bytes"] for label, var in step["variants"].items()}
    # delayed scaling's amax histories ride in the state: FP8 matmuls were really made
    assert args["fp8 delayed"] > args["fp8 tensor"] == args["bf16 autocast"]
    compute, saved_fp8 = fp8.saved_rows(own)
    assert saved_fp8["compiled_ratio"] < 1.0  # e4m3 residuals: a smaller step for XLA:CPU too
    text = (tmp_path / files.REPORT_MD).read_text()
    for header in ("| shape | pass | fp8 | bf16 ms |", "| precision | tokens/s | step ms |",
                   "| remat/saved dtype | params | allocated peak |"):
        assert header in text, header
    found = {t["name"]: t for t in report["targets"] if t["name"].startswith(FP8_TARGETS)}
    assert len(found) == 2 and all(t["value"] != "not measured" for t in found.values())
