"""Offloaded steps compiled for GPUs that are not there, with their state in host memory.

The abstract devices of ``zf.target_mesh`` expose no memories, so jax drops a sharding's
``pinned_host`` memory kind on them: an offloaded step lowered there keeps its offloaded state
in device memory, which is not the program a GPU runs. Here the step is planned and traced on
CPU devices standing in for the GPUs (they have a host memory, so the memory kinds stay), with
the target's traits (so the program takes the GPU's shape: its compiler options, no widened
copies, prefetched gathers), lowered for CUDA, and the module compiled by the target's
compile-only client for as many abstract GPUs. The result is XLA:GPU's executable: its memory
analysis separates host buffers from device ones, and its HLO is the scheduled GPU program.

It leans on what jax does not document as public: a topology device's ``client`` (the
compile-only client behind ``jax.experimental.topologies``), ``jax._src.compiler``'s compile
options and ``xla_client.DeviceList``; it is used only where no GPU is (a real GPU compiles the
offloaded step itself).
"""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import AxisType, Mesh


class CompiledOnTarget:
    """An XLA:GPU executable with the parts of ``jax.stages.Compiled`` that
    ``zf.memory.analysed`` and ``zf.memory.collectives`` read."""

    def __init__(self, executable, mesh: Mesh):
        self._executable = executable
        self.mesh = mesh

    def memory_analysis(self):
        return self._executable.get_compiled_memory_stats()

    def as_text(self) -> str:
        return self._executable.hlo_modules()[0].to_string()


def is_abstract(mesh: Mesh) -> bool:
    """Whether ``mesh``'s devices are abstract ones (``zf.target_mesh``): they expose no
    memories, where every device this process can run on has at least its own."""
    return not list(mesh.devices.flat)[0].addressable_memories()


def stand_in_mesh(target: Mesh) -> Mesh:
    """A mesh of CPU devices shaped like ``target``'s abstract GPUs, with its axes."""
    names = tuple(target.axis_names)
    shape = tuple(target.shape[a] for a in names)
    count = int(np.prod(shape))
    cpus = jax.devices("cpu")
    if len(cpus) < count:
        raise RuntimeError(
            f"compiling an offloaded step for {count} GPUs needs as many CPU devices standing "
            f"in for them, {len(cpus)} here: set "
            f"XLA_FLAGS=--xla_force_host_platform_device_count={count} before jax starts"
        )
    grid = np.asarray(cpus[:count], dtype=object).reshape(shape)
    return Mesh(grid, names, axis_types=(AxisType.Auto,) * len(names))


def compile_for(step, state, batch, target: Mesh) -> CompiledOnTarget:
    """Compile ``step`` (a ``zf.make_train_step`` planned on ``stand_in_mesh(target)`` with
    ``target``'s traits) for ``(state, batch)`` (abstract, sharded over the stand-in mesh) as
    XLA:GPU compiles it for ``target``'s devices. Nothing runs."""
    from jax._src import compiler
    from jax._src.lib import xla_client

    lowered = step.jitted(state).trace(state, batch).lower(lowering_platforms=("cuda",))
    devices = list(target.devices.flat)
    options = compiler.get_compile_options(
        num_replicas=1,
        num_partitions=len(devices),
        device_assignment=np.asarray(devices, dtype=object).reshape(1, len(devices)),
        env_options_overrides=dict(step.compiler_options),
    )
    executable = devices[0].client.compile(
        lowered.compiler_ir("stablehlo"),
        executable_devices=xla_client.DeviceList(tuple(devices)),
        compile_options=options,
    )
    return CompiledOnTarget(executable, target)
