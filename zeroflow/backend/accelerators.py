"""The one table of accelerator facts: dense peak FLOP/s (bf16, fp8) and the links one device
moves bytes over. The trainer's MFU, the memory CLI's and the planner's step estimates,
autocast's FP8 roofline, the GPU report and the experiments read it; a GPU's memory size and
bandwidth come from its target spec (``zeroflow.backend.targets``), never from here.

Figures: vendor datasheets, dense (no structured sparsity, half the "with sparsity" figure);
a plain name is the SXM part, and the H100's PCIe and NVL cards (lower peaks) have rows of
their own, matched before it.
"""

from __future__ import annotations

import dataclasses
import re


@dataclasses.dataclass(frozen=True)
class Links:
    """Bytes per second one device moves, one direction: to a peer in its host, over PCIe to
    its host's memory, to a peer in another host, and from its own memory."""

    peer: float
    host: float
    network: float
    memory: float = 2e12
    "The device's own memory (a target's spec gives it)."


@dataclasses.dataclass(frozen=True)
class Accelerator:
    name: str
    "How a target is named (``--gpus h100``)."
    kind: str
    "A pattern of its ``device_kind`` ('NVIDIA H100 80GB HBM3'), matched as a word."
    bf16_flops: float
    fp8_flops: float | None = None
    "None: no fp8 tensor cores."
    links: Links | None = None
    "None: not known here (the planner's what-if then assumes an H100's)."


ACCELERATORS = (
    # H100 PCIe and NVL: 1,513 and 1,671 TFLOP/s bf16 "with sparsity" (3,026 and 3,341 fp8).
    Accelerator("h100-pcie", "H100 PCIe", 756.5e12, 1513e12),
    Accelerator("h100-nvl", "H100 NVL", 835.5e12, 1670.5e12),
    # NVLink 4 (900 GB/s both ways), PCIe Gen5 x16, one 400 Gb/s NIC per GPU (DGX H100).
    Accelerator("h100", "H100", 989e12, 1979e12, Links(peer=450e9, host=64e9, network=50e9)),
    Accelerator("h200", "H200", 989e12, 1979e12, Links(peer=450e9, host=64e9, network=50e9)),
    Accelerator("gh200", "GH200", 989e12, 1979e12),
    Accelerator("h800", "H800", 989e12, 1979e12),
    # NVLink 3 (600 GB/s both ways), PCIe Gen4 x16, one 200 Gb/s NIC per GPU (DGX A100).
    Accelerator("a100", "A100", 312e12, None, Links(peer=300e9, host=32e9, network=25e9)),
    Accelerator("a10g", "A10G", 125e12),
    # No NVLink: peers over PCIe Gen4 x16; a 100 Gb/s NIC shared by the host's GPUs.
    Accelerator("l4", "L4", 121e12, 242e12, Links(peer=32e9, host=32e9, network=3e9)),
    # NVLink 2 (300 GB/s both ways), PCIe Gen3 x16, one 100 Gb/s NIC per GPU (DGX-1).
    Accelerator("v100", "V100", 125e12, None, Links(peer=150e9, host=16e9, network=12.5e9)),
    Accelerator("tpu-v4", "TPU v4", 275e12),
    Accelerator("tpu-v5e", "TPU v5 ?(lite|e)", 197e12),
    Accelerator("tpu-v5p", "TPU v5p", 459e12),
    Accelerator("tpu-v6", "TPU v6", 918e12),
)
CPU_LINKS = Links(peer=10e9, host=10e9, network=10e9, memory=20e9)
"Emulated CPU devices share one memory: every link is a memory copy."


def named(name: str) -> Accelerator | None:
    """The accelerator a target name ('h100') stands for, or None."""
    return next((a for a in ACCELERATORS if a.name == name.lower()), None)


def required(name: str) -> Accelerator:
    """The accelerator a target name stands for; a one-line ValueError naming the table's
    otherwise."""
    found = named(name)
    if found is None:
        names = [a.name for a in ACCELERATORS]
        raise ValueError(f"unknown target {name!r}; choose one of {names}")
    return found


def of_kind(device_kind: str) -> Accelerator | None:
    """The accelerator a ``device_kind`` ('NVIDIA H100 80GB HBM3', 'TPU v5 lite') names."""
    for a in ACCELERATORS:
        if re.search(rf"\b{a.kind}\b", device_kind, re.IGNORECASE):
            return a
    return None


def peak_flops(device_kind: str, dtype: str = "bf16") -> float | None:
    """Dense peak FLOP/s of a device kind in ``dtype`` ('bf16' or 'fp8'), or None."""
    a = of_kind(device_kind)
    if a is None:
        return None
    return a.fp8_flops if dtype == "fp8" else a.bf16_flops
