"""What makes XLA print its schedule statistics, importable without jax: XLA reads these
variables when it starts, so a command sets them in its own environment and starts itself again
before it imports jax (``zeroflow.xla.schedule`` reads the statistics)."""

from __future__ import annotations

import os
from collections.abc import MutableMapping

LOG_ENV = {
    "TF_CPP_MIN_LOG_LEVEL": "0",
    "TF_CPP_VMODULE": "latency_hiding_scheduler=1",
    # A program found in jax's persistent compilation cache is loaded, not scheduled: it
    # would print no statistics.
    "JAX_ENABLE_COMPILATION_CACHE": "false",
}
"What makes XLA print its schedule statistics (set before JAX starts)."


def enabled() -> bool:
    """Whether this process was started with XLA's schedule statistics on."""
    return os.environ.get(
        "TF_CPP_MIN_LOG_LEVEL"
    ) == "0" and "latency_hiding_scheduler" in os.environ.get("TF_CPP_VMODULE", "")


def enable(env: MutableMapping[str, str] | None = None) -> MutableMapping[str, str]:
    """``env`` (default ``os.environ``) with the logging that prints the statistics turned on;
    takes effect in a process started with it."""
    env = os.environ if env is None else env
    env.update(LOG_ENV)
    return env
