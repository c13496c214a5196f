"""Where a row of the plan runs: a GPU target compiled without the GPU (``zf.target_mesh``),
or this machine's own devices."""

from __future__ import annotations

import dataclasses
import math
import os

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

from zeroflow.backend import accelerators, targets
from zeroflow.backend.accelerators import CPU_LINKS, Accelerator, Links
from zeroflow.backend.mesh import DATA, MODEL

GPUS_PER_HOST = 8
"Devices per host of a target: an 8-GPU server (HGX/DGX, or 8 x L4), beyond that more hosts."
CPU_FLOPS = 1e11
"A rough matmul rate for emulated CPU devices (the what-if's ordering only)."
UNKNOWN_GPU_FLOPS = 1e14
"For a GPU whose dense bf16 peak the planner does not know (the what-if's ordering only)."


@dataclasses.dataclass(frozen=True)
class Where:
    """``devices`` devices of GPU ``name`` (a target, compiled without it) or of this
    machine (``local``)."""

    name: str
    devices: int
    hosts: int
    memory_bytes: int
    peak_flops: float
    links: Links
    local: bool = False
    device_kind: str = ""

    @property
    def is_gpu(self) -> bool:
        return not self.local or jax.default_backend() in ("gpu", "cuda", "rocm")

    @property
    def per_process(self) -> int:
        """Devices sharing one host process's memory."""
        return self.devices // self.hosts

    @property
    def title(self) -> str:
        return f"{self.devices} x {self.name}"

    def mesh(self) -> Mesh:
        if not self.local:
            return targets.target_mesh(self.name, data=self.devices, hosts=self.hosts)
        devices = jax.devices()
        if len(devices) < self.devices:
            raise ValueError(
                f"planning for {self.devices} devices of this machine needs as many; "
                f"{len(devices)} here ({jax.default_backend()})"
            )
        grid = np.asarray(devices[: self.devices], dtype=object).reshape(self.devices, 1)
        return Mesh(grid, (DATA, MODEL), axis_types=(AxisType.Auto, AxisType.Auto))


def target(name: str, devices: int, device_memory: int | None = None) -> Where:
    """``devices`` GPUs of target ``name`` on hosts of ``GPUS_PER_HOST``."""
    spec = targets.spec_text(name)  # an unknown name stops here, with the choices
    kind = targets.spec_field(spec, "device_description_str")
    hosts = math.ceil(devices / GPUS_PER_HOST)
    if devices % hosts:
        raise ValueError(
            f"{devices} devices do not split into hosts of up to {GPUS_PER_HOST}: use a "
            f"multiple of {GPUS_PER_HOST} above {GPUS_PER_HOST}"
        )
    return Where(
        name=name.lower(),
        devices=devices,
        hosts=hosts,
        memory_bytes=device_memory or int(targets.spec_field(spec, "device_memory_size")),
        peak_flops=accelerators.peak_flops(kind) or UNKNOWN_GPU_FLOPS,
        links=dataclasses.replace(
            _links(accelerators.named(name)), memory=targets.memory_bandwidth(name)
        ),
        device_kind=kind,
    )


def local(devices: int, device_memory: int | None = None) -> Where:
    """``devices`` of this machine's devices: a GPU's memory as the runtime reports it; for
    (emulated) CPU devices, the machine's memory shared among them."""
    device = jax.devices()[0]
    platform = jax.default_backend()
    kind = str(getattr(device, "device_kind", platform))
    if device_memory is None:
        stats = device.memory_stats() if platform != "cpu" else None
        if stats and stats.get("bytes_limit"):
            device_memory = int(stats["bytes_limit"])
        else:
            device_memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // devices
    gpu = platform != "cpu"
    found = accelerators.of_kind(kind) if gpu else None
    return Where(
        name=found.name if found else platform if gpu else "cpu",
        devices=devices,
        hosts=max(jax.process_count(), 1),
        memory_bytes=int(device_memory),
        peak_flops=(accelerators.peak_flops(kind) or UNKNOWN_GPU_FLOPS) if gpu else CPU_FLOPS,
        links=_links(found) if found else CPU_LINKS,
        local=True,
        device_kind=kind,
    )


def _links(gpu: Accelerator | None) -> Links:
    """A GPU's links from the accelerator table; an H100's where the table has none."""
    links = gpu.links if gpu is not None else None
    return links or next(a.links for a in accelerators.ACCELERATORS if a.name == "h100" and a.links)
