"""Start JAX without the CUDA plugin's native noise on machines without a GPU.

The test extra installs ``jax-cuda12-plugin`` so that XLA:GPU can compile for GPU targets on
any machine (``zf.target_mesh``). Without a GPU driver, its native libraries print "Could not
find cuda drivers on your machine" to the process's stderr (file descriptor 2, below Python)
when JAX imports the plugin, and again when it registers it, and jax then prints the plugin's
failure. None of it is actionable here, and it buries the one line a command-line error should
be. So, only in that situation (plugin installed, no driver, JAX not yet imported), zeroflow
imports JAX, and JAX later discovers its plugins, with descriptor 2 pointed at /dev/null, and
the CPU is made JAX's platform. Python exceptions are raised as usual; nothing else is muted.
"""
from __future__ import annotations

import contextlib
import ctypes.util
import importlib.util
import os
import sys


def has_gpu_driver() -> bool:
    """Whether this machine has an NVIDIA driver (a GPU JAX could use)."""
    return os.path.exists("/proc/driver/nvidia/version") or ctypes.util.find_library("cuda") is not None


def cuda_plugin_installed() -> bool:
    try:
        return importlib.util.find_spec("jax_plugins.xla_cuda12") is not None
    except (ImportError, ValueError):
        return False


@contextlib.contextmanager
def _stderr_muted():
    sys.stderr.flush()
    saved, devnull = os.dup(2), os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 2)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)


def start() -> None:
    """Import JAX (quietly where the plugin cannot work, choosing the CPU there)."""
    if "jax" in sys.modules or os.environ.get("JAX_PLATFORMS") not in (None, "", "cpu") or (
            not cuda_plugin_installed() or has_gpu_driver()):
        import jax  # noqa: F401
        return
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    with _stderr_muted():
        import jax  # noqa: F401
    try:  # the plugin registers at the first backend use: mute that too (private hook)
        from jax._src import xla_bridge
        discover = xla_bridge.discover_pjrt_plugins

        def discover_quietly():
            with _stderr_muted():
                return discover()
        xla_bridge.discover_pjrt_plugins = discover_quietly
    except (ImportError, AttributeError):  # another jax: its lines come back, nothing breaks
        pass
