"""``python -m zeroflow.train`` held before a chosen step, so that a signal lands at a known
point of a run on any machine, however fast or busy (test only):

    python tests/hold_before_step.py STEP MARKER [zeroflow.train arguments...]

Before the batch of step STEP + 1 is drawn, the file MARKER is created and the run waits until
SIGTERM or SIGINT arrives, then hands it to whatever the trainer installed for it (or, had it
installed nothing, lets the default action end the process), as if it had arrived just then.
A test that sends the signal once MARKER exists interrupts the run after STEP steps were
dispatched.
"""
import signal
import sys
import time
from pathlib import Path

from zeroflow.cli.common import start_command

start_command("train")  # as ``python -m zeroflow.train`` is, before jax is imported

from zeroflow.trainer import loop  # noqa: E402

HELD = (signal.SIGTERM, signal.SIGINT)


def wait_for_a_signal(marker: Path) -> None:
    # Python runs a signal's handler in the main thread, here: it notes the signal; once the
    # trainer's own handlers are back it is raised again in this thread, so theirs has run (or
    # the default action has ended the process) before the batch is drawn.
    arrived: list[int] = []
    installed = {sig: signal.signal(sig, lambda signum, _frame: arrived.append(signum))
                 for sig in HELD}
    marker.touch()
    while not arrived:
        time.sleep(0.01)
    for sig, handler in installed.items():
        signal.signal(sig, handler)
    signal.raise_signal(arrived[0])


def held_train_batch(step: int, marker: Path):
    """``loop.train_batch`` that waits for a signal before drawing the batch of index ``step``."""
    plain = loop.train_batch

    def train_batch(tokens, index, **kw):
        if index == step:
            wait_for_a_signal(marker)
        return plain(tokens, index, **kw)

    return train_batch


if __name__ == "__main__":
    loop.train_batch = held_train_batch(int(sys.argv[1]), Path(sys.argv[2]))
    from zeroflow.cli.train import main

    sys.exit(main(sys.argv[3:]))
