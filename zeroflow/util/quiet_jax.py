"""The commands' jax without the CUDA plugin's native noise on machines without a GPU.

The test extra installs ``jax-cuda12-plugin`` (Python 3.11, jax 0.10.2) or ``jax-cuda13-plugin``
(Python 3.12+, jax 0.11.2) so that XLA:GPU can compile for GPU targets on
any machine (``zf.target_mesh``). Without a GPU driver, its native libraries print "Could not
find cuda drivers on your machine" to the process's stderr (file descriptor 2, below Python)
when JAX imports the plugin, and again when it registers it, and jax then prints the plugin's
failure. None of it is actionable here, and it buries the one line a command-line error should
be. So, only for a ``python -m zeroflow.<command>`` process (or one of the project's programs in
scripts/ and experiments/: ``zeroflow.cli.common.start_script``) and only in that situation (plugin
installed, no driver, JAX not yet imported), the command makes the CPU JAX's platform and, when
something first imports JAX, imports it and registers its plugins with descriptor 2 pointed at
/dev/null. Python exceptions are raised as usual; nothing else is muted. ``import zeroflow``
never does any of this: a program that imports zeroflow keeps its environment and its jax.
"""

from __future__ import annotations

import contextlib
import ctypes.util
import importlib.abc
import importlib.machinery
import os
import sys
import types

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
        sys.stderr.flush()
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)


def _register_plugins() -> None:
    """Register jax's PJRT plugins now (muted by the caller) rather than at the first backend
    use, which may come anywhere later; registering creates no backend, so the CPU device count
    and a multi-process job can still be set after it (private hook: another jax just prints
    its lines there)."""
    try:
        from jax._src import xla_bridge

        register = xla_bridge._discover_and_register_pjrt_plugins
    except (ImportError, AttributeError):
        return
    register()


class _QuietLoader(importlib.abc.Loader):
    """jax's own loader, run with descriptor 2 muted."""

    def __init__(self, loader: importlib.abc.Loader):
        self.loader = loader

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType | None:
        return self.loader.create_module(spec)

    def exec_module(self, module: types.ModuleType) -> None:
        module.__loader__ = self.loader  # jax sees its own loader
        if module.__spec__ is not None:
            module.__spec__.loader = self.loader
        with _stderr_muted():
            self.loader.exec_module(module)
            _register_plugins()


class _QuietJaxFinder(importlib.abc.MetaPathFinder):
    """Finds ``jax`` as the other finders do, once, and hands it a muted loader."""

    def find_spec(self, name, path=None, target=None):
        if name != "jax":
            return None
        sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is not None and spec.loader is not None:
            spec.loader = _QuietLoader(spec.loader)
        return spec


def quiet_for_this_command() -> None:
    """Where the plugin cannot work (installed, no driver) and no platform was chosen: the CPU
    becomes JAX's platform, and JAX's import and plugin registration, whenever they come, write
    nothing to stderr. For the commands and the project's programs only
    (``zeroflow.cli.common.start_command`` and ``start_script``)."""
    if "jax" in sys.modules or os.environ.get("JAX_PLATFORMS") not in (None, "", "cpu"):
        return
    if not cuda_plugin_installed() or has_gpu_driver():
        return
    os.environ["JAX_PLATFORMS"] = "cpu"
    sys.meta_path.insert(0, _QuietJaxFinder())
