"""Every flag of train, sample and export refuses a wrong type, a value out of its range, an
empty value and a huge one in one line naming it (exit 2), and writes nothing.

The cases are generated from the commands' own argparse parsers: each flag is classified by
its type (int, float, text or a choice) and gets that kind's bad values, so a new flag is
swept without a new test, and a flag of a kind the sweep does not know fails it. sample and
export read a real run (trained once), so the flags bounded by the run's model (--tokens by
its context, --top-k by its vocabulary) are checked too."""

import contextlib
import io

import pytest

from zeroflow.cli import export, sample, train
from zeroflow.trainer import train as train_run
from test_run_faults import config

pytestmark = pytest.mark.slow

HUGE = "9" * 30
BAD = {  # what every flag of a kind must refuse
    "int": ["x", "1.5", "", "-1", HUGE, "-" + HUGE],
    "float": ["x", "", "nan", "inf", "-1"],
    "text": [""],
    "choice": ["no-such-choice", ""],
}
CLIS = {  # the flags each needs besides the one under test ({run}: a finished run)
    "train": (train.main, train.parser(), ["run.dir={tmp}/run"]),
    "sample": (sample.main, sample.parser(), ["--run", "{run}", "--temperature", "0"]),
    "export": (export.main, export.parser(), ["--run", "{run}", "--out", "{tmp}/w.npz"]),
}
def kind(action) -> str | None:
    if action.choices:
        return "choice"
    name = getattr(action.type, "__name__", None) if action.type else "text"
    return {"int": "int", "float": "float", "text": "text", "str": "text"}.get(name)


def flags():
    """``(cli, flag, kind)`` of every flag that takes a value, read off the parsers."""
    for cli, (_, parser, _) in CLIS.items():
        for action in parser._actions:
            if not action.option_strings or action.nargs == 0:  # positional, or a switch
                continue
            yield cli, max(action.option_strings, key=len), kind(action)


FLAGS = list(flags())
CASES = [(cli, flag, value) for cli, flag, k in FLAGS for value in BAD.get(k, [])]


def test_every_flag_is_of_a_kind_the_sweep_knows():
    assert [(cli, flag) for cli, flag, k in FLAGS if k not in BAD] == []
    assert {cli for cli, _, _ in FLAGS} == set(CLIS)


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("finished") / "run"
    train_run(config(run_dir, "train.steps=1"))
    return run_dir


@pytest.mark.parametrize("cli, flag, value", CASES,
                         ids=[f"{c}{f}={v[:6] or 'empty'}" for c, f, v in CASES])
def test_a_bad_value_of_any_flag_is_one_line_naming_it(cli, flag, value, finished_run,
                                                       tmp_path):
    main, _, needed = CLIS[cli]
    work = tmp_path / "work"
    work.mkdir()
    argv = [a.format(tmp=work, run=finished_run) for a in needed]
    argv = [*argv, f"{flag}={value}"]
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            code = main(argv)
        except SystemExit as e:
            code = e.code
    lines = err.getvalue().strip().splitlines()
    assert code == 2 and len(lines) == 1, (code, lines)
    assert flag in lines[0] and ": error: " in lines[0], lines
    assert list(work.iterdir()) == []  # nothing written
