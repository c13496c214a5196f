"""What differs between jax versions in Pallas's Mosaic GPU backend (``plgpu``), in one place.

Supported: jax 0.10.2, 0.11.x and 0.12.x. The kernels here use only names every one of them
offers (``plgpu.kernel``, ``SMEM``, ``Barrier``, ``copy_gmem_to_smem``, ``wgmma``, ...); what
moved is where the GPU interpreter's parameters live, and whether the module exists at all.
"""

from __future__ import annotations

import functools
import re
import threading
from typing import Any

import jax
import numpy as np


class MosaicGPUUnavailable(ValueError, RuntimeError):
    """This jax has no Pallas Mosaic GPU backend (``jax.experimental.pallas.mosaic_gpu``), or
    the GPU a kernel is compiled for is not sm_90. A ValueError: what was asked for (a kernel,
    here) cannot be had; its message is one line."""


SM90 = re.compile(r"\bG?H(100|200|800|20)\b")
"Device kinds with sm_90 (Hopper): the kernels' wgmma and TMA exist there only."


def device_problem(device_kind: str | None) -> str | None:
    """One line if a Mosaic GPU kernel cannot be compiled for ``device_kind`` (None: unknown)."""
    if device_kind and not SM90.search(device_kind):
        return (
            f"Mosaic GPU kernels are compiled for sm_90 GPUs (H100, H200), not for {device_kind!r}"
        )
    return None


@functools.cache
def plgpu():
    """``jax.experimental.pallas.mosaic_gpu``, or one line saying it is missing."""
    try:
        from jax.experimental.pallas import mosaic_gpu
    except ImportError as err:
        raise MosaicGPUUnavailable(
            f"Pallas Mosaic GPU kernels need jax.experimental.pallas.mosaic_gpu, which jax "
            f"{jax.__version__} does not provide ({err}); supported: jax 0.10.2, 0.11.x, 0.12.x"
        ) from None
    return mosaic_gpu


class _OnUse:
    """``jax.experimental.pallas.mosaic_gpu`` fetched when a kernel first uses it, so that
    ``pallas_kernels`` imports on a jax without it and the kernel asked for says so in one
    line (``MosaicGPUUnavailable``) instead of the package failing to import."""

    def __getattr__(self, name: str) -> Any:
        return getattr(plgpu(), name)


lazy_plgpu: Any = _OnUse()
"Stands for ``jax.experimental.pallas.mosaic_gpu`` in the kernel modules."


def problem(device_kind: str | None = None) -> str | None:
    """One line if this jax has no Mosaic GPU backend or ``device_kind`` is not sm_90."""
    unfit = device_problem(device_kind)
    if unfit:
        return unfit
    try:
        plgpu()
    except MosaicGPUUnavailable as err:
        return str(err)
    return None


def require_compilable() -> None:
    """Before a kernel is traced to be compiled: its GPU, where known, is sm_90 and this jax
    has Mosaic GPU; one line (``MosaicGPUUnavailable``, a ValueError) otherwise."""
    from pallas_kernels._backend import target_device_kind

    why = problem(target_device_kind())
    if why:
        raise MosaicGPUUnavailable(why)


def interpret_params() -> Any:
    """The argument that makes ``plgpu.kernel`` run in the GPU interpreter on any backend.

    ``interpret=True`` would pick the generic Pallas interpreter, which has no rule for the
    TMA copies and barriers; the GPU interpreter simulates them (and checks barrier use).
    jax 0.11 exports its parameters as ``plgpu.InterpretGPUParams``; 0.10.2 keeps the same
    class in the module that implements the interpreter.
    """
    params: Any = getattr(plgpu(), "InterpretGPUParams", None)
    if params is None:  # jax 0.10.2
        from jax._src.pallas.mosaic_gpu.interpret import params as module

        params = module.InterpretGPUParams
    return params()


def varying_like(outputs, *inputs):
    """``outputs`` typed as varying over every manual mesh axis that any of ``inputs`` varies
    over. Inside ``jax.shard_map(check_vma=True)`` (zeroflow's train step) ``plgpu.kernel``
    returns outputs without the inputs' axes (its ``out_type`` keeps none); the custom_vjp
    and what follows need them."""
    from jax import lax

    from pallas_kernels._backend import _varying_axes

    want = frozenset().union(*(_varying_axes(x) for x in inputs))

    def one(x):
        extra = want - _varying_axes(x)
        return lax.pcast(x, tuple(sorted(extra)), to="varying") if extra else x

    return jax.tree.map(one, outputs)


def lower_for_cuda(fn, *args) -> int:
    """How many Mosaic GPU kernel calls ``jax.jit(fn)(*args)`` lowers to for CUDA, on any
    machine (no GPU: the kernels are lowered to Mosaic GPU's MLIR, which XLA compiles later).
    Catches what Mosaic GPU refuses while lowering (layouts, tile shapes, unsupported
    primitives); ptxas, shared-memory limits and speed are only checked by a compile or a
    GPU."""
    lowered = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))
    return lowered.as_text().count("stablehlo.custom_call @mosaic_gpu")


_INTERPRETER = threading.Lock()


def on_host(kernel, out_type):
    """``kernel`` (interpreted) as a pure host callback that runs it in a program of its own.

    Two reasons. From jax 0.11 an interpreted kernel carries an ordered-IO effect (the
    interpreter keeps state between its callbacks), which ``flax.linen.scan`` refuses in a
    layer's body ("broadcasted variable has a data dependency on the scan body"); called from
    a pure callback the kernel is effect-free where it is traced. And traced inside
    ``shard_map`` over several devices, the interpreter would simulate them all and wait at
    each kernel's end for every one, while XLA:CPU runs them one after another: it would wait
    forever. In a program of its own each call is one device's kernel. The interpreter's state
    is global: one kernel runs at a time.
    """
    shapes = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype), out_type)
    compiled = jax.jit(kernel)

    def host(*arrays):
        with _INTERPRETER:
            return jax.tree.map(np.asarray, compiled(*arrays))

    def call(*args):
        return jax.pure_callback(host, shapes, *args, vmap_method="sequential")

    return call
