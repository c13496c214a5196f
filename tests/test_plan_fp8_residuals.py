"""The planner's search with FP8 residuals (``model.remat_dtype: fp8``) among its choices: a plan
keeps them only where the same plan in the compute dtype does not fit. XLA is replaced by a
stand-in compiler whose peaks are the activation formula's prediction for the tiny config, so
nothing is compiled; the memory of the row is set between the two dtypes' predictions."""
import pytest

from zeroflow.config.io import apply_overrides, load_config
from zeroflow.planner import where as places
from zeroflow.planner.choices import Choice, Space, enumerate_choices, needs_more
from zeroflow.planner.compiling import Compiler, Measured
from zeroflow.planner.problems import ConfigProblem
from zeroflow.planner.search import HELD_BACK, search_row
from zeroflow.planner.whatif import what_if

pytestmark = pytest.mark.fast

# Long rows of a small model: the saved activations dominate the peak.
TINY = ["model.seq_len=1024", "train.batch_size=8", "precision.params=bf16"]


class StandIn(Compiler):
    """Every plan's compiled peak: the what-if's prediction (the activation formula's)."""

    def __init__(self):
        super().__init__("/nonexistent")
        self.tried = []

    def _compile(self, problem, choice, where):
        self.compiles += 1
        self.tried.append(choice)
        peak = what_if(problem, choice, where).predicted_bytes
        return Measured(peak_bytes=peak, host_bytes=0.0, compile_s=0.0)


def space(*remats):
    return Space(stages=(0,), offloads=(("none", "device"),), remats=remats,
                 attentions=("xla",), grad_accums=(1,), zeropp=False)


def predicted(problem, remat, dtype):
    choice = Choice(0, grad_accum=1, remat=remat, attention="xla", remat_dtype=dtype)
    return what_if(problem, choice, places.local(1)).predicted_bytes


def search(problem, memory, *remats):
    compiler = StandIn()
    row = search_row(problem, places.local(1, int(memory)), space(*remats), compiler,
                     margin=0.0, max_compiles=3, min_compiles=2)
    return row, compiler


@pytest.fixture(scope="module")
def problem():
    return ConfigProblem(apply_overrides(load_config("configs/tiny.yaml"), TINY), "tiny")


def test_fp8_residuals_are_listed_only_beside_a_policy_that_saves_something():
    choices = enumerate_choices(space("none", "save_dots", "full"), devices=1, batch_size=8,
                                hosts=1, compute_dtype="bf16")
    assert sorted((c.remat, c.remat_dtype) for c in choices) == [
        ("full", "compute"), ("full", "fp8"), ("none", "compute"),
        ("save_dots", "compute"), ("save_dots", "fp8")]
    model_own = enumerate_choices(Space(stages=(0,), offloads=(("none", "device"),),
                                        grad_accums=(1,)), devices=1,
                                  batch_size=8, hosts=1, compute_dtype="bf16")
    assert [c.remat_dtype for c in model_own] == [None]  # a model's own remat: its own dtype
    # FP8 residuals need less than the compute dtype's, never more
    f8, bf = (Choice(0, remat="save_dots", remat_dtype=d) for d in ("fp8", "compute"))
    assert needs_more(bf, f8) and not needs_more(f8, bf)


def test_only_the_fp8_plan_fits_so_it_is_chosen(problem):
    compute, fp8 = (predicted(problem, "save_dots", d) for d in ("compute", "fp8"))
    assert fp8 < compute * 0.95  # the rows are long enough for FP8 to matter
    row, _ = search(problem, (compute + fp8) / 2, "save_dots")
    assert row.best is not None
    assert (row.best.choice.remat, row.best.choice.remat_dtype) == ("save_dots", "fp8")
    assert "model.remat_dtype=fp8" in problem.overrides(row.best.choice, 1)
    assert "remat save_dots in fp8" in row.best.choice.label()


def test_the_compute_plan_fits_so_fp8_is_never_compiled(problem):
    compute = predicted(problem, "save_dots", "compute")
    row, compiler = search(problem, compute * 1.05, "save_dots")
    assert row.best.choice.remat_dtype == "compute"
    assert all(c.remat_dtype == "compute" for c in compiler.tried)
    held = [c for c in row.candidates if c.choice.remat_dtype == "fp8"]
    assert [c.reason for c in held] == [HELD_BACK]
    assert not any("remat_dtype" in o for o in problem.overrides(row.best.choice, 1))


def test_fp8_save_dots_beats_full_remat_in_the_compute_dtype_where_only_they_fit(problem):
    """save_dots in fp8 and full remat in bf16 both fit, save_dots in bf16 does not: the one
    that recomputes less (the what-if's step, XLA:CPU giving none) is the plan."""
    compute = predicted(problem, "save_dots", "compute")
    fp8 = predicted(problem, "save_dots", "fp8")
    full = predicted(problem, "full", "compute")
    assert max(fp8, full) < compute
    row, _ = search(problem, (max(fp8, full) + compute) / 2, "save_dots", "full")
    assert (row.best.choice.remat, row.best.choice.remat_dtype) == ("save_dots", "fp8")


def test_a_compute_plan_of_a_config_in_fp8_says_so(problem):
    f8 = ConfigProblem(apply_overrides(problem.cfg, ["model.remat=full",
                                                      "model.remat_dtype=fp8"]), "tiny fp8")
    choice = Choice(0, remat="save_dots", remat_dtype="compute")
    assert "model.remat_dtype=compute" in f8.overrides(choice, 1)
    assert not any("remat_dtype" in o for o in f8.overrides(Choice(0, remat="save_dots"), 1))


def test_fp8_is_never_the_best_where_the_same_plan_in_the_compute_dtype_fits():
    """Both compiled and both fit, FP8 with the smaller peak and an equal step: the compute
    dtype's is the plan; with the compute one over the memory, FP8's."""
    from zeroflow.planner.search import COMPILED, Candidate, Row, best_of
    from zeroflow.planner.whatif import WhatIf

    def cand(dtype, peak):
        return Candidate(Choice(0, remat="save_dots", remat_dtype=dtype), WhatIf(0, 0, 0, 1.0),
                         COMPILED, measured=Measured(peak_bytes=peak, host_bytes=0.0,
                                                     compile_s=0.0))

    bf, f8 = cand("compute", 900), cand("fp8", 600)
    here = places.local(1, 1000)
    assert best_of(Row(here, 1000, [f8, bf]), StandIn()) is bf
    assert best_of(Row(here, 800, [f8, bf]), StandIn()) is f8
