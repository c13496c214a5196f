"""GPUs that are not there: meshes of abstract devices of a named GPU, for XLA:GPU compiles on
any machine (``zf.target_mesh("h100", data=8)``).

``jax.experimental.topologies`` describes a GPU topology from a ``GpuTargetConfigProto``: the
GPU's published figures (SM count, clocks, memory size and bandwidth, shared memory, compute
capability) in text form. Steps lowered with arguments sharded over such a mesh compile with
XLA:GPU (memory analysis, scheduled HLO, Triton kernels), without autotuning and without
running. The specs are package data in ``gpu_specs/`` (each file says where its figures come
from), in the schema of every supported jaxlib (0.10.2 to 0.12: the fields used are the same).
A GPU below compute capability 7.5 (the V100) compiles only with CUDA 12's ptxas: CUDA 13's
dropped Volta, and XLA:GPU would then fall back to a driver that is not there.

This needs a CUDA plugin at jaxlib's exact version, ``jax-cuda12-plugin`` + ``jax-cuda12-pjrt``
or ``jax-cuda13-plugin`` + ``jax-cuda13-pjrt`` (no CUDA libraries, no driver;
``zeroflow.util.compat.cuda_plugin_module``), and the CPU as JAX's platform: without
``JAX_PLATFORMS=cpu`` the plugin tries to start a GPU, fails, and never registers.
"""

from __future__ import annotations

import functools
import os
import re
import shutil
import subprocess
from pathlib import Path

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

from zeroflow.backend.mesh import CONTEXT, DATA, MODEL, axis_names
from zeroflow.util.compat import cuda_plugin_install_hint
from zeroflow.util.quiet_jax import cuda_plugin_installed

SPECS = Path(__file__).with_name("gpu_specs")
TARGETS = {
    "h100": "h100.txtpb",  # SXM5 80 GB
    "h200": "h200.txtpb",  # SXM 141 GB
    "a100": "a100.txtpb",  # SXM4 80 GB
    "l4": "l4.txtpb",  # 24 GB
    "rtx4070": "rtx4070.txtpb",  # 12 GB (Ada, sm_89): a consumer card
    "v100": "v100.txtpb",  # SXM2 32 GB (sm_70)
}
"Target GPU names and their spec files."

_MEMORY: dict[str, int] = {}  # device_kind -> memory size of the spec it came from
_DEVICES: set = set()  # every abstract device a target mesh was made of


class TargetUnavailable(RuntimeError):
    """The abstract GPU devices cannot be made here (plugin missing, or JAX already started
    with another platform); the message says what to do."""


def spec_text(gpu: str) -> str:
    name = gpu.lower()
    if name not in TARGETS:
        raise ValueError(f"unknown target GPU {gpu!r}; choose one of {', '.join(TARGETS)}")
    return (SPECS / TARGETS[name]).read_text()


def spec_field(text: str, field: str) -> str:
    """A scalar field of a spec (``device_memory_size``, ``device_description_str``)."""
    for line in text.splitlines():
        line = line.split("#", 1)[0].strip()
        if line.startswith(field + ":"):
            return line.split(":", 1)[1].strip().strip('"')
    raise KeyError(field)


def memory_bandwidth(gpu: str) -> float:
    """Bytes per second a target GPU reads from its own memory (its spec's figure)."""
    return float(spec_field(spec_text(gpu), "memory_bandwidth"))


def install_hint() -> str:
    import jaxlib.version

    return (
        f"{cuda_plugin_install_hint(jaxlib.version.__version__)} (and run with JAX_PLATFORMS=cpu)"
    )


def plugin_installed() -> bool:
    return cuda_plugin_installed()


@functools.cache
def _topology(gpu: str, hosts: int, per_host: int):
    from jax.experimental import topologies

    if not plugin_installed():
        raise TargetUnavailable(
            f"compiling for a {gpu} target needs the CUDA plugin: {install_hint()}"
        )
    text = spec_text(gpu)
    _check_ptxas(gpu, text)
    try:
        topo = topologies.get_topology_desc(
            platform="cuda", target_config=text, topology=f"1x{hosts}x{per_host}"
        )
    except Exception as e:  # the plugin did not register (platform) or rejected the spec
        platforms = os.environ.get("JAX_PLATFORMS", "")
        why = str(e).splitlines()[0] if str(e) else type(e).__name__
        if platforms != "cpu":
            raise TargetUnavailable(
                f"compiling for a {gpu} target needs JAX_PLATFORMS=cpu set before JAX starts "
                f"(it is {platforms!r}): {why}"
            ) from None
        raise TargetUnavailable(
            f"the CUDA plugin could not describe a {gpu} topology ({why}); {install_hint()}"
        ) from None
    _MEMORY[spec_field(text, "device_description_str")] = int(
        spec_field(text, "device_memory_size")
    )
    _DEVICES.update(topo.devices)
    return topo


LAST_CUDA_FOR_SM = ((7, 5), 12)
"CUDA 13's ptxas dropped compute capabilities below 7.5 (Volta: sm_70); CUDA 12's is the last."


def ptxas_path() -> str | None:
    """The ptxas XLA:GPU runs: under jax's CUDA path (``CUDA_ROOT``, or the ``nvidia-cuda-nvcc``
    wheel) when it has one, else the first on ``PATH``, else ``/usr/local/cuda``'s."""
    from jax._src import lib  # the CUDA root jax hands XLA (xla_gpu_cuda_data_dir)

    if lib.cuda_path and (Path(lib.cuda_path) / "bin" / "ptxas").is_file():
        return str(Path(lib.cuda_path) / "bin" / "ptxas")
    found = shutil.which("ptxas")
    if found:
        return found
    default = Path("/usr/local/cuda/bin/ptxas")
    return str(default) if default.is_file() else None


def ptxas_release(path: str) -> tuple[int, int] | None:
    """``(major, minor)`` of ``ptxas --version`` ("release 12.9"), or None if unreadable."""
    try:
        out = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    found = re.search(r"release (\d+)\.(\d+)", out)
    return (int(found[1]), int(found[2])) if found else None


def _capability(text: str) -> tuple[int, int]:
    sm = re.search(r"cuda_compute_capability\s*{\s*major:\s*(\d+)[^}]*minor:\s*(\d+)", text)
    if sm is None:
        raise KeyError("cuda_compute_capability")  # as spec_field does for a missing field
    return int(sm[1]), int(sm[2])


def compute_capability(gpu: str) -> tuple[int, int]:
    """``(major, minor)`` CUDA compute capability of the target GPU ``gpu`` (h100: (9, 0))."""
    return _capability(spec_text(gpu.lower()))


def _check_ptxas(gpu: str, text: str) -> None:
    """A GPU older than CUDA 13 supports needs CUDA 12's ptxas: without one XLA:GPU's compile
    fails late, saying ptxas is "too old" and falling back to a driver that is not there."""
    major, minor = _capability(text)
    oldest, last_cuda = LAST_CUDA_FOR_SM
    if (major, minor) >= oldest:
        return
    path = ptxas_path()
    release = ptxas_release(path) if path else None
    if release is not None and release[0] <= last_cuda:
        return
    found = (
        f"{path} is CUDA {release[0]}.{release[1]}'s"
        if release
        else (f"{path} gives no version" if path else "no ptxas was found")
    )
    raise TargetUnavailable(
        f"XLA:GPU compiles for a {gpu} (sm_{major}{minor}) only with CUDA {last_cuda}'s ptxas "
        f"(CUDA 13 dropped compute capabilities below 7.5) and {found}: pip install --target DIR "
        f"nvidia-cuda-nvcc-cu{last_cuda}, then run with CUDA_ROOT=DIR/nvidia/cuda_nvcc set before "
        "JAX starts"
    )


def target_mesh(gpu: str, data: int, model: int = 1, hosts: int = 1, *, context: int = 1) -> Mesh:
    """A ``("data", "model")`` mesh (``("data", "context", "model")`` when ``context > 1``) of
    ``data x context x model`` abstract devices of GPU ``gpu`` (``"h100"``, ``"h200"``,
    ``"a100"``, ``"l4"``, ``"rtx4070"``, ``"v100"``) on ``hosts`` hosts of equally many devices, for compiling
    (never running) steps: ``ZeroPlan``, ``state_shardings``,
    ``make_train_step(...).lower(abstract_state, abstract_batch).compile()`` and
    ``zf.memory.measure_step`` work on it. The data axis spans hosts; each host holds whole
    rows of ``context x model``. The V100 (sm_70) needs CUDA 12's ptxas (``TargetUnavailable``
    says how)."""
    for name, size in ((DATA, data), (CONTEXT, context), (MODEL, model), ("hosts", hosts)):
        if isinstance(size, bool) or not isinstance(size, (int, np.integer)) or size < 1:
            raise ValueError(f"target_mesh: {name} must be a positive int, got {size!r}")
    row = context * model
    total = data * row
    if total % hosts or (total // hosts) % row:
        raise ValueError(
            f"target_mesh: {data} x {row} devices do not split into {hosts} hosts "
            f"holding whole rows of context x model={row}"
        )
    topo = _topology(gpu.lower(), int(hosts), total // hosts)
    devices = sorted(topo.devices, key=lambda d: (d.process_index, d.id))
    names = axis_names(context)
    sizes = {DATA: data, CONTEXT: context, MODEL: model}
    grid = np.asarray(devices, dtype=object).reshape(tuple(sizes[a] for a in names))
    return Mesh(grid, names, axis_types=(AxisType.Auto,) * len(names))


def is_target_device(device) -> bool:
    """Whether ``device`` is one of a target mesh's abstract devices (not a real GPU of the
    same name)."""
    return device in _DEVICES


def memory_of(device) -> int | None:
    """Memory per device of a target's abstract device (its spec's size), else None."""
    return _MEMORY.get(getattr(device, "device_kind", ""))


def use_cpu_for_targets() -> None:
    """Compiling for a target needs the CPU as JAX's platform, also on a machine with a GPU
    (without a driver ``import zeroflow`` already chose it), unless the user chose one. Call
    before JAX starts its backends."""
    if os.environ.get("JAX_PLATFORMS") or not plugin_installed():
        return
    try:
        jax.config.update("jax_platforms", "cpu")
    except Exception:  # a backend already started: too late to choose, and nothing lost
        pass
