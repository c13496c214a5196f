"""GEMMs of one whole step of a compiled XLA:GPU program, by operand type, each counted as
often as it runs (a scanned layer's GEMMs once per layer), with an H100 roofline time.

``zeroflow.autocast.fp8_hlo.count_gemms`` reads each GEMM fusion once (a loop body's once, not
once per trip). Here each GEMM fusion is weighted by how many times the computations that call
it run per step: a ``while`` body its known trip count times its caller's, any other called
computation as often as its callers. The roofline time of one GEMM is the larger of its flops at
the tensor cores' dense rate for its operand type and its operand + result bytes at HBM
bandwidth (``zeroflow.autocast.cost.gemm_seconds``: an H100 SXM's rates from the accelerator
table and its target spec): what the GEMM costs where nothing but the hardware's rates limits
it; not XLA's model and not a measurement.
"""
from __future__ import annotations

import re

from zeroflow.cli.common import start_script

start_script()  # before jax: where the CUDA plugin has no driver, a CPU jax without its noise

from zeroflow.autocast.cost import gemm_seconds  # noqa: E402
from zeroflow.autocast.fp8_hlo import F8, _computations, _fusion_dots  # noqa: E402

_CALLS = re.compile(r"\b(calls|body|to_apply|condition|branch_computations)="
                    r"(\{[%\w.\-, ]+\}|%?[\w.\-]+)")
_TRIPS = re.compile(r'known_trip_count"?:\{"n":"(\d+)"')


def runs_per_step(hlo_text: str) -> dict[str, float]:
    """``{computation: times it runs per step}`` from the entry computation down."""
    callers: dict[str, list[tuple[str, int]]] = {}
    entry, current = None, None
    for line in hlo_text.splitlines():
        head = re.match(r"^(ENTRY )?%?([\w.\-]+) ", line)
        if head and line.rstrip().endswith("{"):
            current = head[2]
            entry = current if head[1] else entry
            continue
        if current is None:
            continue
        trips = _TRIPS.search(line)
        for kind, names in _CALLS.findall(line):
            factor = int(trips[1]) if kind == "body" and trips else 1
            for name in names.strip("{}").split(","):
                callers.setdefault(name.strip().lstrip("%"), []).append((current, factor))
    memo: dict[str, float] = {}

    def runs(name: str, path: tuple = ()) -> float:
        if name == entry:
            return 1.0
        if name not in memo:
            memo[name] = sum(f * runs(c, path + (name,)) for c, f in callers.get(name, ())
                             if c not in path)
        return memo[name]

    return {name: runs(name) for name in set(callers) | {entry}}


def step_gemms(hlo_text: str) -> dict:
    """Per step, for FP8 GEMMs ("fp8": both operands float8) and the rest ("other"): GEMMs
    run, flops, bytes (operands + results), and their roofline time in ms."""
    runs = runs_per_step(hlo_text)
    out = {kind: {"gemms": 0.0, "flops": 0.0, "bytes": 0.0, "roofline_ms": 0.0}
           for kind in ("fp8", "other")}
    for name, lines in _computations(hlo_text).items():
        if "gemm_fusion" not in name and "triton_gemm" not in name:
            continue
        n = runs.get(name, 0.0)
        for lt, rt, flops, nbytes in _fusion_dots(lines):
            kind = "fp8" if lt in F8 and rt in F8 else "other"
            seconds = gemm_seconds(flops, nbytes, fp8=kind == "fp8")
            row = out[kind]
            row["gemms"] += n
            row["flops"] += n * flops
            row["bytes"] += n * nbytes
            row["roofline_ms"] += n * seconds * 1e3
    return out
