"""The one place that decides how a kernel runs: compiled for a GPU backend, or interpreted.

Every ``pallas_call`` in this package takes its ``interpret=`` and ``compiler_params=`` from
:func:`pallas_call_options`. Today the only compiled backend is Pallas-Triton. A Mosaic GPU
(Hopper/Blackwell) path would be a second entry in :data:`BACKENDS` returned by
:func:`compiled_backend`, with its own kernel functions chosen in the `_forward`/`_backward`
wrappers; the custom_vjp wiring, residuals and references would stay as they are.

Also here: helpers that keep the kernels usable inside ``jax.shard_map`` (`out_struct`,
`match_varying`, `traced_bounds`) and `lower_for_cuda`, which checks the Triton lowering on a
machine without a GPU.
"""
from __future__ import annotations

import contextlib
import contextvars
import math
from typing import Any

import jax
from jax.experimental import pallas as pl

BACKENDS = ("triton",)

# tl.dot wants every matrix dimension >= 16; blocks are never shrunk below this.
MIN_TRITON_DOT_DIM = 16


_COMPILING_FOR: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "pallas_kernels_platform", default=None)


@contextlib.contextmanager
def compiling_for(platform: str):
    """Kernels traced inside this block are for ``platform`` ("gpu": compiled with Triton,
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


def resolve_interpret(interpret: bool | None) -> bool:
    """`None` means: interpret everywhere except on a GPU, where the kernels are compiled."""
    if interpret is None:
        return target_platform() != "gpu"
    return bool(interpret)


def compiled_backend() -> str:
    """The compiled backend to use on a GPU. One switch for a future Mosaic GPU path."""
    return "triton"


def pallas_call_options(interpret: bool, *, num_warps: int, num_stages: int) -> dict[str, Any]:
    """Keyword arguments shared by every `pallas_call` here (`interpret`, `compiler_params`).

    Triton parameters are passed even when interpreting: they are ignored there, and it keeps a
    single code path that cross-lowers for CUDA from a CPU-only machine.
    """
    backend = compiled_backend()
    if backend != "triton":  # pragma: no cover - only one backend today
        raise NotImplementedError(f"backend {backend!r}; known: {BACKENDS}")
    return dict(
        interpret=interpret,
        compiler_params=_triton_compiler_params(num_warps=num_warps, num_stages=num_stages),
    )


def _triton_compiler_params(**params):
    """Triton's compiler parameters, importing the Triton module only now: jax deprecated it
    (0.11), and a step without a Triton kernel must not need it."""
    from jax.experimental.pallas import triton as pl_triton

    # jax renamed `TritonCompilerParams` to `CompilerParams`; take whichever this jax offers.
    params_type = getattr(pl_triton, "CompilerParams", None) or pl_triton.TritonCompilerParams
    return params_type(**params)


def traced_bounds(*bounds):
    """Loop bounds as traced values; call at the top level of a kernel, not inside a loop.

    `lax.fori_loop` with Python-int bounds becomes a scan, and the Pallas interpreter (jax
    0.10.2) fails on a scan that reads refs inside `jax.shard_map(check_vma=True)`. Traced
    bounds give a while loop, which works there and which the Triton lowering still turns into
    an scf.for.
    """
    zero = pl.program_id(0) * 0
    return tuple(b + zero for b in bounds)


def is_power_of_two(n: int) -> bool:
    return isinstance(n, int) and not isinstance(n, bool) and n > 0 and n & (n - 1) == 0


def next_power_of_two(n: int) -> int:
    return 1 if n <= 1 else 2 ** math.ceil(math.log2(n))


def fit_block(block: int, length: int) -> int:
    """Shrink a power-of-two tile for a short axis, but not below the Triton dot minimum."""
    return min(block, max(MIN_TRITON_DOT_DIM, next_power_of_two(length)))


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def lower_for_cuda(fn, *args) -> list[str]:
    """Lower `jax.jit(fn)(*args)` for CUDA on any machine (no GPU needed); return the names of
    the Triton kernels in the module.

    Catches Pallas-to-Triton lowering errors (shapes that are not powers of two, unsupported
    primitives) before a GPU is rented. With jaxlib <= 0.10.2 the kernels stay as Triton IR in
    the module and each one is parsed and verified here; newer jaxlibs compile them to PTX while
    lowering. Neither replaces running on a GPU: ptxas, shared-memory limits and speed are
    only checked there.
    """
    from jax._src.lib.mlir import ir  # private: the MLIR bindings bundled with jaxlib

    # From jax 0.12 Pallas-Triton reads the GPU's architecture from the abstract mesh's device
    # when this machine has none; an H100 (sm_90), as the GPUs the kernels are tuned for.
    h100 = jax.sharding.AbstractDevice(
        device_kind="NVIDIA H100 80GB HBM3", num_cores=132, platform="gpu")
    mesh = jax.sharding.AbstractMesh((1,), ("lowering",), abstract_device=h100)
    with jax.sharding.use_abstract_mesh(mesh):
        lowered = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))
    kernels: list[tuple[str, bytes | None]] = []

    def visit(op):
        for region in op.regions:
            for block in region.blocks:
                for child in block.operations:
                    child = child.operation
                    if child.name == "stablehlo.custom_call":
                        _collect_triton_call(child, kernels, ir)
                    visit(child)

    visit(lowered.compiler_ir("stablehlo").operation)
    for name, triton_ir in kernels:
        if triton_ir is not None:
            _verify_triton_ir(name, triton_ir, ir)
    return [name for name, _ in kernels]


def _collect_triton_call(op, kernels, ir) -> None:
    target = ir.StringAttr(op.attributes["call_target_name"]).value
    if target == "__gpu$xla.gpu.triton":  # jaxlib <= 0.10.2: Triton IR, compiled by XLA
        config = ir.DictAttr(op.attributes["mhlo.backend_config"])
        kernels.append((ir.StringAttr(config["name"]).value,
                        ir.StringAttr(config["ir"]).value_bytes))
    elif target == "triton_kernel_call_ffi":  # newer jaxlib: compiled while lowering
        try:
            name = ir.StringAttr(ir.DictAttr(op.attributes["mhlo.backend_config"])["name"]).value
        except (KeyError, ValueError, TypeError):
            name = target
        kernels.append((name, None))


def _verify_triton_ir(name: str, triton_ir: bytes, ir) -> None:
    try:  # private: an MLIR context with the Triton dialect registered
        from jax._src.pallas.triton.lowering import _new_ir_context
    except ImportError:  # pragma: no cover - layout of jax internals changed
        return
    with _new_ir_context():
        module = ir.Module.parse(triton_ir)
        if not module.operation.verify():
            raise RuntimeError(f"Triton IR of kernel {name!r} does not verify")


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
