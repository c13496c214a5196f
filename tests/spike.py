"""A learning-rate spike at a known update, to make a run diverge on purpose (test only).

``spiked(at, times)`` is a stand-in for ``zeroflow.trainer.optim.lr_schedule``: the configured
schedule, multiplied by ``times`` for the update that follows ``at`` applied ones. Tests put it
in place with monkeypatch; as a script it runs the trainer in a process of its own with it:

    python tests/spike.py AT TIMES [zeroflow.train arguments...]
"""
import sys

import jax.numpy as jnp

from zeroflow.trainer import optim

PLAIN = optim.lr_schedule


def spiked(at: int, times: float):
    def lr_schedule(cfg, factor=1.0):
        plain = PLAIN(cfg, factor)
        return lambda count: plain(count) * jnp.where(count == at, times, 1.0)

    return lr_schedule


if __name__ == "__main__":
    optim.lr_schedule = spiked(int(sys.argv[1]), float(sys.argv[2]))
    from zeroflow.cli.train import main

    sys.exit(main(sys.argv[3:]))
