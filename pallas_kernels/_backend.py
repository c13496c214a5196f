"""The one place that decides how a kernel runs: compiled for a GPU (Pallas's Mosaic GPU
backend, ``pallas_kernels.attention_mgpu`` and ``block_sparse``), or in the interpreter.

Also here: helpers that keep the kernels usable inside ``jax.shard_map`` (`out_struct`,
`match_varying`) and small tile arithmetic.
"""

from __future__ import annotations

import contextlib
import contextvars

import jax

_COMPILING_FOR: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "pallas_kernels_platform", default=None
)


@contextlib.contextmanager
def compiling_for(platform: str):
    """Kernels traced inside this block are for ``platform`` ("gpu": compiled with Mosaic GPU,
    else interpreted), whatever this process's default backend is: a program compiled for a GPU
    target on a CPU-only machine gets real kernels."""
    token = _COMPILING_FOR.set(platform)
    try:
        yield
    finally:
        _COMPILING_FOR.reset(token)


def target_platform() -> str:
    """The platform kernels are traced for: ``compiling_for``'s, else the devices of the mesh
    in context (inside ``shard_map``), else the default backend's."""
    platform = _COMPILING_FOR.get()
    if platform is not None:
        return platform
    mesh = jax.sharding.get_abstract_mesh()
    device = None if mesh.empty else getattr(mesh, "abstract_device", None)
    if device is not None and getattr(device, "platform", None):
        return device.platform
    return jax.default_backend()


def target_device_kind() -> str | None:
    """The GPU model kernels are compiled for, where it is known: the device of the mesh in
    context (a target mesh inside ``shard_map``), else this process's GPU when it has one and
    the kernels are for it. None elsewhere (e.g. under ``compiling_for`` on a CPU machine)."""
    mesh = jax.sharding.get_abstract_mesh()
    device = None if mesh.empty else getattr(mesh, "abstract_device", None)
    kind = getattr(device, "device_kind", None)
    if kind:
        return kind
    if target_platform() == "gpu" and jax.default_backend() == "gpu":
        return jax.devices()[0].device_kind
    return None


def resolve_interpret(interpret: bool | None) -> bool:
    """`None` means: interpret everywhere except on a GPU, where the kernels are compiled."""
    if interpret is None:
        return target_platform() != "gpu"
    return bool(interpret)


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def _varying_axes(x) -> frozenset:
    aval = jax.typeof(x)
    return aval.mat.varying if hasattr(aval, "mat") else frozenset()


def match_varying(cotangent, primal):
    """Sum a cotangent over the shard_map axes it varies over but its primal does not.

    Inside `jax.shard_map(check_vma=True)` an invariant input (e.g. a replicated weight) used
    with a varying one (a sharded batch) gets a varying gradient from the kernels; autodiff
    would transpose the implicit broadcast into a psum, so a custom_vjp must do it too.
    """
    extra = _varying_axes(cotangent) - _varying_axes(primal)
    return jax.lax.psum(cotangent, tuple(sorted(extra))) if extra else cotangent


def out_struct(shape, dtype, *inputs) -> jax.ShapeDtypeStruct:
    """`ShapeDtypeStruct` for a `pallas_call` output that varies over every manual mesh axis any
    of `inputs` varies over. Inside `jax.shard_map(check_vma=True)` (zeroflow's train step)
    pallas_call refuses outputs without it; elsewhere the set is empty."""
    avals = [jax.typeof(x) for x in inputs]
    if avals and hasattr(avals[0], "mat"):  # a ManualAxisType (every supported jax, 0.10.2+)
        mats = [a.mat for a in avals]
        varying = frozenset().union(*(m.varying for m in mats))
        return jax.ShapeDtypeStruct(shape, dtype, manual_axis_type=type(mats[0])(varying=varying))
    return jax.ShapeDtypeStruct(shape, dtype)
