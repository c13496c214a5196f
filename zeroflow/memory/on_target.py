"""Offloaded steps compiled for GPUs that are not there, with their state in host memory.

``zf.target_mesh``'s abstract devices expose no memories, so jax drops a ``pinned_host`` memory
kind on them. The step is therefore planned and traced on CPU devices standing in for the GPUs
(with the target's traits), lowered for CUDA, and compiled by the target's compile-only client
for as many abstract GPUs: XLA:GPU's executable, whose memory analysis separates host buffers.
It leans on what jax does not document as public (a topology device's ``client``,
``jax._src.compiler``'s options), used only where no GPU is.
"""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import AxisType, Mesh


class CompiledOnTarget:
    """An XLA:GPU executable with the parts of ``jax.stages.Compiled`` that
    ``zeroflow.memory.measure.analysed`` and ``zf.memory.collectives`` read."""

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
