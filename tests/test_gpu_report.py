"""The GPU report (scripts/gpu_report.py): its quick profile on the CPU (trimmed to one run of
each code path) produces every stage and well-formed files, and a failing item (exception, OOM,
exit, segfault, hang, a broken stage plan, an exhausted budget) is recorded while the run goes
on."""
from __future__ import annotations

import dataclasses
import json
import math
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
SCRIPTS = REPO / "scripts"
sys.path[:0] = [str(SCRIPTS)]

from benchlib.search import layer_search  # noqa: E402
from gpureport import files, render, targets  # noqa: E402
from gpureport.profiles import QUICK, STAGE_ORDER  # noqa: E402
from gpureport.runner import Context, Item, Runner, Summary  # noqa: E402
from gpureport.session import RunOptions, run_report  # noqa: E402
from gpureport.stages import STAGES  # noqa: E402
from helpers import one_cpu_env, printed_by  # noqa: E402

GOOD = ("ok", "reused")
STATUSES = {"ok", "reused", "error", "oom", "timeout", "crash", "skipped", "unavailable"}


def _script(*args, timeout=600):
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, str(SCRIPTS / "gpu_report.py"), *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=timeout)


SMOKE = dataclasses.replace(QUICK, training_runs=QUICK.training_runs[:1],
                            largest={**QUICK.largest, "max_probes": 1},
                            child_vars={**QUICK.child_vars, "XLA_FLAGS": one_cpu_env()["XLA_FLAGS"]})
"""The quick profile less what repeats a code path, each item being a process (~6 CPU-s): one
training configuration (the second differs by its attention only) and one probe per
largest-model search (each probe is the same compile-and-compare); its processes compile with
the suite's cheap-compile flags."""


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    """The report run in this process (its items in child processes, as always) on ``SMOKE``.
    Budgets and item time limits far above what anything needs, so that a busy machine never
    decides the outcome (budgets and time limits are tested with injected slow items below)."""
    out = tmp_path_factory.mktemp("quick")
    options = RunOptions(out=out, command="python scripts/gpu_report.py --quick", time_limit_s=300000,
                         budgets={name: 30000 for name in STAGE_ORDER}, require_gpu=False,
                         timeout_scale=1000)
    printed = printed_by(run_report, SMOKE, options)
    report = json.loads((out / files.REPORT_JSON).read_text())
    return out, report, printed


def _results(report, stage, item_prefix=""):
    return [r for r in report["records"]
            if r["stage"] == stage and r["item"].startswith(item_prefix) and r["status"] in GOOD]


# --------------------------------------------------------------------------- the quick run
def test_quick_run_writes_every_file_and_every_stage(quick):
    out, report, stdout = quick
    names = sorted(p.name for p in out.iterdir())
    assert names == sorted([files.RESULTS, files.REPORT_JSON, files.REPORT_MD, files.ERRORS,
                            files.PROGRESS, files.NVIDIA_SMI])  # at most 8 files
    lines = (out / files.RESULTS).read_text().splitlines()
    assert [json.loads(line) for line in lines][1:] == report["records"]  # [0] is the run's meta
    assert {r["stage"] for r in report["records"]} == set(STAGE_ORDER)
    for r in report["records"]:
        assert r["status"] in STATUSES, r
        if r["status"] in ("ok", "reused"):
            assert r["result"] is not None, r
        elif r["status"] in ("skipped", "unavailable"):
            assert r["note"], r
        else:
            assert r["error"], r
    # On the CPU every code path must work: nothing failed, nothing ran out of time.
    assert [r for r in report["records"] if r["status"] not in ("ok", "reused", "unavailable")] == []
    assert report["meta"][0]["profile"] == "quick" and report["env"]["backend"] == "cpu"
    assert "left for another call" not in stdout and report["remaining_stages"] == []


def test_quick_markdown_has_each_section_and_its_table(quick):
    out, _, _ = quick
    text = (out / files.REPORT_MD).read_text()
    for name in STAGE_ORDER:
        assert f"## {STAGES[name].TITLE}" in text
    for header in ("| target | goal | measured | met |", "| case | out | dq | dk | dv |",
                   "| S | D | B | H | mask | pass | pallas | cudnn | xla |", "| block | sparsity |",
                   "| run | params | tokens/step |",
                   "| configuration | estimate | deviceless | compiled |",
                   "| offload/update_on | params | step s |",
                   "| offload/update_on | largest that fit (params) |",
                   "| shape | pass | fp8 | bf16 ms |", "| precision | tokens/s | step ms |"):
        assert header in text, header
    assert "n/a (smoke test)" in text and "| met |" in text


def test_quick_kernels_were_checked_against_the_references(quick):
    _, report, _ = quick
    checks = _results(report, "correctness")
    assert {r["item"] for r in checks} == {"flash attention", "block-sparse matmul"}
    for r in checks:
        assert r["result"]["passed"]
        calls = r["result"].get("kernel_calls", r["result"].get("compiled_calls"))
        assert calls == 0  # interpreted on the CPU
        for err in r["result"]["errors"].values():
            # bf16 against fp32: a real comparison has a small, nonzero error on both sides.
            assert 0 < err["kernel"] < 0.1 * err["scale"] and 0 < err["naive"]
    timed = _results(report, "kernels", "attention")
    assert {(r["result"]["impl"], r["result"]["pass"]) for r in timed if "impl" in r["result"]} == {
        (impl, p) for impl in SMOKE.attention_timing["impls"] for p in SMOKE.attention_timing["passes"]}
    for r in timed:
        res = r["result"]  # TFLOP/s = 4 B H S^2 D (x0.5 causal, x3.5 fwd+bwd) / seconds
        flops = 4 * res["batch"] * res["heads"] * res["seq"] ** 2 * res["head_dim"] * 0.5
        flops *= 3.5 if res["pass"] == "fwd+bwd" else 1
        assert res["tflops"] == pytest.approx(flops / (res["ms"] / 1e3) / 1e12, rel=1e-9)


def test_the_gpu_section_of_the_measured_doc_is_written_from_the_records(quick, tmp_path):
    """``--measured-doc`` rewrites the '## GPU' section of a copy of docs/measured.md from the
    quick run's records (device, command, targets, the kernels' tables) and leaves every other
    section as it was; without the flag, a merge of CPU records leaves the real docs alone."""
    out, report, _ = quick
    docs = REPO / "docs" / "measured.md"
    original = docs.read_text()
    doc = tmp_path / "measured.md"
    doc.write_text(original)
    done = _script("--render", str(out / files.RESULTS), "--out", str(tmp_path / "merged"),
                   "--measured-doc", str(doc))
    assert done.returncode == 0, done.stderr
    written = doc.read_text()
    head, gpu_and_rest = original.split("\n## GPU\n")
    rest = gpu_and_rest[gpu_and_rest.find("\n## "):] if "\n## " in gpu_and_rest else ""
    assert written.startswith(head + "\n## GPU\n") and written.endswith(rest)
    section = written[len(head):len(written) - len(rest)]
    assert f"Device: {report['env']['device_kind']} x{report['env']['device_count']}" in section
    assert "`python scripts/gpu_report.py --quick`" in section and "Quick profile" in section
    for line in ("### Targets", "### Kernels", "| S | D | B | H | mask | pass | pallas | cudnn | xla",
                 "**Block-sparse matmul** vs a dense", "| block | sparsity | blocks kept"):
        assert line in section, line
    again = _script("--render", str(out / files.RESULTS), "--out", str(tmp_path / "merged"))
    assert again.returncode == 0 and docs.read_text() == original


def test_quick_training_ran_the_real_model(quick):
    _, report, _ = quick
    runs = _results(report, "training")
    assert len(runs) == len(SMOKE.training_runs)
    h, f, v, layers = 64, 128, 256, 2  # the tiny preset: SwiGLU, RMSNorm, tied embedding
    expected_params = layers * (4 * h * h + 3 * h * f + 2 * h) + v * h + h
    for r in runs:
        res = r["result"]
        assert res["params"] == expected_params
        assert res["tokens_per_s"] == pytest.approx(res["tokens_per_step"] / res["step_s"])
        assert res["mfu"] is None  # no peak FLOP/s for a CPU
        # Three steps from a small initialisation: still close to uniform over the vocabulary.
        assert abs(res["loss"] - math.log(v)) < 0.1
        mem = res["memory"]
        assert mem["compiled"]["total_bytes"] > 0 and mem["estimate"]["device"] > 0
    # the memory stage reuses each training run's result, one per run, in the same order
    memory = [r for r in report["records"]
              if r["stage"] == "memory" and not r["item"].endswith(" / deviceless")]
    assert [(r["item"], r["status"]) for r in memory] == [
        (label, "reused") for label, _ in SMOKE.training_runs]


def test_quick_offload_ratio_and_largest_model_search(quick):
    _, report, _ = quick
    ratios = _results(report, "offload", "ratio")
    assert [r["item"] for r in ratios] == [f"ratio {o}/{u}" for o, u in SMOKE.offload_ratio["choices"]]
    losses = [r["result"]["loss"] for r in ratios]
    assert max(losses) - min(losses) < 1e-3  # offload moves the state, not the arithmetic
    budget = SMOKE.largest["compile_budget"]
    for offload, update_on in SMOKE.largest["searches"]:
        name = f"largest {offload}/{update_on}"
        probes = {int(r["item"].split("L=")[1]): r["result"]
                  for r in _results(report, "offload", name + " L=")}
        assert probes and all(res["fits"] == (res["need_bytes"] <= budget) for res in probes.values())
        summary = next(r["result"] for r in _results(report, "offload") if r["item"] == name)
        fitting = [layers for layers, res in probes.items() if res["fits"]]
        failing = [layers for layers, res in probes.items() if not res["fits"]]
        assert summary["largest_fits"] == max(fitting, default=0)
        assert summary["smallest_fails"] == min(failing, default=None)


def test_quick_autocast_stage_measures_every_mode(quick):
    """This tree has ``zf.autocast`` (a public name), so every mode is measured; the
    report's "unavailable" row is for trees without it."""
    _, report, _ = quick
    own = [r for r in report["records"] if r["stage"] == "autocast"]
    assert sorted(r["item"] for r in own) == sorted(label for label, *_ in SMOKE.autocast["modes"])
    assert all(r["status"] in ("ok", "reused") for r in own)


# --------------------------------------------------------------------------- failures
FAULTY = textwrap.dedent("""
    import os, signal, time
    from benchlib.isolate import Case

    def fine(value):
        return {"value": value}

    def raises():
        raise RuntimeError("boom\\nsecond line")

    def oom():
        raise RuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 1.00GiB")

    def exits():
        os._exit(7)

    def segfaults():
        os.kill(os.getpid(), signal.SIGSEGV)

    def hangs():
        time.sleep(60)

    def cases():
        yield Case("a", lambda: {"n": 1})
        yield Case("b", lambda: os._exit(9))
        yield Case("c", lambda: {"n": 3})

    def slow_cases():
        yield Case("a", lambda: {"n": 1})
        yield Case("b", lambda: time.sleep(60))
        yield Case("c", lambda: {"n": 3})
""")


def _faulty_plan(path):
    def plan(ctx):
        target = lambda name: f"{path}:{name}"  # noqa: E731
        yield Item("reuse first", target("fine"), {"value": 42}, key="k", reuse_only=True)
        yield Item("raises", target("raises"), {})
        yield Item("oom", target("oom"), {})
        yield Item("exits", target("exits"), {})
        yield Item("segfaults", target("segfaults"), {})
        yield Item("hangs", target("hangs"), {}, case_timeout_s=2)
        outcome = yield Item("cases", target("cases"), {})
        yield Summary("saw", {"statuses": [r["status"] for r in outcome.records]})
        yield Item("slow", target("slow_cases"), {}, timeout_s=4)
        yield Item("fine", target("fine"), {"value": 42}, key="k")
        yield Item("fine again", target("fine"), {"value": 42}, key="k")
    return plan


def _broken_plan(ctx):
    yield Item("bad target", "nowhere:nothing", {})
    raise ZeroDivisionError("plan bug")


def _runner(out, budget_for_time, item_filter=None, timeout_scale=1.0):
    report = files.ReportFiles(out, render.render, render.summarize, echo=lambda line: None)
    runner = Runner(report.add, report.log, deadline=time.monotonic() + budget_for_time,
                    workdir=out / "work", child_vars={}, item_filter=item_filter,
                    timeout_scale=timeout_scale)
    return report, runner


def test_timeout_scale_stretches_every_item_and_case_limit(tmp_path):
    """What lets the quick run above ignore load: a 2 s nap times out under limits of 0.5 s
    (the child is given at least 1 s) and finishes when they are scaled by 1000."""
    module = tmp_path / "naps.py"
    module.write_text("import time\n\ndef nap(seconds):\n    time.sleep(seconds)\n"
                      "    return {'slept': seconds}\n")

    def plan(ctx):
        yield Item("nap", f"{module}:nap", {"seconds": 2}, timeout_s=0.5, case_timeout_s=0.5)

    for scale, status in ((1.0, "timeout"), (1000.0, "ok")):
        report, runner = _runner(tmp_path / f"x{scale:g}", 3000, timeout_scale=scale)
        runner.run_stage("training", plan, Context(QUICK, {}, report.records), budget_s=3000)
        assert [r["status"] for r in report.records] == [status], report.records


def test_failures_are_recorded_and_the_run_goes_on(tmp_path):
    module = tmp_path / "faulty.py"
    module.write_text(FAULTY)
    report, runner = _runner(tmp_path / "out", 120)
    ctx = Context(profile=QUICK, host={}, records=report.records)
    runner.run_stage("correctness", _faulty_plan(module), ctx, budget_s=100)
    runner.run_stage("kernels", _broken_plan, ctx, budget_s=100)
    runner.run_stage("training", _faulty_plan(module), ctx, budget_s=0)  # no time: all skipped
    by_item = {}
    for r in report.records:
        by_item.setdefault((r["stage"], r["item"]), []).append(r)
    def got(item, stage="correctness"):
        return [(r["case"], r["status"]) for r in by_item[(stage, item)]]

    def error(item):
        return by_item[("correctness", item)][0]["error"]

    assert got("raises") == [("", "error")]
    assert error("raises") == "RuntimeError: boom"
    assert got("oom") == [("", "oom")]
    assert got("exits") == [("", "crash")] and "exit code 7" in error("exits")
    assert got("segfaults") == [("", "crash")] and "SIGSEGV" in error("segfaults")
    assert got("hangs") == [("", "timeout")] and "case time limit" in error("hangs")
    # The child died in case b; a second child ran the rest.
    assert got("cases") == [("a", "ok"), ("b", "crash"), ("c", "ok")]
    assert [r["attempt"] for r in by_item[("correctness", "cases")]] == [1, 1, 2]
    assert by_item[("correctness", "saw")][0]["result"] == {"statuses": ["ok", "crash", "ok"]}
    assert got("reuse first") == [("", "skipped")]  # nothing to reuse yet: left for later
    # The item's own time ran out inside case b: b is a timeout, and c is not silently lost.
    assert got("slow") == [("a", "ok"), ("b", "timeout"), ("(cases not started)", "skipped")]
    assert got("fine") == [("", "ok")] and got("fine again") == [("", "reused")]
    assert by_item[("correctness", "fine again")][0]["result"] == {"value": 42}
    assert got("bad target", "kernels") == [("", "crash")]
    assert "No module named 'nowhere'" in by_item[("kernels", "bad target")][0]["error"]
    assert by_item[("kernels", "(plan)")][0]["error"] == "ZeroDivisionError: plan bug"
    # No time left: every item that needs a child is skipped; a known result is still reused.
    for item in ("raises", "oom", "exits", "segfaults", "hangs", "cases"):
        [record] = by_item[("training", item)]
        assert record["status"] == "skipped" and record["note"].startswith(render.BUDGET_SKIP)
    assert by_item[("training", "saw")][0]["result"] == {"statuses": ["skipped"]}
    assert got("fine", "training") == [("", "reused")]
    # Failures keep their tracebacks / child output; the reports name what is left to run.
    errors = (tmp_path / "out" / files.ERRORS).read_text()
    assert "RuntimeError: boom" in errors and "Traceback" in errors
    assert render.remaining_stages(report.records) == ["correctness", "training"]
    command = render.next_command(report.records)
    assert command.endswith("--stages correctness,training "
                            "--items '^(reuse\\ first|slow|raises|oom|exits|segfaults|hangs|cases)'")
    assert command in (tmp_path / "out" / files.REPORT_MD).read_text()


def test_a_second_call_merged_in_clears_what_was_left(tmp_path):
    module = tmp_path / "faulty.py"
    module.write_text(FAULTY)

    def plan_needing(seconds):
        def plan(ctx):
            yield Item("done before", f"{module}:fine", {"value": 2})
            yield Item("fine", f"{module}:fine", {"value": 1}, min_s=seconds)
        return plan

    first, runner = _runner(tmp_path / "one", 60)
    runner.run_stage("training", plan_needing(1e6), Context(QUICK, {}, first.records), budget_s=30)
    assert [(r["item"], r["status"]) for r in first.records] == [("done before", "ok"), ("fine", "skipped")]
    assert render.next_command(first.records).endswith("--stages training --items '^(fine)'")
    second, runner = _runner(tmp_path / "two", 60, item_filter="^(fine)")
    runner.run_stage("training", plan_needing(0), Context(QUICK, {}, second.records), budget_s=30)
    assert [r["item"] for r in second.records] == ["fine"]  # what the filter left out is not recorded
    done = _script("--render", str(tmp_path / "one" / files.RESULTS), str(tmp_path / "two" / files.RESULTS),
                   "--out", str(tmp_path / "merged"))
    assert done.returncode == 0, done.stderr
    merged = json.loads((tmp_path / "merged" / files.REPORT_JSON).read_text())
    assert merged["remaining_stages"] == [] and merged["next_command"] is None
    assert [(r["item"], r["status"]) for r in merged["records"]] == [
        ("done before", "ok"), ("fine", "skipped"), ("fine", "ok")]
    assert "Not measured" not in (tmp_path / "merged" / files.REPORT_MD).read_text()


def test_full_profile_without_a_gpu_skips_the_gpu_stages(tmp_path):
    done = _script("--out", str(tmp_path), "--stages", "kernels", timeout=120)
    assert done.returncode == 0, done.stderr
    report = json.loads((tmp_path / files.REPORT_JSON).read_text())
    kernels = [r for r in report["records"] if r["stage"] == "kernels"]
    assert [r["status"] for r in kernels] == ["skipped"]
    assert "no GPU" in kernels[0]["note"] and "--quick" in kernels[0]["note"]


@pytest.mark.parametrize("args, message", [
    (["--stages", "kernels,warp"], "unknown stage(s) warp; choose from all, env, correctness"),
    (["--budget", "offload"], "--budget 'offload': seconds must be a number"),
    (["--budget", "gpu=3"], "--budget 'gpu=3': unknown stage 'gpu'"),
])
def test_bad_arguments_give_one_line(tmp_path, args, message):
    done = _script("--out", str(tmp_path), *args, timeout=60)
    assert done.returncode == 2 and message in done.stderr and "Traceback" not in done.stderr


# --------------------------------------------------------------------------- pure logic
def _drive(search, fits):
    layers = next(search)
    try:
        while True:
            layers = search.send(fits(layers))
    except StopIteration as stop:
        return stop.value


@pytest.mark.parametrize("start", [5, 30, 37, 38, 60, 120])
def test_layer_search_brackets_the_limit(start):
    result = _drive(layer_search(start, max_layers=200, max_probes=12), lambda layers: layers <= 37)
    assert (result["largest_fits"], result["smallest_fails"], result["exact"]) == (37, 38, True)
    assert len(result["probes"]) <= 12


def test_layer_search_stops_on_a_failed_probe_and_at_the_limits():
    result = _drive(layer_search(10, max_layers=50, max_probes=8), lambda layers: None)
    assert result["probes"] == [[10, None]] and "failed" in result["stopped"]
    result = _drive(layer_search(10, max_layers=12, max_probes=8), lambda layers: True)
    assert result["largest_fits"] == 12 and result["smallest_fails"] is None
    result = _drive(layer_search(3, max_layers=12, max_probes=8), lambda layers: False)
    assert result["largest_fits"] == 0 and result["smallest_fails"] == 1


def _record(stage, item, result, case=""):
    return {"stage": stage, "item": item, "case": case, "status": "ok", "result": result}


def test_targets_from_records():
    attention = [_record("kernels", "attention", {"seq": s, "head_dim": 128, "causal": True, "pass": p,
                                                  "impl": impl, "tflops": tf, "batch": 1, "heads": 16})
                 for s, p, impl, tf in [(16384, "fwd+bwd", "pallas", 300), (16384, "fwd+bwd", "cudnn", 400),
                                        (8192, "fwd+bwd", "pallas", 270), (8192, "fwd+bwd", "cudnn", 300),
                                        (4096, "fwd+bwd", "pallas", 10), (4096, "fwd+bwd", "cudnn", 400),
                                        (8192, "fwd", "pallas", 10), (8192, "fwd", "cudnn", 400)]]
    sparse = [_record("kernels", "block-sparse matmul", {"kind": "dense", "pass": p, "ms": 10.0})
              for p in ("fwd", "fwd+bwd")]
    kept = {"block": 64, "sparsity": 0.9, "kept_blocks": 1, "total_blocks": 10}
    sparse += [_record("kernels", "block-sparse matmul", {"kind": "sparse", "pass": p, "ms": ms, **kept})
               for p, ms in (("fwd", 1.6), ("fwd+bwd", 2.5))]
    training = [_record("training", "1b", {"mfu": 0.47, "params": 1.0e9}),
                _record("training", "125m", {"mfu": 0.6, "params": 1.2e8})]
    offload = [_record("offload", f"ratio {o}/{u}", {"step_s": s})
               for o, u, s in (("none", "device", 0.2), ("optimizer", "device", 0.5),
                               ("optimizer", "host", 0.28))]
    offload += [_record("offload", f"largest {o}/{u}", {"offload": o, "update_on": u, "largest_fits": n,
                                                        "largest_params": p})
                for o, u, n, p in (("none", "device", 70, 3.6e9), ("optimizer", "host", 150, 7.4e9))]
    checks = [_record("correctness", "flash attention", {"passed": ok}, case=case)
              for case, ok in (("a", True), ("b", False))]
    got = {t.name.split(",")[0].split(" (")[0]: t
           for t in targets.evaluate(checks + attention + sparse + training + offload)}
    correct = got["Pallas kernels compiled on the device match the references"]
    assert (correct.value, correct.met) == ("1/2 pass; failing: b", False)
    flash = got["flash attention vs cuDNN"]
    # S=4096 and forward-only rows do not count; 8192 meets 0.9x, 16384 does not.
    assert flash.met is False and flash.value.startswith("0.75x at S=16384")
    assert got["block-sparse at 90% sparsity vs dense"].met is False  # fwd 6.25x but fwd+bwd 4x
    assert got["MFU of the ~1B GPT"].value.startswith("47.0%") and got["MFU of the ~1B GPT"].met
    offload_target = got["optimizer offload step time / no offload"]
    assert offload_target.met and "optimizer/host 1.40x" in offload_target.value
    largest = got["largest trainable GPT with offload / without"]
    assert largest.value == "2.06x (7.40B with optimizer/host vs 3.60B)" and largest.met
    assert got["autocast bf16 tokens/s vs fp32 and vs hand bf16"].value == "not measured"


# --------------------------------------------------------------------------- before a GPU visit
def _kernel_inputs_of_the_gpu_profile():
    """(name, kind, fn, abstract args) of every attention shape the full profile compiles."""
    import jax
    import jax.numpy as jnp

    from benchlib.attention import DTYPES, attention_fn
    from benchlib.timing import forward_and_backward
    from gpureport.profiles import FULL
    sds = jax.ShapeDtypeStruct
    for spec in FULL.attention_checks:
        q = sds((spec["batch"], spec["q_len"], spec["heads"], spec["head_dim"]), DTYPES[spec["dtype"]])
        kv = sds((spec["batch"], spec["kv_len"], spec["kv_heads"], spec["head_dim"]), DTYPES[spec["dtype"]])
        fn = attention_fn("pallas", causal=spec["causal"], window=spec["window"] and tuple(spec["window"]),
                          tuning=spec["tuning"], interpret=False)
        yield spec["name"], "mosaic", forward_and_backward(fn), (q, kv, kv, q)
    tiles = FULL.attention_tiles
    # A configuration both timed and tiled is lowered once per tile choice.
    timed = FULL.attention_timing["configs"]
    for config in timed + [c for c in tiles["configs"] if c not in timed]:
        shape = (config["tokens"] // config["seq"], config["seq"], config["width"] // config["head_dim"],
                 config["head_dim"])
        q = sds(shape, jnp.bfloat16)
        for blocks in [None] + (tiles["candidates"] if config in tiles["configs"] else []):
            fn = attention_fn("pallas", causal=config["causal"], tuning=blocks, interpret=False)
            yield f"{config} {blocks}", "mosaic", forward_and_backward(fn), (q, q, q, q)


def _block_sparse_inputs_of_the_gpu_profile():
    """(name, fn, abstract args) of every block-sparse shape the full profile compiles."""
    import functools

    import jax

    from benchlib.attention import DTYPES
    from benchlib.timing import forward_and_backward
    from gpureport.profiles import FULL
    from pallas_kernels import block_sparse_matmul, random_layout
    sds = jax.ShapeDtypeStruct
    timing = FULL.block_sparse_timing
    checks = [dict(c) for c in FULL.block_sparse_checks] + [
        dict(m=timing["m"], k=timing["k"], n=timing["n"], block=b, density=1 - s, dtype="bf16", block_m=64)
        for b in timing["block_sizes"] for s in timing["sparsities"]]
    for spec in checks:
        block = spec["block"]
        layout = random_layout(spec["k"] // block, spec["n"] // block, spec["density"], seed=0)
        fn = functools.partial(block_sparse_matmul, layout=layout, block_size=spec["block"],
                               block_m=spec["block_m"], interpret=False)
        dtype = DTYPES[spec["dtype"]]
        args = (sds((spec["m"], spec["k"]), dtype), sds((int(layout.sum()), block, block), dtype),
                sds((spec["m"], spec["n"]), dtype))
        yield str(spec), forward_and_backward(fn), args


def test_every_attention_shape_of_the_gpu_profile_lowers_for_cuda():
    """What can be checked without a GPU: each attention shape the report will compile lowers
    for CUDA to three Mosaic GPU kernels (forward, dQ, dK/dV); ptxas, shared memory at run time
    and speed are only checked on the GPU."""
    from pallas_kernels import _mgpu
    count = 0
    for name, kind, fn, args in _kernel_inputs_of_the_gpu_profile():
        assert kind == "mosaic", name
        assert _mgpu.lower_for_cuda(fn, *args) == 3, name  # forward + two backward kernels
        count += 1
    assert count > 10


def test_every_block_sparse_shape_of_the_gpu_profile_compiles_for_h100():
    """Each block-sparse shape the report will run, compiled for an abstract H100: three Mosaic
    GPU kernels (forward, dx, dblocks) within the H100's shared memory."""
    from helpers import require_cuda_plugin
    require_cuda_plugin()
    import jax
    from jax.sharding import NamedSharding, PartitionSpec

    from pallas_kernels._mosaic import kernel_names
    from zeroflow.backend import target_mesh

    on_h100 = NamedSharding(target_mesh("h100", data=1), PartitionSpec())
    count = 0
    for name, fn, args in _block_sparse_inputs_of_the_gpu_profile():
        args = [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=on_h100) for a in args]
        with jax.sharding.use_abstract_mesh(on_h100.mesh.abstract_mesh):
            hlo = jax.jit(fn).trace(*args).lower().compile().as_text()
        assert kernel_names(hlo) == ["block_sparse_dblocks", "block_sparse_dx",
                                     "block_sparse_matmul"], name
        count += 1
    assert count == 10


def test_next_command_names_the_skipped_items_and_shares_the_time_limit():
    skip = {"status": "skipped", "note": render.BUDGET_SKIP + " (3 s left)", "case": "", "result": None}
    done = {"status": "ok", "case": ""}
    records = [{"stage": render.META, "item": "run", "result": {"profile": "full"}, **done},
               {"stage": "offload", "item": "ratio optimizer/host", "result": {}, **done},
               {"stage": "offload", "item": "largest none/device L=74", **skip},
               {"stage": "autocast", "item": "autocast bf16", **skip}]
    # budgets offload 240 + autocast 100 stretched to 540 - 60 / 2 = 510 s: x1.5
    assert render.next_command(records) == (
        "PYTHONPATH=. python scripts/gpu_report.py --out $OUT --stages offload,autocast "
        "--items '^(largest\\ none/device|autocast\\ bf16)' --budget offload=360 --budget autocast=150")


def test_the_gpu_profile_plans_every_stage(tmp_path):
    """Drive each stage's plan of the full (GPU) profile with made-up outcomes, as if on an
    80 GB GPU where a model trains up to 80 layers: every item is runnable as planned, and the
    largest-model search brackets the limit without ever exceeding the host's memory."""
    from benchlib import gpt
    from benchlib.isolate import load_target
    from gpureport.profiles import FULL
    from gpureport.runner import Outcome
    from gpureport.stages import autocast, offload
    env = {"stage": "env", "item": "environment", "case": "", "status": "ok",
           "result": {"backend": "gpu", "bytes_limit": 0.92 * 80e9}}
    ctx = Context(FULL, host={"mem_available_bytes": 120e9}, records=[env], stages=STAGE_ORDER)
    planned = {}
    for name in STAGE_ORDER:
        steps, sent = STAGES[name].plan(ctx), None
        while True:
            try:
                step = steps.send(sent)
            except StopIteration:
                break
            planned.setdefault(name, []).append(step)
            if isinstance(step, Summary):
                sent = None
                continue
            load_target(step.target)
            json.dumps(step.kwargs)
            layers = step.kwargs.get("model", {}).get("num_layers", 0)
            status = "oom" if step.name.startswith("largest") and layers > 80 else "ok"
            sent = Outcome(status, [{"status": status, "result": {"fits": True}}])
    names = {name: [s.name for s in steps] for name, steps in planned.items()}
    # each memory configuration, then the same compiled for the GPU's abstract twin
    assert names["memory"] == [name for label, _ in FULL.training_runs
                               for name in (label, label + " / deviceless")]
    assert names["training"] == [label for label, _ in FULL.training_runs]
    # the training stage runs in the same call; the abstract twin's compile runs on its own
    assert all(s.reuse_only != s.name.endswith(" / deviceless") for s in planned["memory"])
    assert names["offload"][:3] == ["ratio none/device", "ratio optimizer/device", "ratio optimizer/host"]
    summaries = {s.name: s.result for s in planned["offload"] if isinstance(s, Summary)}
    host_limit = 120e9 * FULL.largest["host_memory_fraction"]
    for name, found in summaries.items():
        assert found["largest_fits"] <= 80 and (found["smallest_fails"] or 10**9) > 80, name
        assert 0 < len(found["probes"]) <= FULL.largest["max_probes"]
        assert found["predicted_layers"] > 20  # the estimator's guess for 73.6 GB, width 2048
        for layers, _ in found["probes"]:
            spec = offload._with(FULL.largest["base"], found["offload"], found["update_on"], layers)
            assert gpt.estimate(spec).host_bytes <= host_limit
    expected = ([label for label, *_ in FULL.autocast["modes"]] if autocast.autocast_available()
                else ["autocast"])
    assert names["autocast"] == expected
    # an env record without a compute capability or a known device kind: FP8 is measured
    assert names["fp8"] == ["fp8 GEMM 8192^3", "fp8 step", "fp8 saved activations save_dots/compute",
                            "fp8 saved activations save_dots/fp8"]


def test_mfu_falls_back_to_the_measured_matmul_for_an_unknown_gpu():
    env = _record("env", "environment", {"backend": "gpu", "matmul_bf16_flops": 500e12})
    run = _record("training", "1b", {"mfu": None, "params": 1.0e9, "tokens_per_s": 40000.0,
                                     "flops_per_token": 6.0e9})
    [target] = [t for t in targets.evaluate([env, run]) if t.name.startswith("MFU")]
    assert target.value.startswith("48.0%* (1b)") and target.met  # 6e9 * 4e4 / 5e14
