"""What differs by backend, decided once from a mesh's devices, so no
other module asks which backend it runs on.

The engine shapes a program differently for XLA:CPU and for GPUs: whether host memory is a
separate memory (offload copies cost something), whether half-precision matmuls and gathers
are widened to fp32 on converted copies, whether fetches must be ordered by hand, and which
kernels (cuDNN, Triton) exist. Every such decision reads a ``Traits`` value made from the mesh
the step is compiled for, never ``jax.default_backend()``: the same code then compiles for a
CPU test mesh, a real GPU and a GPU target of abstract devices (``zf.target_mesh``).

While a step is traced its traits are current (``tracing_for``), so code that only sees
arrays (a model's attention choice, a Pallas kernel's ``interpret``) reads ``current()``.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses

import jax

from zeroflow.backend import kernel_cache
from zeroflow.util.compat import no_pipelined_reduce_scatter, pipelined_all_gather


@dataclasses.dataclass(frozen=True)
class Traits:
    """The backend properties the engine's choices depend on. Build with ``of(mesh)`` or, in
    tests, directly."""

    platform: str
    "'cpu', 'gpu' or 'tpu'."
    device_kind: str = ""
    "The devices' name (e.g. 'NVIDIA H100 80GB HBM3')."
    separate_host_memory: bool = False
    "pinned_host is a memory of its own (GPU/TPU); on XLA:CPU it is the device memory itself."
    widens_half_precision: bool = False
    "bf16/fp16 collectives (gathers, reductions) run in fp32 on converted copies (XLA:CPU)."
    has_cudnn: bool = False
    "cuDNN kernels (jax.nn.dot_product_attention(implementation='cudnn'))."
    overlaps_collectives: bool = False
    "Collectives run asynchronously beside compute (GPU streams), so a fetch may start one"
    " unit ahead (``make_train_step(prefetch=)``); XLA:CPU runs them in line."
    cond_updates_in_place: bool = False
    "A ``lax.cond`` over the optimizer update writes into the donated state's buffers (XLA:CPU);"
    " XLA:GPU returns the branch's results in new buffers and copies them back, which holds a"
    " second copy of the whole optimizer state: there a skipped step is an elementwise select."
    compiles_pallas: bool = False
    "Pallas kernels compile (Triton on GPU) instead of running in the interpreter."
    memory_bytes: int | None = None
    "Memory per device where known (a GPU's, or a target's published size)."
    compile_only: bool = False
    "Abstract devices of a GPU target (``zf.target_mesh``): programs are compiled, never run."
    compute_capability: tuple[int, int] | None = None
    "A CUDA GPU's (or target's) compute capability, e.g. (8, 0) for an A100; None elsewhere."


def for_platform(platform: str, device_kind: str = "", memory_bytes: int | None = None) -> Traits:
    """The traits of a platform's compiler, as zeroflow knows them."""
    platform = {"cuda": "gpu", "rocm": "gpu"}.get(platform, platform)
    cpu = platform == "cpu"
    return Traits(
        platform=platform,
        device_kind=device_kind,
        separate_host_memory=not cpu,
        widens_half_precision=cpu,
        has_cudnn=platform == "gpu" and "AMD" not in device_kind,
        overlaps_collectives=not cpu,
        cond_updates_in_place=cpu,
        compiles_pallas=platform == "gpu",
        memory_bytes=memory_bytes,
    )


def of(mesh) -> Traits:
    """The traits of the devices ``mesh`` spans: a ``Mesh`` of real or abstract (target)
    devices, or an ``AbstractMesh``, which plans for the device it names (a GPU when it names
    none: planning is for machines this one is not)."""
    if isinstance(mesh, jax.sharding.AbstractMesh):
        device = getattr(mesh, "abstract_device", None)
        if device is None or not getattr(device, "platform", None):
            return for_platform("gpu")
        return for_platform(device.platform, device.device_kind or "")
    device = mesh.devices.flat[0]
    traits = for_platform(device.platform, device.device_kind, _memory_bytes(device))
    from zeroflow.backend import targets

    return dataclasses.replace(
        traits,
        compile_only=targets.is_target_device(device),
        compute_capability=_capability(device),
    )


def _capability(device) -> tuple[int, int] | None:
    """A CUDA device's compute capability ('8.0' on real and target devices) as (8, 0)."""
    text = getattr(device, "compute_capability", None)
    try:
        major, minor = str(text).split(".")[:2]
        return int(major), int(minor)
    except ValueError:  # not a CUDA device (CPU, ROCm's 'gfx90a'), or none given
        return None


def _memory_bytes(device) -> int | None:
    from zeroflow.backend import targets  # a target's devices carry their spec's size

    size = targets.memory_of(device)
    if size is not None:
        return size
    try:
        stats = device.memory_stats()
    except Exception:  # backends without allocator statistics (CPU, abstract devices)
        return None
    return None if not stats else stats.get("bytes_limit")


_CURRENT: contextvars.ContextVar[Traits | None] = contextvars.ContextVar(
    "zeroflow_traits", default=None
)


@contextlib.contextmanager
def tracing_for(traits: Traits):
    """Make ``traits`` current while a step is traced (and Pallas kernels compile for it)."""
    from pallas_kernels import _backend as kernels

    token = _CURRENT.set(traits)
    try:
        with kernels.compiling_for(traits.platform if traits.compiles_pallas else "cpu"):
            yield traits
    finally:
        _CURRENT.reset(token)


def current() -> Traits:
    """The traits of the step being traced; outside one, those of the platform of the mesh in
    context (inside ``shard_map`` or ``jax.set_mesh``), else of the default backend's devices
    (the rule Pallas kernels follow, ``pallas_kernels._backend.target_platform``)."""
    traits = _CURRENT.get()
    if traits is not None:
        return traits
    from pallas_kernels._backend import target_platform

    return for_platform(target_platform())


COMBINE_THRESHOLD_BYTES = 2**20
"Largest combined all-gather / reduce-scatter XLA:GPU may form (see ``compiler_options``)."


COLLECTIVES_IN_FLIGHT = 2
"Asynchronous collectives XLA:GPU may run at once (see ``compiler_options``)."


def compiler_options(traits: Traits) -> dict:
    """Per-compile XLA options the train step needs on this backend.

    XLA:GPU combines independent collectives into one, up to a byte threshold (hundreds of MB
    by default). For ZeRO that undoes the point: every weight's fp32 gradient is reduce-
    scattered on use so that one whole gradient exists at a time, and the combiner merges all
    of them into one reduce-scatter at the end of the backward pass, which holds every whole
    gradient at once (a 3x peak at stage 3). A threshold of a few MB still combines the small
    leaves (norms, biases) and leaves each large one on its own.

    The latency-hiding scheduler places compute between a collective's start and done; XLA
    turns it on by itself only for some GPUs (Hopper here), and without it every collective of
    the A100 and L4 programs was synchronous.

    XLA:GPU's collective pipeliner moves a loop's reduce-scatter into the next iteration. In a
    scanned layer stack at stage 3 that keeps one layer's whole fp32 gradient alive across the
    iteration boundary, and the moved reduce-scatter holds the collective slot just when the
    iteration's own weight gather needs it, so the backward loop's gather ran synchronously.
    Each iteration reduce-scatters its own gradient instead (scan model: 3/5 -> 4/4 gathers
    overlapped, 1.46x -> 1.39x of the formula; gpt2-small at 8 x 128 tokens: 1.52x -> 1.32x).
    A stage-3 step with FP8 matmuls and a bf16 reduction turns it back on
    (``zeroflow.engine.step.fp8_overlap_options``).
    Its all-gather pipelining is what we want: a scanned stack's next slice is gathered during
    this iteration (the forward loop of a Llama-8B shape waits on no gather).

    Two collectives in flight: by default XLA:GPU's scheduler keeps one, so a layer's gradient
    reduction and the next layer's weight gather take turns; on separate streams (as PyTorch
    FSDP runs its gathers and reductions) they overlap each other and the compute (Llama-8B
    shape, 8 x H100, stage 3: XLA:GPU's step estimate 622 -> 568 ms with remat full, 600 ->
    546 ms with dots saved; peak +1.2 GB / +1.0 GB, the second collective's buffers).

    On a target's abstract devices the compiles of one process share their kernels
    (``kernel_cache``).
    """
    if traits.platform != "gpu":
        return {}
    return {
        **(kernel_cache.options(traits.device_kind) if traits.compile_only else {}),
        "xla_gpu_enable_latency_hiding_scheduler": True,
        "xla_gpu_reduce_scatter_combine_threshold_bytes": COMBINE_THRESHOLD_BYTES,
        "xla_gpu_all_gather_combine_threshold_bytes": COMBINE_THRESHOLD_BYTES,
        "xla_gpu_all_reduce_combine_threshold_bytes": COMBINE_THRESHOLD_BYTES,
        "xla_gpu_experimental_parallel_collective_overlap_limit": COLLECTIVES_IN_FLIGHT,
        **no_pipelined_reduce_scatter(),
        **pipelined_all_gather(),
    }
