"""The XLA:GPU option sets ``experiments/vs_gspmd.py`` compiles the plain ``jax.jit`` step with,
so that its GSPMD FSDP baseline is the best one found, not XLA's defaults.

- ``default``: nothing set (what ``jax.jit`` gets out of the box).
- ``zeroflow``: the options zeroflow gives its own step on GPUs
  (``zeroflow.backend.compiler_options``: latency-hiding scheduler, 1 MB combine thresholds, two
  collectives in flight, all-gathers pipelined across loop iterations, reduce-scatters not).
- ``recipe``: the flags NVIDIA's JAX-Toolbox performance guide and MaxText's GPU scripts set for
  FSDP: the latency-hiding scheduler, the highest-priority stream for collectives, combine
  thresholds of 1 GiB (all-reduce), 1 GiB / 8 (all-gather) and 1 GiB / 16 (reduce-scatter) for
  8 GPUs, all-gathers, reduce-scatters and all-reduces pipelined across loop iterations, while
  loops double-buffered, cuBLAS rather than Triton GEMMs.
- ``recipe-triton``: ``recipe`` keeping XLA's Triton GEMMs. cuBLAS GEMMs are what the recipe
  picks on a real H100, but XLA's latency-hiding scheduler costs a cuBLAS call well above the
  Triton fusion it replaces (the annotated GSPMD step of the 1B shape: 231.1 ms with Triton
  GEMMs, 338.2 ms without; zeroflow's stage 3 moves alike), so for estimates this set is the recipe's fair form.
- ``recipe-triton+2``: ``recipe-triton`` with two collectives in flight (a gradient reduction
  beside the next layer's gather, as zeroflow runs them).

``SHARED`` are the options of ``recipe`` that are tuning knobs of XLA rather than choices made
for one program's memory (the combine thresholds and reduce-scatter pipelining are such choices:
zeroflow bounds them to reduce one gradient at a time), less the GEMM backend: zeroflow's step is
compiled with them too (set ``shared``), so that both systems get the same options wherever an
option is not specific to one. ``rs`` and ``shared+rs`` add the recipe's reduce-scatter
pipelining to zeroflow's own options (which turn it off to keep one layer's fp32 gradient from
living across a loop iteration): how much of the baseline's schedule that buys, and at what
peak.
"""
from __future__ import annotations

from zeroflow.cli.common import start_script

start_script()  # before jax: where the CUDA plugin has no driver, a CPU jax without its noise

GIB = 2**30
DEVICES = 8


def _pipelined(kind: str) -> dict:
    """XLA's collective pipeliner on for ``kind`` ("all_gather", "reduce_scatter",
    "all_reduce"): a bool option up to jaxlib 0.10, an enum from 0.11."""
    import jaxlib

    version = tuple(int(p) for p in jaxlib.__version__.split(".")[:2])
    if version < (0, 11):
        return {f"xla_gpu_enable_pipelined_{kind}": True}
    return {f"xla_gpu_pipeline_{kind}": "COLLECTIVE_PIPELINING_MODE_ON"}


SHARED = {
    "xla_gpu_enable_latency_hiding_scheduler": True,
    "xla_gpu_enable_highest_priority_async_stream": True,
    "xla_gpu_enable_while_loop_double_buffering": True,
}
"The recipe's options that are not specific to one program (see the module doc)."


def option_set(name: str, traits=None) -> dict:
    """The XLA compile options of set ``name`` (``traits``: the target's, for ``zeroflow``)."""
    if name == "default":
        return {}
    if name == "zeroflow":
        from zeroflow.backend import compiler_options

        return compiler_options(traits)
    if name in ("recipe", "recipe-triton", "recipe-triton+2"):
        options = {
            **SHARED,
            "xla_gpu_all_reduce_combine_threshold_bytes": GIB,
            "xla_gpu_all_gather_combine_threshold_bytes": GIB // DEVICES,
            "xla_gpu_reduce_scatter_combine_threshold_bytes": GIB // (2 * DEVICES),
            **_pipelined("all_gather"),
            **_pipelined("reduce_scatter"),
            **_pipelined("all_reduce"),
        }
        if name == "recipe":
            options["xla_gpu_enable_triton_gemm"] = False
        if name == "recipe-triton+2":
            options["xla_gpu_experimental_parallel_collective_overlap_limit"] = 2
        return options
    if name == "shared":
        return dict(SHARED)
    if name == "shared+rs":  # as the recipe, a loop's reduce-scatter moved into the next iteration
        return {**SHARED, **_pipelined("reduce_scatter")}
    if name == "rs":
        return _pipelined("reduce_scatter")
    raise ValueError(f"unknown XLA option set {name!r}")


PLAIN_SETS = ("default", "zeroflow", "recipe", "recipe-triton", "recipe-triton+2")
"What the annotated GSPMD step is compiled with; its row is the set with the shortest step."
