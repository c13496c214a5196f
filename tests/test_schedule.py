"""zeroflow.xla.schedule: XLA:GPU's step estimate read from its scheduler's statistics.

The parser on a synthetic log and module; then, in processes started with the logging on,
programs compiled for 8 abstract H100s whose estimate can be reasoned about: an all-gather
beside an independent 8192^3 matmul is hidden, one the matmul needs is not; and the stage-3
forward loop of a scanned model waits for no weight gather (XLA's collective pipeliner gathers
iteration i+1's slice during iteration i), which it does with the pipeliner off. No timing of
this machine decides anything: the figures are XLA's cost model's."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import require_cuda_plugin

from zeroflow.xla import schedule

pytestmark = pytest.mark.slow

CASES = Path(__file__).with_name("schedule_cases.py")


def _stats(name: str, total: float, **wasted: float) -> str:
    lines = ["I0000 latency_hiding_scheduler.cc:1] [latency-hiding-scheduler] Statistics after "
             "scheduling:", f"I0000 latency_hiding_scheduler.cc:1] For computation: {name}, "
             "module m(0)", f"I0000 x.cc:1] Total cycles: {total}"]
    lines += [f"I0000 x.cc:1] Wasted cycles for {k.replace('_', '-')}: {v}" for k, v in wasted.items()]
    lines.append(f"I0000 x.cc:1] Total wasted cycles: {sum(wasted.values())}")
    return "\n".join(lines) + "\n"


HLO = """HloModule m

%inner.body (p: (s32[])) -> (s32[]) {
  ROOT %t = (s32[]) tuple(%p)
}

%outer.body (p: (s32[])) -> (s32[]) {
  %w = (s32[]) while(%p), condition=%c, body=%inner.body, backend_config={"known_trip_count":{"n":"3"}}
  ROOT %t = (s32[]) tuple(%w)
}

%plain.body (p: (s32[])) -> (s32[]) {
  ROOT %t = (s32[]) tuple(%p)
}

%unknown.body (p: (s32[])) -> (s32[]) {
  ROOT %t = (s32[]) tuple(%p)
}

ENTRY %main (a: s32[]) -> s32[] {
  %w1 = (s32[]) while(%a), condition=%c, body=%outer.body, backend_config={"known_trip_count":{"n":"4"}}
  %w2 = (s32[]) while(%a), condition=%c, body=%plain.body, backend_config={"known_trip_count":{"n":"5"}}
  %w3 = (s32[]) while(%a), condition=%c, body=%unknown.body
}
"""


def test_parse_multiplies_loops_by_trip_counts_nested_ones_by_both():
    log = (_stats("main", 100.0, all_gather=10.0) + _stats("outer.body", 20.0, reduce_scatter=2.0)
           + _stats("inner.body", 5.0, all_gather=1.0, all_reduce=0.0)
           + "Statistics before scheduling:\n" + _stats("unknown.body", 7.0))
    est = schedule.parse(log, HLO)
    trips = {c.name: c.trips for c in est.computations}
    assert trips == {"main": 1, "outer.body": 4, "inner.body": 12, "unknown.body": 1}
    assert est.step_us == pytest.approx(100 + 4 * 20 + 12 * 5 + 7)
    assert est.exposed_us("all-gather") == pytest.approx(10 + 12 * 1)
    assert est.exposed_by_kind() == pytest.approx({"all-gather": 22.0, "reduce-scatter": 8.0})
    assert est.uncosted == ("plain.body",)  # no statistics printed: no asynchronous collective
    assert est.mfu(model_flops=1e9, peak_flops=1e12) == pytest.approx(1e9 / (est.step_us * 1e-6) / 1e12)


def test_timed_says_what_to_set_when_the_logging_is_off(monkeypatch):
    monkeypatch.delenv("TF_CPP_VMODULE", raising=False)
    with pytest.raises(RuntimeError, match="TF_CPP_MIN_LOG_LEVEL=0 TF_CPP_VMODULE=latency_hiding"):
        schedule.timed(lambda: None)


def _run_case(case: str) -> dict:
    require_cuda_plugin()
    env = schedule.enable(dict(os.environ))
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONPATH"] = str(CASES.parents[1])  # this checkout, whatever is installed
    out = subprocess.run([sys.executable, str(CASES), case], env=env, capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_an_all_gather_beside_independent_matmul_is_hidden_one_it_feeds_is_not():
    got = _run_case("matmul")
    # 2 x 8192^3 flops at H100's 989 TFLOPS is 1.1 ms: XLA's model is of that order.
    assert 0.5 < got["hidden"]["step_ms"] < 5
    assert got["hidden"]["exposed_ag_us"] < 1.0
    assert got["exposed"]["exposed_ag_us"] > 50  # 128 MB gathered before the matmul can start


def test_stage3_forward_loop_gathers_the_next_layer_during_this_one():
    loops = _run_case("stage3")["pipelined"]
    assert loops, "no forward loop with weight gathers found"
    for name, loop in loops.items():
        assert loop["exposed_ag_us"] == 0, (name, loop)


def test_without_the_pipeliner_the_forward_loop_waits_for_its_gathers():
    """The property above is the pipeliner's doing: with it off, the same check fails."""
    loops = _run_case("stage3-off")["not_pipelined"]
    assert any(loop["exposed_ag_us"] > 0 for loop in loops.values()), loops


FLOPS_HLO = """HloModule m

%fused_dot (p0: bf16[64,128], p1: bf16[128,32]) -> bf16[64,32] {
  %p0 = bf16[64,128]{1,0} parameter(0)
  %p1 = bf16[128,32]{1,0} parameter(1)
  ROOT %dot.1 = bf16[64,32]{1,0} dot(%p0, %p1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%fwd.body (p: (s32[])) -> (s32[]) {
  %f = bf16[64,32]{1,0} fusion(%a, %b), kind=kCustom, calls=%fused_dot
  ROOT %t = (s32[]) tuple(%p)
}

%bwd.body (p: (s32[])) -> (s32[]) {
  %f1 = bf16[64,32]{1,0} fusion(%a, %b), kind=kCustom, calls=%fused_dot
  %f2 = bf16[64,32]{1,0} fusion(%a, %b), kind=kCustom, calls=%fused_dot
  ROOT %t = (s32[]) tuple(%p)
}

ENTRY %main (a: s32[]) -> s32[] {
  %w1 = (s32[]) while(%a), condition=%c, body=%fwd.body, backend_config={"known_trip_count":{"n":"4"}}
  %w2 = (s32[]) while(%a), condition=%c, body=%bwd.body, backend_config={"known_trip_count":{"n":"4"}}
}
"""


def test_a_loop_without_statistics_is_costed_from_its_matmul_flops():
    """The forward loop (no collective: no statistics) costs what its matmuls cost at the time
    per flop XLA gave the backward loop; with no costed loop, at the peak."""
    flops = 2 * 64 * 32 * 128
    log = _stats("main", 10.0) + _stats("bwd.body", 6.0, reduce_scatter=1.0)
    est = schedule.parse(log, FLOPS_HLO, peak_flops=1e12)
    fwd = next(c for c in est.computations if c.name == "fwd.body")
    assert (fwd.costed_by, fwd.trips) == ("scaled-flops", 4)
    assert fwd.total_us == pytest.approx(3.0)  # half the backward body's matmul flops
    assert est.step_us == pytest.approx(10 + 4 * 6 + 4 * 3)
    assert est.uncosted == ("fwd.body",)
    alone = schedule.parse(_stats("main", 10.0), FLOPS_HLO, peak_flops=1e12)
    assert {c.costed_by for c in alone.computations if c.name != "main"} == {"peak-flops"}
    assert alone.step_us == pytest.approx(10 + 4 * 3 * flops / 1e12 * 1e6)
    assert schedule.parse(log, FLOPS_HLO).step_us == pytest.approx(10 + 4 * 6)  # left out


def test_an_asynchronous_fusion_placeholder_and_other_modules_are_not_the_steps_time():
    """Newer XLA:GPU slices a loop's operand with an asynchronous fusion, which its latency
    estimator charges a fixed 5,000 cycles, and prints statistics for modules it builds of
    single fusions: the loop keeps its exposed reduce-scatter, its matmuls are costed by flops,
    and the other module's figure is left out."""
    flops = 2 * 64 * 32 * 128
    hlo = FLOPS_HLO.replace(
        "  %f2 = ", "  %s = ((bf16[8,64]), bf16[64]) fusion-start(%a), kind=kLoop, calls=%x\n"
                    "  %f2 = ")
    other = _stats("entry_computation", 5000.0).replace("module m(0)",
                                                        "module loop_dynamic_slice_fusion(7)")
    log = other + _stats("main", 10.0) + _stats("bwd.body", 5006.0, reduce_scatter=1.0)
    at_peak = flops / 1e12 * 1e6  # one matmul at the peak, in microseconds
    est = schedule.parse(log, hlo, peak_flops=1e12)
    assert "entry_computation" not in {c.name for c in est.computations}
    assert est.uncosted == ("bwd.body", "fwd.body")
    bwd = next(c for c in est.computations if c.name == "bwd.body")
    assert (bwd.costed_by, bwd.wasted_us) == ("peak-flops", {"reduce-scatter": 1.0})
    assert est.step_us == pytest.approx(10 + 4 * at_peak + 4 * (1.0 + 2 * at_peak))
    assert schedule.parse(log, hlo).step_us == pytest.approx(10 + 4 * 1.0)
