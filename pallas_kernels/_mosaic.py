"""What the Mosaic GPU (Hopper, sm_90) kernels share: operand layouts in shared memory, the
interpreter that runs them on a CPU, and finding their calls in a compiled program.

A `plgpu.kernel` body sees its inputs in global memory; `plgpu.emit_pipeline` copies tiles into
shared memory with the TMA unit, and `plgpu.wgmma` multiplies tiles there into an fp32
accumulator held in registers. wgmma reads its operands in a tiled, swizzled layout (below);
each warpgroup multiplies 64 rows at a time, so row tiles are multiples of 64.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp

from pallas_kernels import _mgpu
from pallas_kernels._mgpu import lazy_plgpu as plgpu

WGMMA_ROWS = 64
"Rows of one warpgroup matrix multiply: every accumulator's row count is a multiple of this."

# A Mosaic GPU kernel in XLA's HLO: a custom call ("mosaic_gpu_v2" from jax 0.10) whose
# serialized module names its function `<kernel body's name>_mosaic_gpu`.
_CALL = 'custom_call_target="mosaic_gpu'
_NAME = re.compile(r"\\00([A-Za-z]\w*?)_mosaic_gpu\\00")


def interpret_params():
    """Parameters that run a `plgpu.kernel` in jax's GPU interpreter on the CPU (shared memory,
    TMA copies, barriers and wgmma simulated)."""
    return _mgpu.interpret_params()


def smem_transforms(dtype, minor: int) -> tuple:
    """Tiling and swizzle of a shared-memory tile whose last axis has `minor` elements: the
    widest swizzle (32/64/128 bytes) the row's bytes allow, in (8 rows x one swizzle) tiles."""
    itemsize = jnp.dtype(dtype).itemsize
    swizzle = plgpu.find_swizzle(minor * itemsize * 8)
    return plgpu.TilingTransform((8, swizzle // itemsize)), plgpu.SwizzleTransform(swizzle)


def kernel_names(hlo_text: str) -> list[str]:
    """Sorted names of the Mosaic GPU kernels a compiled program's HLO text calls, one per call
    ("?" where a call's module names none)."""
    names = []
    for line in hlo_text.splitlines():
        if _CALL in line:
            found = [n for n in _NAME.findall(line) if n != "stable"]  # the dialect's own name
            names.append(found[0] if found else "?")
    return sorted(names)


def vary_like(out, *inputs):
    """`out` marked as varying over every manual mesh axis any of `inputs` varies over.

    Inside `jax.shard_map(check_vma=True)` a `plgpu.kernel`'s outputs come back invariant
    whatever its `out_type` says, while autodiff expects what the inputs vary over."""
    want = frozenset().union(*(_varying(x) for x in inputs))
    extra = tuple(sorted(want - _varying(out)))
    return jax.lax.pcast(out, extra, to="varying") if extra else out


def _varying(x) -> frozenset:
    aval = jax.typeof(x)
    return aval.mat.varying if hasattr(aval, "mat") else frozenset()
