"""What differs between the jax releases zeroflow supports (0.10.2 through 0.12.x), in one place.

Each helper is read from jax's behaviour (a parameter, a signature, an installed module), not
from its version number, and each names the release that changed it:

- ``scan_split``: a ``scan`` equation's inputs are ``consts, carry, xs``; up to 0.10 its params
  say how many of each (``num_consts``, ``num_carry``), from 0.11 they hold flat trees of each
  group (``ft_in``, ``ft_out``).
- ``CALL_PRIMITIVES``: equations whose body is a plain sub-jaxpr. 0.11 merged ``closed_call``
  into ``eval_jaxpr`` (0.10 had both).
- ``REMAT_PRIMITIVES``: ``jax.checkpoint``'s equation. ``jax_remat3`` (off by default through
  0.12) would trace a different one, which zeroflow's jaxpr passes treat as opaque.
- ``host_compute``: a jitted function run on the host. Up to 0.10 ``compute_on`` is a context
  manager around the call; from 0.11 it wraps the function and names its outputs' memory space.
- ``no_pipelined_reduce_scatter``: an XLA:GPU compile option that became an enum in 0.11.
- ``CUDA_PLUGINS`` / ``cuda_plugin_module``: the CUDA plugin for XLA:GPU compiles is
  ``jax_plugins.xla_cuda12`` (CUDA 12) or ``jax_plugins.xla_cuda13`` (CUDA 13, the GPU
  machines' jax 0.11.2).

This module imports jax only inside its functions: ``zeroflow.util.quiet_jax`` asks which CUDA
plugin is installed before jax is imported.
"""

from __future__ import annotations

import contextlib
import importlib.util
import inspect
from collections.abc import Callable

CALL_PRIMITIVES = ("jit", "pjit", "closed_call", "core_call", "eval_jaxpr")
"Call primitives: their body is a plain sub-jaxpr (``jaxpr`` or ``call_jaxpr``) to inline."

REMAT_PRIMITIVES = ("checkpoint", "remat2")
"``jax.checkpoint``'s primitive (its body in ``jaxpr``, its ``policy`` and ``prevent_cse``)."

CUDA_PLUGINS = ("xla_cuda12", "xla_cuda13")
"Module names (under ``jax_plugins``) of the CUDA plugins, CUDA 12 first."


def scan_split(params: dict) -> tuple[int, int]:
    """``(consts, carries)``: how many of a ``scan`` equation's first inputs are loop-invariant
    constants, and how many of the next are the carry (the rest are the scanned ``xs``; its
    outputs are the carry, then the stacked ``ys``)."""
    if "num_consts" in params:  # jax <= 0.10
        return params["num_consts"], params["num_carry"]
    consts, carry, _ = params["ft_in"].unpack()  # jax >= 0.11
    return len(consts), len(carry)


def _compute_on_wraps_functions() -> bool:
    from jax.experimental.compute_on import compute_on

    return "out_memory_spaces" in inspect.signature(compute_on).parameters


def host_compute(fn: Callable) -> Callable:
    """``fn`` (whose outputs are host-space arrays) jitted to run on the host CPU of each device:
    ``compute_on("device_host")``. Call the result inside a ``jax.jit``."""
    import jax
    from jax.experimental.compute_on import compute_on

    compiled = jax.jit(fn)
    if _compute_on_wraps_functions():  # jax >= 0.11
        # jax 0.11's compute_on wraps a function; the type checker reads whichever jax is
        # installed, and 0.10's takes only a compute type
        wrap: Callable[..., Callable] = compute_on
        return wrap(compiled, compute_type="device_host", out_memory_spaces=jax.memory.Space.Host)

    def run(*args):  # jax <= 0.10: the jit call inside the context runs on the host
        with compute_on("device_host"):
            return compiled(*args)

    return run


def cuda_plugin_module() -> str | None:
    """The installed CUDA plugin (``"jax_plugins.xla_cuda12"`` or ``...xla_cuda13``), or None."""
    for name in CUDA_PLUGINS:
        try:
            if importlib.util.find_spec(f"jax_plugins.{name}") is not None:
                return f"jax_plugins.{name}"
        except (ImportError, ValueError):
            continue
    return None


def cuda_plugin_install_hint(jax_version: str) -> str:
    """The pip command for the CUDA plugin at ``jax_version`` (CUDA 13 from jax 0.11 on, the
    GPU machines' choice; CUDA 12 works there too)."""
    major, minor = (int(p) for p in jax_version.split(".")[:2])
    cuda = "cuda13" if (major, minor) >= (0, 11) else "cuda12"
    return f"pip install jax-{cuda}-plugin=={jax_version} jax-{cuda}-pjrt=={jax_version}"


def _jaxlib_version() -> tuple[int, int]:
    import jaxlib.version

    major, minor = (int(p) for p in jaxlib.version.__version__.split(".")[:2])
    return major, minor


def no_pipelined_reduce_scatter() -> dict:
    """The XLA:GPU compile option that stops its collective pipeliner from moving a loop's
    reduce-scatter into the next iteration. XLA's option is a bool up to jaxlib 0.10
    (``xla_gpu_enable_pipelined_reduce_scatter``) and an enum from 0.11 (the bool is gone:
    passing it fails the compile), read by jaxlib version because options are only checked
    when a program compiles."""
    if _jaxlib_version() < (0, 11):
        return {"xla_gpu_enable_pipelined_reduce_scatter": False}
    return {"xla_gpu_pipeline_reduce_scatter": "COLLECTIVE_PIPELINING_MODE_OFF"}


def pipelined_reduce_scatter() -> dict:
    """The XLA:GPU compile option that lets its collective pipeliner move a loop's
    reduce-scatter into the next iteration (the opposite of ``no_pipelined_reduce_scatter``)."""
    if _jaxlib_version() < (0, 11):
        return {"xla_gpu_enable_pipelined_reduce_scatter": True}
    return {"xla_gpu_pipeline_reduce_scatter": "COLLECTIVE_PIPELINING_MODE_ON"}


def pipelined_all_gather(on: bool = True) -> dict:
    """The XLA:GPU compile option that lets (``on``) or stops its collective pipeliner moving
    the all-gather of a loop's next iteration into the current one (a bool up to jaxlib 0.10,
    an enum from 0.11, as for ``no_pipelined_reduce_scatter``)."""
    if _jaxlib_version() < (0, 11):
        return {"xla_gpu_enable_pipelined_all_gather": on}
    return {"xla_gpu_pipeline_all_gather": "COLLECTIVE_PIPELINING_MODE_" + ("ON" if on else "OFF")}


TARGET_CUDNN_VERSION = 90800
"The oldest cuDNN the CUDA plugins accept (9.8): what cuDNN attention is lowered for without one."


def local_cudnn_version() -> int | None:
    """This machine's cuDNN version as jax reads it (``nvidia-cudnn-cu12`` / ``-cu13`` wheels
    or a system install), None without one."""
    try:
        from jax._src.cudnn import fused_attention_stablehlo  # private: where jax asks

        return int(fused_attention_stablehlo.check_cudnn_version())
    except Exception:  # "cuDNN not found." (RuntimeError), or jax moved the check
        return None


@contextlib.contextmanager
def cudnn_for_target(compute_capability: tuple[int, int] | None = None):
    """Inside the block, cuDNN attention lowers for abstract GPUs even without a local cuDNN:
    jax asks the local library's version only to choose what to lower (XLA:GPU compiles the
    custom call without it; the kernel's graph and workspace are built on a GPU). Yields the
    version lowered for and whether it was this machine's. ``compute_capability``: the target
    GPU's, which jax otherwise asks of a local GPU (none here: it would answer "older than
    Hopper", and refuse what Hopper allows, such as head dims up to 256)."""
    local = local_cudnn_version()
    if local is not None:
        yield local, True
        return
    from jax._src.cudnn import fused_attention_stablehlo as fused

    saved = fused.check_cudnn_version, fused.check_compute_capability
    fused.check_cudnn_version = lambda *a, **k: TARGET_CUDNN_VERSION
    if compute_capability is not None:
        fused.check_compute_capability = lambda asked: (
            compute_capability >= tuple(int(x) for x in asked.split("."))
        )
    try:
        yield TARGET_CUDNN_VERSION, False
    finally:
        fused.check_cudnn_version, fused.check_compute_capability = saved
