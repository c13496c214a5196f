"""Progress and result lines (the trainer's and FuseMix's) are never cut inside a figure: whole
when piped, however long; cut between their items in a terminal narrower than them."""
import io
import re

import pytest
from rich.console import Console

pytestmark = pytest.mark.fast

STEP = "step 10/200  loss 2.3456  lr 3.0e-04  8,271 tok/s  248 ms/step  MFU 1.2%"
RECALL = ("step 100:  i2t_r1 0.128  i2t_r5 0.294  i2t_r10 0.414  t2i_r1 0.172  t2i_r5 0.456  "
          "t2i_r10 0.619")
BANNER = ("data stdlib, 225+12 files: train 1,322,139 tokens, val 72,011 tokens, vocab 512  "
          "LoRA r=8, 16,384 adapter params trained, 139,584 frozen (nf4)  mesh: {'data': 1, "
          "'model': 1}  ZeRO stage 3  precision: fp32")
# Each item as a reader takes it in: a name and its value, written out by hand for each line.
ITEMS = {
    STEP: ["step 10/200", "loss 2.3456", "lr 3.0e-04", "8,271 tok/s", "248 ms/step", "MFU 1.2%"],
    RECALL: ["i2t_r1 0.128", "i2t_r5 0.294", "i2t_r10 0.414", "t2i_r1 0.172", "t2i_r5 0.456",
             "t2i_r10 0.619"],
    BANNER: ["train 1,322,139 tokens", "val 72,011 tokens", "vocab 512", "LoRA r=8",
             "16,384 adapter params trained", "139,584 frozen (nf4)", "ZeRO stage 3",
             "precision: fp32"],
}


def _console(terminal: bool, width: int) -> tuple[Console, io.StringIO]:
    out = io.StringIO()
    return Console(file=out, force_terminal=terminal, width=width, color_system=None), out


def _trainer_print(console: Console, message: str) -> None:
    from zeroflow.trainer.reporting import Reporter

    reporter = Reporter.__new__(Reporter)  # only what print reads: no run folder is opened
    reporter.is_main, reporter.progress, reporter.out = True, None, console
    reporter.print(message)


def _fusemix_print(console: Console, message: str) -> None:
    from zeroflow.fusemix.trainer import _say

    _say(console, message)


PRINTERS = {"trainer": _trainer_print, "fusemix": _fusemix_print}


@pytest.mark.parametrize("printer", PRINTERS)
@pytest.mark.parametrize("message", list(ITEMS), ids=["step", "recall", "banner"])
def test_piped_lines_are_whole(printer, message):
    console, out = _console(terminal=False, width=40)  # narrower than every line here
    PRINTERS[printer](console, message)
    assert out.getvalue() == message + "\n"


@pytest.mark.parametrize("printer", PRINTERS)
@pytest.mark.parametrize("message", list(ITEMS), ids=["step", "recall", "banner"])
@pytest.mark.parametrize("width", [30, 45, 60])
def test_narrow_terminal_cuts_between_items(printer, message, width):
    console, out = _console(terminal=True, width=width)
    PRINTERS[printer](console, message)
    lines = out.getvalue().rstrip("\n").split("\n")
    assert len(lines) > 1
    # no line is wider than the terminal, unless it is one piece (no place to cut) on its own
    assert all(len(line) <= width or not re.search(r"  |[,;] ", line.strip())
               for line in lines), lines
    for item in ITEMS[message]:  # every item whole on one line
        assert sum(item in line for line in lines) == 1, (item, lines)
    # nothing lost or added: the words in order
    assert re.sub(r"\s+", " ", " ".join(lines)).strip() == re.sub(r"\s+", " ", message)


def test_a_line_that_fits_is_printed_as_it_is():
    console, out = _console(terminal=True, width=200)
    _trainer_print(console, STEP)
    assert out.getvalue() == STEP + "\n"


@pytest.mark.parametrize("width", [50, 70, 200])
def test_the_bar_shows_whole_figures_that_fit(width):
    """The trainer's progress bar in a terminal: as many of its figures as fit beside the bar,
    each whole, the first ones first; the rendered bar is one line within the terminal."""
    from rich.progress import Progress

    from zeroflow.trainer.reporting import Reporter

    console, out = _console(terminal=True, width=width)
    reporter = Reporter.__new__(Reporter)
    reporter.total_steps = 200
    reporter.progress = Progress(console=console)
    m = {"loss": 2.34567, "tokens_per_s": 12345.6, "step_time": 0.1234, "loss_scale": 1.0,
         "mfu": None}
    figures = ["loss 2.346", "12,346 tok/s", "123 ms", "scale 1", "MFU n/a"]
    shown = reporter._bar_stats(m).split("  ")
    assert shown == figures[:len(shown)] and shown  # whole figures, in order, at least the loss
    assert (len(shown) == len(figures)) == (width == 200)
    # drawn with the trainer's columns (label, 16-wide bar, step/total, time left)
    from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeRemainingColumn
    from rich.table import Column
    bar = Progress(TextColumn("train"), BarColumn(bar_width=16), MofNCompleteColumn(),
                   TextColumn("{task.fields[stats]}", table_column=Column(no_wrap=True)),
                   TimeRemainingColumn(), console=console, auto_refresh=False)
    bar.add_task("train", total=200, completed=100, stats="  ".join(shown))
    console.print(bar.make_tasks_table(bar.tasks))
    drawn = out.getvalue().rstrip("\n").split("\n")
    assert len(drawn) == 1 and len(drawn[0]) <= width and "100/200" in drawn[0], drawn
    assert "━" * 8 in drawn[0]  # the bar kept its width
