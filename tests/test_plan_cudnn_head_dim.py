"""The planner leaves cuDNN attention out of a target's search where the target's cuDNN cannot
run the model's head dim (256, as Gemma 2/3's, on an A100 or L4), says why once per GPU under
the table, and plans the row with XLA attention; where cuDNN was the only attention asked for,
the row says the reason instead of "nothing fits". XLA is replaced by a stand-in compiler
whose peaks are the what-if's predictions, so nothing is compiled.

The reference is the rule as jax states it for cuDNN flash attention (bf16/fp16): head dims
that are multiples of 8, up to 128 before compute capability 9.0 and up to 256 from it; the
capabilities are NVIDIA's (A100 8.0, L4 8.9, H100 9.0)."""
import pytest
from rich.console import Console

from zeroflow.config.io import apply_overrides, load_config
from zeroflow.planner import library, results
from zeroflow.planner import where as places
from zeroflow.planner.compiling import Compiler, Measured
from zeroflow.planner.whatif import what_if

pytestmark = pytest.mark.fast

CAPABILITY = {"a100": (8, 0), "l4": (8, 9), "h100": (9, 0)}


def cudnn_takes(head_dim: int, gpu: str) -> bool:
    limit = 256 if CAPABILITY[gpu] >= (9, 0) else 128
    return head_dim % 8 == 0 and head_dim <= limit


class StandIn(Compiler):
    """Every plan's compiled peak: the what-if's prediction; the choices compiled, kept."""

    def __init__(self, scratch):
        super().__init__(scratch)
        self.tried = []

    def _compile(self, problem, choice, where):
        self.compiles += 1
        self.tried.append((where.name, choice))
        peak = what_if(problem, choice, where).predicted_bytes
        return Measured(peak_bytes=peak, host_bytes=0.0, compile_s=0.0)


def tiny(head_dim: int):
    return apply_overrides(load_config("configs/tiny.yaml"), [
        "model.num_layers=1", "model.num_heads=2", f"model.head_dim={head_dim}",
        "model.attention=cudnn", "precision.params=bf16", "train.batch_size=8"])


def plan(monkeypatch, head_dim, gpus, attentions=None):
    made = []
    monkeypatch.setattr(library, "Compiler", lambda scratch: made.append(StandIn(scratch))
                        or made[-1])
    found = library.plan_config(tiny(head_dim), name="tiny", gpus=gpus, devices=[1, 8],
                                attentions=attentions, max_compiles=2, min_compiles=1)
    console = Console(record=True, width=400)
    results.render(found, console)
    return found, made[0].tried, console.export_text()


@pytest.mark.parametrize("gpu", ["a100", "l4", "h100"])
@pytest.mark.parametrize("head_dim", [64, 128, 136, 256, 260])
def test_cudnn_stays_in_the_space_exactly_where_the_gpu_runs_the_head_dim(gpu, head_dim):
    model = library.ConfigProblem(tiny(head_dim)).model
    space = library.space_for(model, places.target(gpu, 1), stages=(0,), remats=("none",),
                              attentions=None, zeropp=False, grad_accums=None)
    if cudnn_takes(head_dim, gpu):
        assert space.attentions == ("cudnn",) and space.notes == ()
    else:
        assert space.attentions == ("xla",)
        assert len(space.notes) == 1 and f"model.head_dim={head_dim}" in space.notes[0]
        assert space.notes[0].endswith("planned with xla attention")


def test_a100_rows_plan_with_xla_and_say_why_once(monkeypatch):
    found, tried, text = plan(monkeypatch, 256, ["a100", "h100"])
    assert {c.attention for gpu, c in tried if gpu == "a100"} == {"xla"}
    assert {c.attention for gpu, c in tried if gpu == "h100"} == {"cudnn"}
    by_gpu = {(r.where.name, r.where.devices): r for r in found.rows}
    for devices in (1, 8):
        assert by_gpu["a100", devices].best.choice.attention == "xla"
        assert by_gpu["h100", devices].best.choice.attention == "cudnn"
    line = ("a100: cuDNN attention needs head dim <= 128 before sm_90 (model.head_dim=256, "
            "a100 is sm_80); planned with xla attention")
    assert text.count(line) == 1
    assert text.count("cuDNN attention needs") == 1
    assert "nothing fits" not in text
    assert found.as_json()["rows"][0]["notes"] == [line.removeprefix("a100: ")]


def test_cudnn_asked_for_alone_the_row_says_why_instead_of_nothing_fits(monkeypatch):
    found, tried, text = plan(monkeypatch, 256, ["a100", "h100"], attentions=["cudnn"])
    assert {gpu for gpu, _ in tried} == {"h100"}  # nothing compiled for the A100
    reason = "cuDNN attention needs head dim <= 128 before sm_90 (model.head_dim=256, a100 is sm_80)"
    a100 = [line for line in text.splitlines() if line.startswith("│ a100")]
    assert len(a100) == 2 and all(reason in line for line in a100)
    assert "nothing fits" not in text and "could work" not in text
    assert not found.advice
    assert all(r.best is not None for r in found.rows if r.where.name == "h100")


@pytest.mark.parametrize("gpu", ["a100", "h100"])
def test_the_memory_table_figures_xla_where_the_target_refuses_cudnn_and_says_why_once(gpu):
    from zeroflow.planner import memory_table
    table = memory_table.build(tiny(256), devices=1, device_memory=80e9, title="tiny",
                               measure="never", target=gpu)
    rows = [table.as_json(c) for c in table.rows]
    console = Console(record=True, width=400)
    memory_table.render(table, console=console, show_all=True)
    text = console.export_text()
    answer = text.strip().splitlines()[-1]
    if cudnn_takes(256, gpu):
        assert all("attention" not in r for r in rows) and "cuDNN attention needs" not in text
        assert "model.attention" not in answer
        return
    line = ("a100: cuDNN attention needs head dim <= 128 before sm_90 (model.head_dim=256, "
            "a100 is sm_80); figured with model.attention=xla")
    assert len(rows) > 1 and {r["attention"] for r in rows} == {"xla"}
    assert text.count(line) == 1 and text.count("cuDNN attention needs") == 1
    assert answer.startswith("Cheapest choice") and answer.split(" (needs")[0].endswith(
        "model.attention=xla")
    assert all(r["attention_why"] == line for r in rows)
