"""What machine a measurement ran on, and the peak FLOP/s an MFU figure divides by."""
from __future__ import annotations

import importlib.metadata
import platform
import sys

from zeroflow.backend import accelerators

PEAK_SOURCE = ("zeroflow/backend/accelerators.py: vendor datasheet, dense bf16 tensor-core peak "
               "(half the 'with sparsity' figure)")
CPU_MATMUL_MAX = 512
"Largest matmul side the environment probe runs on a CPU."
PACKAGE_PREFIXES = ("jax", "flax", "optax", "orbax", "numpy", "triton", "nvidia-cudnn",
                    "nvidia-cublas", "nvidia-cuda-runtime", "nvidia-nccl", "ml-dtypes")


def peak_bf16_flops(device_kind: str) -> tuple[float | None, str | None]:
    """``(FLOP/s, where the number comes from)`` for a known accelerator, else ``(None, None)``."""
    flops = accelerators.peak_flops(device_kind, "bf16")
    return (flops, PEAK_SOURCE) if flops else (None, None)


def package_versions() -> dict[str, str]:
    found = {}
    for dist in importlib.metadata.distributions():
        name = (dist.metadata["Name"] or "").lower()
        if name.startswith(PACKAGE_PREFIXES):
            found[name] = dist.version
    return dict(sorted(found.items()))


def measure_matmul_flops(size: int, iters: int = 10) -> float:
    """Achieved FLOP/s of one bf16 ``size^3`` matmul: what the vendor library reaches here."""
    import jax
    import jax.numpy as jnp

    from benchlib.timing import median_seconds
    key = jax.random.key(0)
    a = jax.random.normal(key, (size, size), jnp.bfloat16)
    b = jax.random.normal(jax.random.fold_in(key, 1), (size, size), jnp.bfloat16)
    seconds = median_seconds(jax.jit(jnp.matmul), a, b, warmup=2, iters=iters)
    return 2 * size**3 / seconds


def environment(matmul_size: int) -> dict:
    """Runs in a child: the accelerator as jax sees it, package versions, a matmul probe."""
    import jax
    device = jax.devices()[0]
    stats = device.memory_stats() or {}
    peak, source = peak_bf16_flops(device.device_kind)
    return {
        "backend": jax.default_backend(),
        "device_kind": device.device_kind,
        # "9.0" on an H100: whether it has FP8 tensor cores (the fp8 stage); None off NVIDIA GPUs
        "compute_capability": getattr(device, "compute_capability", None),
        "device_count": jax.device_count(),
        "bytes_limit": stats.get("bytes_limit"),
        "jax": jax.__version__,
        "jaxlib": importlib.metadata.version("jaxlib"),
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "packages": package_versions(),
        "default_matmul_precision": jax.config.jax_default_matmul_precision,
        "peak_bf16_flops": peak,
        "peak_source": source,
        "matmul_size": matmul_size,
        # A GPU-sized matmul would take minutes on a CPU, where the figure means nothing anyway.
        "matmul_bf16_flops": (measure_matmul_flops(matmul_size)
                              if jax.default_backend() != "cpu" or matmul_size <= CPU_MATMUL_MAX else None),
    }
