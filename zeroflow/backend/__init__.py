"""Backends: what differs between XLA:CPU and GPUs, read from a mesh (``traits``), and GPUs
that are not there (``targets``: meshes of abstract devices for XLA:GPU compiles anywhere)."""

from zeroflow.backend.targets import TARGETS, TargetUnavailable, target_mesh
from zeroflow.backend.traits import Traits, compiler_options, current, for_platform, of, tracing_for

__all__ = [
    "TARGETS",
    "TargetUnavailable",
    "Traits",
    "compiler_options",
    "current",
    "for_platform",
    "of",
    "target_mesh",
    "tracing_for",
]
