"""What ``python -m zeroflow.memory`` and ``python -m zeroflow.planner`` print: a table a person
can read (compact by default, rows that differ only in stage said once, failures as one line
under it, no MFU above 100%), GPU answers only with the CUDA plugin, progress lines when
piped, XLA's no-answer notes dropped, and the one accelerator table."""
import re

import pytest

from zeroflow.backend import accelerators
from zeroflow.cli import memory as memory_cli
from zeroflow.cli import plan_flags, planner
from zeroflow.planner import memory_table
from zeroflow.xla import schedule

pytestmark = pytest.mark.fast


def test_the_default_table_of_tiny_on_8_devices_is_short(capsys):
    assert memory_cli.main(["--config", "configs/tiny.yaml", "--devices", "8",
                            "--measure", "never"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert len(out) < 40, "\n".join(out)
    assert out[-1].startswith("Cheapest choice that fits in 80.00 GB")
    assert any("more choices: --all lists every one" in line for line in out)


def test_rows_that_differ_only_in_stage_are_said_once(capsys):
    """On one device the stages shard nothing: in bf16 all four are one row (``0-3``)."""
    argv = ["--config", "configs/tiny.yaml", "--devices", "1", "--measure", "never", "--all",
            "--offloads", "none", "--remats", "full", "precision.params=bf16"]
    assert memory_cli.main(argv) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if " full " in line]
    assert len(rows) == 1 and re.search(r"\b0-3\b", rows[0]), rows


def _table(*rows):
    """A memory table of the tiny config on one H100 whose rows are ``(stage, compiled peak,
    failure reason)``, and ``step`` XLA:GPU's estimate of the compiled ones."""
    import dataclasses

    from zeroflow.config.io import load_config
    from zeroflow.planner import search
    from zeroflow.planner.compiling import Measured
    table = memory_table.build(load_config("configs/tiny.yaml", ["precision.params=bf16"]), devices=1,
                               device_memory=1e9, title="t", stages=[r[0] for r in rows],
                               offloads=["none"], remats=["full"], measure="never")
    for c, (_, peak, reason) in zip(table.rows, rows, strict=True):
        c.reason = reason
        c.status = search.FAILED if reason else search.COMPILED
        c.measured = None if peak is None else Measured(peak_bytes=peak, host_bytes=0.0,
                                                        compile_s=1.0)
    return table, lambda c, **step: dataclasses.replace(c.measured, timed=True, **step)


def test_a_failed_compile_is_one_line_under_the_table(capsys):
    from rich.console import Console
    table, _ = _table((0, None, "RuntimeError: XLA ran out of words"),
                      (1, None, "RuntimeError: XLA ran out of words"), (3, 5e3, ""))
    memory_table.render(table, console=Console(width=150), show_all=True)
    out = capsys.readouterr().out.splitlines()
    failed = [line for line in out if "did not compile" in line]
    assert failed == ["did not compile (0,1/none/full): "
                      "RuntimeError: XLA ran out of words"]
    assert not any("out of words" in line for line in out if line not in failed)


def _timing_cells(mfu, costed_by="xla"):
    """The memory table's step cells of a compiled row on one H100 (989e12 dense bf16) whose
    XLA:GPU estimate is 10 ms and whose model FLOPs make ``mfu`` of it; ``costed_by``: how its
    loops were costed (by XLA, or uncosted ones at the rate XLA gave the target's other
    programs, or at the dense peak)."""
    from zeroflow.planner import where
    from zeroflow.planner.compiling import Compiler
    table, timed = _table((0, 5e3, ""))
    [c] = table.rows
    table.where, table.compiler = where.target("h100", 1), Compiler("unused")
    table.problem.model_flops = lambda: mfu * 989e12 * 10e-3
    if costed_by == "xla-target":
        table.compiler.rates.us_per_flop["h100"] = 1e-8  # 1e12 flops: 1e4 us
    per_flop = {"xla-target": 1e-8, "peak": 1e6 / 989e12}.get(costed_by)
    c.measured = (timed(c, xla_us=10e3) if per_flop is None
                  else timed(c, uncosted_flops=10e3 / per_flop))
    assert table.step(c)[1] == costed_by or mfu > 1
    return memory_table._timing_cells(table, c)


@pytest.mark.parametrize("mfu, costed_by, shown", [
    (0.42, "xla", "42%"),
    (5.75, "xla", "-"),  # above the peak: no figure
    (0.42, "xla-target", "-"),  # loops XLA did not cost, at its time per flop elsewhere
    (0.42, "peak", "-"),  # ... at the dense peak
])
def test_an_estimated_mfu_is_never_above_100_percent(mfu, costed_by, shown):
    assert _timing_cells(mfu, costed_by)[2] == shown


def test_a_step_below_the_model_flops_at_the_peak_shows_that_bound():
    """An MFU of 5.75 says the model's FLOPs at the dense peak take 5.75 x XLA's 10 ms: XLA's
    cost model left work out (a custom call), and 57.5 ms is the step's lower bound."""
    assert _timing_cells(5.75) == ["≥ 57.5 ms", "0", "-"]


def test_a_gpu_target_without_the_cuda_plugin_is_one_line_with_the_pip_command(
        monkeypatch, capsys):
    monkeypatch.setattr(plan_flags, "cuda_plugin_module", lambda: None)
    with pytest.raises(SystemExit) as memory_exit:
        memory_cli.main(["--config", "configs/tiny.yaml", "--target", "h100"])
    with pytest.raises(SystemExit) as planner_exit:
        planner.main(["--config", "configs/tiny.yaml", "--gpus", "h100"])
    lines = capsys.readouterr().err.strip().splitlines()
    assert memory_exit.value.code == planner_exit.value.code == 2 and len(lines) == 2
    assert lines[0].startswith("zeroflow.memory: error: --target h100")
    assert lines[1].startswith("zeroflow.planner: error: --gpus h100")
    assert all("pip install jax-cuda" in line for line in lines)
    # the formula alone needs no plugin
    assert memory_cli.main(["--config", "configs/tiny.yaml", "--target", "h100",
                            "--measure", "never"]) == 0


def test_piped_planner_progress_is_a_line_per_compile(capsys):
    tick = planner._progress_lines(0.0)
    tick(0, 4, "1 x h100")
    tick(2, 4, "1 x h100")
    tick(2, 4, "1 x h100")  # the same count again: said once
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 2
    assert err[0].startswith("zeroflow.planner: compile 0 of 4 done")
    assert "compile 2 of 4 done" in err[1] and "left" in err[1]


@pytest.mark.parametrize("line, dropped", [
    (b"I0000 00:00:1.0 123 cuda_executor.cc:1] starting\n", True),
    (b"W0000 00:00:1.0 123 hlo_rematerialization.cc:3] Can't reduce memory use below 1GiB\n",
     True),
    (b"E0000 00:00:1.0 123 debug.cc:9] Invalid stack_frame_id 268\n", True),
    (b"E0000 00:00:1.0 123 gpu_compiler.cc:1] Out of memory while compiling\n", False),
    (b"zeroflow.planner: compile 1 of 3 done\n", False),
])
def test_only_xla_notes_that_change_no_answer_are_dropped(line, dropped):
    assert bool(schedule._INFO_LINE.match(line)) == dropped


@pytest.mark.parametrize("kind, bf16, fp8", [
    ("NVIDIA H100 80GB HBM3", 989e12, 1979e12),  # H100 SXM5 datasheet, dense
    # H100 datasheet "with sparsity" figures halved: PCIe 1,513 / 3,026, NVL 1,671 / 3,341.
    ("NVIDIA H100 PCIe", 756.5e12, 1513e12),
    ("NVIDIA H100 NVL", 835.5e12, 1670.5e12),
    ("NVIDIA GH200 480GB", 989e12, 1979e12),
    ("NVIDIA A100-SXM4-80GB", 312e12, None),
    ("NVIDIA L4", 121e12, 242e12),
    ("TPU v5 lite", 197e12, None),
    ("cpu", None, None),
])
def test_one_accelerator_table(kind, bf16, fp8):
    assert accelerators.peak_flops(kind, "bf16") == bf16
    assert accelerators.peak_flops(kind, "fp8") == fp8


def test_the_planner_shows_no_mfu_above_100_percent():
    """XLA's estimate of 1 ms for 1e13 model FLOPs on one H100 (989e12 dense bf16) would be an
    MFU of 1011%: its cost model left work out. The row shows the bound 1e13 / 989e12 s
    instead, marked, with no MFU."""
    from types import SimpleNamespace

    from zeroflow.planner import results, where
    from zeroflow.planner.choices import Choice
    from zeroflow.planner.compiling import Compiler, Measured
    from zeroflow.planner.search import Candidate, Row
    from zeroflow.planner.whatif import WhatIf
    got = Measured(peak_bytes=1e9, host_bytes=0.0, compile_s=1.0, xla_us=1000.0, timed=True)
    cand = Candidate(Choice(stage=0), WhatIf(0, 0, 0, 1.0), "compiled", measured=got)
    row = Row(where.target("h100", 1), 80e9, [cand], best=cand)
    problem = SimpleNamespace(model_flops=lambda: 1e13, overrides=lambda c, n: [],
                              spec=SimpleNamespace(tokens_per_step=1000))
    s = results.summarize(row, problem, Compiler("unused"))
    assert s.mfu is None and s.step_ms == pytest.approx(1e13 / 989e12 * 1e3)
    cells = results.cells(s)
    assert cells[5] == f"≥ {1e13 / 989e12 * 1e3:.1f} ms" and cells[7] == "-"


def test_an_mfu_from_a_step_costed_at_the_peak_is_shown_as_an_upper_bound():
    """Loops XLA printed no cost for, costed at the dense peak (989e12 on an H100): 1e12
    matmul flops take at least 1.011 ms; 5e11 model FLOPs in that bound is at most 50%."""
    from types import SimpleNamespace

    from zeroflow.planner import results, where
    from zeroflow.planner.choices import Choice
    from zeroflow.planner.compiling import Compiler, Measured
    from zeroflow.planner.search import Candidate, Row
    from zeroflow.planner.whatif import WhatIf
    got = Measured(peak_bytes=1e9, host_bytes=0.0, compile_s=1.0, uncosted_flops=1e12,
                   timed=True)
    cand = Candidate(Choice(stage=0), WhatIf(0, 0, 0, 1.0), "compiled", measured=got)
    row = Row(where.target("h100", 1), 80e9, [cand], best=cand)
    problem = SimpleNamespace(model_flops=lambda: 5e11, overrides=lambda c, n: [],
                              spec=SimpleNamespace(tokens_per_step=1000))
    s = results.summarize(row, problem, Compiler("unused"))
    assert s.step_costed_by == "peak" and s.mfu == pytest.approx(0.5)
    cells = results.cells(s)
    assert cells[5] == f"≥ {1e12 / 989e12 * 1e3:.1f} ms" and cells[7] == "≤ 50%"


def _scheduled(name: str, total: float, wasted: float = 0.0) -> str:
    """What XLA:GPU's scheduler prints for one computation, as ``schedule.capture`` reads it."""
    return (f"I0000 x.cc:1] Statistics after scheduling:\nI0000 x.cc:1] For computation: {name}, "
            f"module m(0)\nI0000 x.cc:1] Total cycles: {total}\n"
            f"I0000 x.cc:1] Wasted cycles for reduce-scatter: {wasted}\n")


STEP_HLO = """HloModule m

%dot64 (p0: bf16[64,128], p1: bf16[128,32]) -> bf16[64,32] {
  %p0 = bf16[64,128]{1,0} parameter(0)
  %p1 = bf16[128,32]{1,0} parameter(1)
  ROOT %d = bf16[64,32]{1,0} dot(%p0, %p1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%fwd.body (p: (s32[])) -> (s32[]) {
  %f = bf16[64,32]{1,0} fusion(%a, %b), kind=kCustom, calls=%dot64
  ROOT %t = (s32[]) tuple(%p)
}

%bwd.body (p: (s32[])) -> (s32[]) {
  %f1 = bf16[64,32]{1,0} fusion(%a, %b), kind=kCustom, calls=%dot64
  %f2 = bf16[64,32]{1,0} fusion(%a, %b), kind=kCustom, calls=%dot64
  ROOT %t = (s32[]) tuple(%p)
}

ENTRY %main (a: s32[]) -> s32[] {
  %w1 = (s32[]) while(%a), condition=%c, body=%fwd.body, backend_config={"known_trip_count":{"n":"4"}}
  %w2 = (s32[]) while(%a), condition=%c, body=%bwd.body, backend_config={"known_trip_count":{"n":"4"}}
  %head = bf16[64,32]{1,0} fusion(%a, %b), kind=kCustom, calls=%dot64
}
"""


def test_step_parts_split_what_xla_costed_from_the_matmul_flops_it_did_not():
    """A backward loop XLA costed (6 us per trip, 1 of them waiting on a reduce-scatter) and a
    forward loop it printed nothing for, 4 trips each, 2 x 64 x 32 x 128 flops per dot: XLA's
    time is its costed computations', the forward loop's flops are left to cost, and XLA's
    time per flop is the backward loop's compute (waits left out) over its flops. Without
    statistics for the entry (one device), the entry's own dot is left to cost too."""
    from zeroflow.planner.compiling import step_parts

    dot = 2 * 64 * 32 * 128
    log = _scheduled("main", 10.0) + _scheduled("bwd.body", 6.0, wasted=1.0)
    xla_us, uncosted, per_flop = step_parts(schedule.parse(log, STEP_HLO), STEP_HLO)
    assert xla_us == pytest.approx(10 + 4 * 6)
    assert uncosted == pytest.approx(4 * dot)
    assert per_flop == pytest.approx(4 * (6 - 1) / (4 * 2 * dot))
    alone = _scheduled("bwd.body", 6.0, wasted=1.0)
    xla_us, uncosted, _ = step_parts(schedule.parse(alone, STEP_HLO), STEP_HLO)
    assert (xla_us, uncosted) == (pytest.approx(4 * 6), pytest.approx(4 * dot + dot))
