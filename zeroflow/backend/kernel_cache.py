"""XLA:GPU kernels shared by the compiles of one process for a GPU target.

XLA:GPU generates every fused kernel on its own: LLVM, then one ``ptxas`` run per kernel. For a
small model that is most of a compile (a 2-layer GPT train step for one abstract H100: 118
``ptxas`` runs, half of the compile's time). Compiles of one model under another plan, batch or
remat policy need mostly the same kernels (the optimizer's update for each parameter shape, a
layer's fusions), so XLA's kernel cache (``xla_gpu_kernel_cache_file``) keeps each kernel a
compile generated, keyed by its fused computation, and the next compile links the ones that
match instead of generating them. Nothing else changes: the HLO, its schedule and its buffers
(the memory analysis) are the compiler's own either way.

Used for the abstract devices of ``zf.target_mesh`` only, whose programs are compiled and never
run; a program for real GPUs is compiled as XLA compiles it by default. One file per GPU model
and process, in a temporary folder removed when the process ends: XLA does not key a kernel by
the GPU it was generated for, and a file that another process appends to could be read half
written. ``ZEROFLOW_KERNEL_CACHE=0`` turns it off.
"""

from __future__ import annotations

import atexit
import os
import re
import shutil
import tempfile

ENV = "ZEROFLOW_KERNEL_CACHE"
"0: compile every target program without reusing kernels; 1 (the default): reuse them."

_folder: dict[int, str] = {}  # process id -> its kernel folder (a forked child makes its own)


def options(device_kind: str) -> dict:
    """XLA options that make this process's compiles for ``device_kind`` share kernels
    (none when turned off)."""
    setting = os.environ.get(ENV, "1")
    if setting not in ("0", "1"):
        raise ValueError(f"{ENV}={setting!r}: set it to 0 (off) or 1 (on, the default)")
    if setting == "0":
        return {}
    name = re.sub(r"[^A-Za-z0-9]+", "-", device_kind).strip("-") or "gpu"
    return {"xla_gpu_kernel_cache_file": os.path.join(_process_folder(), f"{name}.kernels")}


def reset() -> None:
    """Forget the kernels this process generated: its next compile generates them again."""
    _remove(os.getpid())


def _process_folder() -> str:
    pid = os.getpid()
    if pid not in _folder:
        _folder[pid] = tempfile.mkdtemp(prefix=f"zeroflow-kernels-{pid}-")
        atexit.register(_remove, pid)
    return _folder[pid]


def _remove(pid: int) -> None:
    folder = _folder.pop(pid, None) if os.getpid() == pid else None  # not a forked child's
    if folder is not None:
        shutil.rmtree(folder, ignore_errors=True)
