"""A compile that fails (an error, not a peak over the memory) does not use up a row's
``max_compiles``: the search turns to the plans of another attention kernel, and a row where
everything fails stops after ``MAX_FAILURES``. The advice names a failed compile as such, with
its reason, never as "does not fit". XLA is replaced by a stand-in compiler whose peaks are the
ZeRO formula's prediction and which raises for one attention kernel: nothing is compiled."""
import jax
import jax.numpy as jnp
import optax
import pytest

from zeroflow.autocast.precision import Precision
from zeroflow.planner import where as places
from zeroflow.planner.advice import Advice
from zeroflow.planner.choices import Space
from zeroflow.planner.compiling import Compiler, Measured, failure_reason
from zeroflow.planner.problems import ModelProblem
from zeroflow.planner.results import failure_lines
from zeroflow.planner.search import COMPILED, FAILED, MAX_FAILURES, search_row
from zeroflow.planner.whatif import what_if

pytestmark = pytest.mark.fast

WIDTH, LAYERS, BATCH = 64, 2, 8


def mlp_loss(params, batch):
    x = batch["x"]
    for w in params["layers"]:
        x = jnp.tanh(x @ w)
    return jnp.mean((x - batch["y"]) ** 2)


def problem() -> ModelProblem:
    s = jax.ShapeDtypeStruct
    params = {"layers": [s((WIDTH, WIDTH), jnp.float32) for _ in range(LAYERS)]}
    batch = {"x": s((BATCH, WIDTH), jnp.float32), "y": s((BATCH, WIDTH), jnp.float32)}
    return ModelProblem(mlp_loss, params, batch, optax.adam(1e-3), Precision())


class StandIn(Compiler):
    """Peaks as the what-if predicts them; ``failing`` attention kernels raise as XLA would."""

    def __init__(self, failing: set):
        super().__init__("/nonexistent")
        self.failing, self.tried = failing, []

    def _compile(self, problem, choice, where):
        self.compiles += 1
        self.tried.append(choice)
        if choice.attention in self.failing:
            return failure_reason(RuntimeError(f"INTERNAL: no {choice.attention} kernel\nmore"))
        peak = what_if(problem, choice, where).predicted_bytes
        return Measured(peak_bytes=peak, host_bytes=0.0, compile_s=0.0)


# cuDNN first: the what-if cannot tell the kernels apart, so the listed order ranks them.
SPACE = Space(stages=(0, 1, 2, 3), offloads=(("none", "device"),), attentions=("cudnn", "xla"),
              grad_accums=(1, 2), zeropp=False)


def search(failing: set, max_compiles: int = 1, min_compiles: int = 1):
    compiler = StandIn(failing)
    row = search_row(problem(), places.local(4, 10**9), SPACE, compiler, margin=0.0,
                     max_compiles=max_compiles, min_compiles=min_compiles)
    return row, compiler


def test_a_failing_kernel_does_not_hide_the_plans_that_fit():
    """Every cuDNN plan fails and cuDNN plans rank first: after the first failure the search
    compiles XLA plans, two of them for a budget of two (the failure not counted)."""
    row, compiler = search({"cudnn"}, max_compiles=2, min_compiles=2)
    assert compiler.tried[0].attention == "cudnn"
    assert [c.choice.attention for c in row.candidates if c.status == FAILED] == ["cudnn"]
    assert [c.choice.attention for c in row.compiled()] == ["xla", "xla"]
    assert row.best is not None and row.best.choice.attention == "xla"
    failed = next(c for c in row.candidates if c.status == FAILED)
    assert failure_lines(row) == [f"{row.where.title}: did not compile ({failed.choice.label()}):"
                                  " RuntimeError: INTERNAL: no cudnn kernel"]


def test_a_config_that_never_compiles_stops_after_max_failures():
    row, compiler = search({"cudnn", "xla"}, max_compiles=3)
    assert row.best is None
    assert compiler.compiles == MAX_FAILURES
    assert sum(c.status == FAILED for c in row.candidates) == MAX_FAILURES
    lines = failure_lines(row)  # one line per reason, each naming a plan and how many more
    assert len(lines) == 2 and all("did not compile (stage" in line for line in lines)
    assert sum(1 + int(line.split(" and ")[1].split()[0]) if " more)" in line else 1
               for line in lines) == MAX_FAILURES


def test_without_failures_the_budget_is_unchanged():
    row, compiler = search(set(), max_compiles=2, min_compiles=2)
    assert compiler.compiles == 2 and len(row.compiled()) == 2
    assert all(c.status != FAILED for c in row.candidates)
    assert row.best is not None and row.best.status == COMPILED


def test_advice_that_failed_to_compile_says_so_with_its_reason():
    failed = Advice("everything offloaded", [], None, 10.83e9, False,
                    failure="RuntimeError: INTERNAL: no cudnn kernel")
    line = failed.line()
    assert "did not compile" in line and "no cudnn kernel" in line
    assert "does not fit" not in line and "()" not in line
    keyed = Advice("8 devices", ["parallel.data=8"], None, 4e9, False, failure="E: x")
    assert keyed.line() == "8 devices: did not compile (parallel.data=8): E: x"
    fits = Advice("8 devices", [], 4e9, 4e9, True)
    assert "()" not in fits.line() and fits.line().endswith("fits")
