"""What the planner cannot plan, through ``python -m zeroflow.memory``, ``python -m
zeroflow.planner`` and ``zf.plan``: an unknown model type, a loss that does not trace, a GPU
target not in the table, a device count that does not split the batch. Each is one line naming
it and what is accepted (exit 2 from the commands), before anything is compiled or written."""

import json

import jax
import jax.numpy as jnp
import optax
import pytest

import zeroflow as zf
from helpers import REPO
from zeroflow.cli import memory, planner
from zeroflow.planner.compiling import Compiler

pytestmark = pytest.mark.fast

TINY = str(REPO / "configs" / "tiny.yaml")  # batch 16


@pytest.fixture
def compiles(monkeypatch):
    """Every plan the planner or the memory table would compile (none is)."""
    asked = []

    def measure(self, problem, choice, where):
        asked.append(choice)
        return "not compiled by this test"

    monkeypatch.setattr(Compiler, "measure", measure)
    return asked


def _bert(folder):
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({
        "model_type": "bert", "hidden_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 2, "intermediate_size": 128, "vocab_size": 100}))
    return folder


@pytest.mark.parametrize("main, argv, named, accepted", [
    (memory.main, ["--target", "x100"], "x100", "h100"),
    (planner.main, ["--gpus", "h100,x100"], "x100", "h100"),
    (memory.main, ["--devices", "3"], "3 data devices", "train.batch_size 16"),
    (planner.main, ["--devices", "3"], "3 devices", "1, 2, 4, 8, 16"),
    (memory.main, ["model.init_from={bert}"], "model_type='bert'", "LlamaForCausalLM"),
    (planner.main, ["model.init_from={bert}"], "model_type='bert'", "LlamaForCausalLM"),
], ids=["memory-target", "planner-gpus", "memory-devices", "planner-devices", "memory-bert",
        "planner-bert"])
def test_what_cannot_be_planned_is_one_line_before_any_compile(
        main, argv, named, accepted, tmp_path, capsys, compiles):
    out = tmp_path / "plans"
    bert = _bert(tmp_path / "bert")
    argv = ["--config", TINY, *(a.format(bert=bert) for a in argv)]
    if main is planner.main:
        argv += ["--out", str(out)]
    try:
        code = main(argv)
    except SystemExit as e:  # argparse and the memory command end the process themselves
        code = e.code
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert named in err[0] and accepted in err[0], err[0]
    assert compiles == [] and not out.exists()


def test_a_loss_that_does_not_trace_is_one_error_before_any_compile(compiles):
    """The loss multiplies a batch of width 9 by 8 x 8 weights: jax's own shape error, said
    once for the whole plan, not once per plan compiled."""
    s = jax.ShapeDtypeStruct
    params, batch = {"w": s((8, 8), jnp.float32)}, {"x": s((4, 9), jnp.float32)}
    with pytest.raises(ValueError, match=r"loss_fn\(params, batch\) does not trace") as caught:
        zf.plan(lambda p, b: jnp.mean(b["x"] @ p["w"]), params, batch, optax.adam(1e-3),
                devices=(1,))
    assert "dot_general" in str(caught.value) and "\n" not in str(caught.value)
    assert compiles == []
