"""Start JAX without the CUDA plugin's native noise on machines without a GPU.

The test extra installs ``jax-cuda12-plugin`` (Python 3.11, jax 0.10.2) or ``jax-cuda13-plugin``
(Python 3.12+, jax 0.11.2) so that XLA:GPU can compile for GPU targets on
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
import os
import sys

from zeroflow.util.compat import cuda_plugin_module


def has_gpu_driver() -> bool:
    """Whether this machine has an NVIDIA driver (a GPU JAX could use)."""
    return (
        os.path.exists("/proc/driver/nvidia/version")
        or ctypes.util.find_library("cuda") is not None
    )


def cuda_plugin_installed() -> bool:
    """A CUDA plugin (CUDA 12 or 13) is installed."""
    return cuda_plugin_module() is not None


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
    """Import JAX (quietly where the plugin cannot work, choosing the CPU there).

    Where the user imported JAX first (``import jax, zeroflow``), its import has printed the
    plugin's driver lines already, but no backend has started yet: the plugin's failure (a
    logged traceback) is still muted and the CPU chosen, unless a platform was."""
    if os.environ.get("JAX_PLATFORMS") not in (None, "", "cpu") or (
        not cuda_plugin_installed() or has_gpu_driver()
    ):
        import jax

        return
    if "jax" in sys.modules:
        import jax
        from jax._src import xla_bridge

        if xla_bridge.backends_are_initialized():
            return
        # jax's options are dynamic attributes of jax.config, which its type does not declare
        if not jax.config.jax_platforms:  # type: ignore[attr-defined]
            jax.config.update("jax_platforms", "cpu")
    else:
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
        with _stderr_muted():
            import jax
    try:  # the plugin registers at the first backend use: mute that too (private hook)
        from jax._src import xla_bridge

        discover = xla_bridge.discover_pjrt_plugins

        def discover_quietly():
            with _stderr_muted():
                return discover()

        xla_bridge.discover_pjrt_plugins = discover_quietly
    except (ImportError, AttributeError):  # another jax: its lines come back, nothing breaks
        pass
