"""The planner with FP8 matmuls (``--fp8``, ``Space.fp8_matmuls``, ``zf.plan(fp8=True)``): only
when asked for, only on GPUs with FP8 tensor cores (the vendors' compute capabilities), FP8
weight gathers only beside FP8 matmuls, a pick with FP8 matmuls only on a shorter step or where
its plan without them does not fit, and overrides that make the config compile FP8. Searches run
against a stand-in compiler (nothing compiled) except the one XLA:CPU compile of the overrides;
the XLA:GPU (H100) checks are in test_plan_fp8_h100.py."""
import pytest

import zeroflow as zf
from zeroflow.cli import plan_flags, planner
from zeroflow.config.io import ConfigError, apply_overrides, load_config
from zeroflow.planner import where as places
from zeroflow.planner.choices import Choice, Space, enumerate_choices, with_fp8
from zeroflow.planner.compiling import Compiler, Measured
from zeroflow.planner.problems import ConfigProblem
from zeroflow.planner.search import search_row
from zeroflow.planner.whatif import what_if
from helpers import REPO

pytestmark = pytest.mark.fast

TINY = str(REPO / "configs" / "tiny.yaml")
BF16 = ["precision.params=bf16"]
CAPABILITY = {"h100": (9, 0), "h200": (9, 0), "l4": (8, 9), "a100": (8, 0), "v100": (7, 0)}
"NVIDIA's compute capabilities; FP8 tensor cores from 8.9 (Ada) on."


class StandIn(Compiler):
    """Peaks and XLA step estimates by whether a plan has FP8 matmuls: ``figures[fp8]`` is
    ``(peak bytes, step microseconds)``."""

    def __init__(self, figures):
        super().__init__("/nonexistent")
        self.figures, self.tried = figures, []

    def _compile(self, problem, choice, where):
        self.compiles += 1
        self.tried.append(choice)
        peak, us = self.figures[choice.fp8_matmuls()]
        return Measured(peak_bytes=peak, host_bytes=0.0, compile_s=0.0, xla_us=us, timed=True)


@pytest.fixture(scope="module")
def problem():
    return ConfigProblem(apply_overrides(load_config(TINY), BF16), "tiny")


def one_plan(fp8=True):
    return Space(stages=(0,), offloads=(("none", "device"),), grad_accums=(1,), zeropp=False,
                 fp8_matmuls=fp8)


def search(problem, where, figures, **limits):
    compiler = StandIn(figures)
    limits = {"max_compiles": 3, "min_compiles": 2, **limits}
    row = search_row(problem, where, one_plan(), compiler, margin=0.0, **limits)
    return row, compiler


def test_fp8_matmuls_and_gathers_are_listed_only_when_asked_for():
    """Stage 3 on 8 devices: FP8 gathers stand in for int8 qwZ beside FP8 matmuls, never
    without them; without the opt-in no plan has FP8 matmuls."""
    space = dict(stages=(3,), offloads=(("none", "device"),), grad_accums=(1,))
    asked = enumerate_choices(Space(**space, fp8_matmuls=True), devices=8, batch_size=8,
                              hosts=1, compute_dtype="bf16")
    got = {(c.autocast, c.quantize_weights, c.quantize_grads) for c in asked}
    exact = {(None, qw, qg) for qw in (None, "int8") for qg in (None, "int8")}
    assert got == exact | {("fp8", qw, qg) for qw in (None, "fp8") for qg in (None, "int8")}
    plain = enumerate_choices(Space(**space), devices=8, batch_size=8, hosts=1,
                              compute_dtype="bf16")
    assert {(c.autocast, c.quantize_weights, c.quantize_grads) for c in plain} == exact
    label = Choice(3, quantize_weights="fp8", autocast="fp8").label()
    assert "fp8 matmuls" in label and "fp8 gathers" in label and "qwZ" not in label


@pytest.mark.parametrize("gpu", sorted(CAPABILITY))
def test_only_gpus_with_fp8_tensor_cores_keep_fp8_matmuls(gpu):
    space = with_fp8(Space(fp8_matmuls=True), places.target(gpu, 8))
    major, minor = CAPABILITY[gpu]
    if (major, minor) >= (8, 9):
        assert space.fp8_matmuls and space.notes == ()
    else:
        assert not space.fp8_matmuls
        assert len(space.notes) == 1 and f"{gpu} is sm_{major}{minor}" in space.notes[0]
        assert "planned without them" in space.notes[0]


@pytest.mark.parametrize("argv, named", [
    (["--gpus", "a100,v100"], "a100 is sm_80"),
    (["model.layer_chunk=64"], "model.layer_chunk"),
    (["precision.params=fp16", "precision.loss_scale=dynamic"], "params='fp16'"),
], ids=["no-gpu-has-fp8", "layer-chunk", "fp16"])
def test_fp8_that_cannot_be_planned_is_one_line_before_any_compile(
        argv, named, tmp_path, capsys, monkeypatch):
    """Where no GPU asked for has FP8 tensor cores, or the config refuses FP8 matmuls."""
    asked = []
    monkeypatch.setattr(Compiler, "measure", lambda self, *a: asked.append(a) or "no")
    monkeypatch.setattr(plan_flags, "require_cuda_plugin", lambda *a, **k: None)
    out = tmp_path / "plans"
    code = planner.main(["--config", TINY, "--fp8", "--out", str(out), *argv])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert "--fp8" in err[0] and named in err[0], err[0]
    assert asked == [] and not out.exists()


@pytest.mark.parametrize("autocast", ["fp8", "bf16"])
def test_a_config_refuses_autocast_with_layer_chunk(autocast):
    """The chunked layer is a custom_vjp autocast does not enter: its matmuls would stay in
    precision.params, whatever autocast was asked for."""
    with pytest.raises(ConfigError, match=f"precision.autocast={autocast} .*model.layer_chunk"):
        overrides = ["precision.params=fp32", "model.layer_chunk=64"]
        apply_overrides(load_config(TINY), [*overrides, f"precision.autocast={autocast}"])


def test_the_roofline_runs_fp8_matmuls_faster_only_where_the_gpu_has_fp8(problem):
    """The what-if orders compiles: an H100's FP8 peak is twice its bf16 peak (989 -> 1979
    TFLOP/s), an A100 has none, the emulated CPU devices none."""
    for where, faster in [(places.target("h100", 8), True), (places.target("a100", 8), False),
                          (places.local(1), False)]:
        bf, f8 = (what_if(problem, Choice(0, autocast=a), where).prior_s
                  for a in (None, "fp8"))
        assert (f8 < bf) if faster else (f8 == bf), where.name


def test_a_faster_fp8_plan_is_picked_after_its_plan_without_fp8_compiled(problem):
    """On an H100 the roofline puts the FP8 plan first; with one compile allowed the search
    still compiles the same plan without FP8 before picking (XLA's estimates decide)."""
    row, compiler = search(problem, places.target("h100", 1), {True: (5e6, 80.0),
                                                               False: (6e6, 100.0)},
                           max_compiles=1, min_compiles=1)
    assert [c.autocast for c in compiler.tried] == ["fp8", None]
    assert row.best.choice.fp8_matmuls()
    overrides = problem.overrides(row.best.choice, 1)
    assert apply_overrides(problem.cfg, overrides).precision.autocast == "fp8"


def test_fp8_never_wins_a_tie_and_wins_where_only_it_fits(problem):
    gb = places.local(1, int(1e9))
    tie, _ = search(problem, gb, {True: (5e8, 100.0), False: (6e8, 100.0)})
    assert not tie.best.choice.fp8_matmuls()
    slower, _ = search(problem, gb, {True: (5e8, 120.0), False: (6e8, 100.0)})
    assert not slower.best.choice.fp8_matmuls()
    only, _ = search(problem, gb, {True: (9e8, 120.0), False: (1.1e9, 100.0)})
    assert only.best.choice.fp8_matmuls()


def test_overrides_of_an_fp8_plan_compile_fp8_matmuls(problem):
    """The overrides the planner writes, applied to the config, compile FP8 (XLA:CPU keeps the
    e4m3 casts); without FP8 matmuls none are there and no precision key is written."""
    cfg = apply_overrides(problem.cfg, ["precision.fp8_select=all"])  # tiny: else all bf16
    fp8, plain = Choice(0, autocast="fp8"), Choice(0)
    assert not any(o.startswith("precision.") for o in problem.overrides(plain, 1))
    texts = [ConfigProblem(cfg).compile(c, places.local(1), {})[0].as_text()
             for c in (fp8, plain)]
    assert "f8e4m3fn" in texts[0] and "f8e4m3fn" not in texts[1]


@pytest.mark.parametrize("fp8, autocasts", [(True, ["none", "fp8"]), (False, ["none"])])
def test_zf_plan_compiles_its_fp8_plans_under_fp8_autocast(fp8, autocasts, monkeypatch):
    import jax
    import jax.numpy as jnp
    import optax

    from zeroflow.planner import problems

    asked = []

    def compile_step(loss_fn, params, batch, tx, plan, prec, **kw):
        asked.append(prec.autocast)
        raise RuntimeError("not compiled by this test")

    monkeypatch.setattr(problems, "compile_step", compile_step)
    s = jax.ShapeDtypeStruct
    params, batch = {"w": s((8, 8), jnp.float32)}, {"x": s((4, 8), jnp.float32)}
    zf.plan(lambda p, b: jnp.mean(b["x"] @ p["w"]), params, batch, optax.adam(1e-3),
            devices=(1,), stages=(0,), offloads=(("none", "device"),), grad_accums=(1,),
            fp8=fp8, precision=zf.Precision(params="bf16"))
    assert sorted(asked) == sorted(autocasts)
