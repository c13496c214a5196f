"""Which GEMMs of a compiled XLA:GPU program take FP8 operands (for tests and experiments).

XLA:GPU runs a matmul either as a cuBLAS(Lt) custom call (``__cublas$lt$matmul$f8`` for FP8)
or as a GEMM fusion (``kind=kCustom``, a fused computation around one ``dot``, emitted by
Triton). A GEMM counts as FP8 when both operands of its ``dot`` are float8 inside the fusion
(possibly through a transpose or bitcast of an FP8 parameter: layout only, no conversion),
or when it is the FP8 cuBLASLt call.
"""

from __future__ import annotations

import dataclasses
import re

F8 = ("f8e4m3fn", "f8e5m2", "f8e4m3fnuz", "f8e5m2fnuz")
_DEF = re.compile(r"^\s*(?:ROOT\s+)?%([\w.\-]+)\s*=\s*(\w+)\[")
_COMPUTATION = re.compile(r"^%?([\w.\-]+)\s*\(.*\)\s*->.*\{\s*$")
_DOT = re.compile(r"=\s*\w+\[[^\]]*\]\S*\s+dot\(%([\w.\-]+),\s*%([\w.\-]+)\)")
_LAYOUT_OPS = ("transpose", "bitcast", "copy", "reshape")


@dataclasses.dataclass(frozen=True)
class GemmCount:
    fp8: int
    "GEMMs whose two operands are float8."
    other: int
    "GEMMs in another type (bf16, f32)."
    fp8_operand_types: tuple
    "The (lhs, rhs) float8 types of each FP8 GEMM (e4m3 x e4m3 forward, e5m2 x e4m3 backward)."


def _computations(text: str) -> dict[str, list[str]]:
    comps: dict[str, list[str]] = {}
    current = None
    for line in text.splitlines():
        head = _COMPUTATION.match(line.strip()) if line and not line.startswith(" ") else None
        if head:
            current = head[1]
            comps[current] = []
        elif current is not None:
            comps[current].append(line)
    return comps


def _source_type(name: str, defs: dict[str, tuple[str, str]]) -> str:
    """The element type ``name`` has before any layout-only op (transpose, bitcast...)."""
    for _ in range(8):
        dtype, line = defs.get(name, ("", ""))
        op = re.search(r"\]\S*\s+(\w+)\(%([\w.\-]+)", line)
        if op is None or op[1] not in _LAYOUT_OPS:
            return dtype
        name = op[2]
    return defs.get(name, ("", ""))[0]


def count_gemms(hlo_text: str) -> GemmCount:
    """Count the GEMM fusions and cuBLAS calls of a compiled module's text
    (``compiled.as_text()``) by operand type."""
    comps = _computations(hlo_text)
    fp8, other, types = 0, 0, []
    for name, lines in comps.items():
        if "gemm_fusion" not in name and "triton_gemm" not in name:
            continue
        defs = {m[1]: (m[2], line) for line in lines if (m := _DEF.match(line))}
        for line in lines:
            dot = _DOT.search(line)
            if dot is None:
                continue
            pair = (_source_type(dot[1], defs), _source_type(dot[2], defs))
            if all(t in F8 for t in pair):
                fp8 += 1
                types.append(pair)
            else:
                other += 1
    for line in hlo_text.splitlines():
        if 'custom_call_target="__cublas$lt$matmul$f8"' in line:
            fp8 += 1
            types.append(("f8", "f8"))
        elif re.search(r'custom_call_target="__cublas\$(lt\$)?(matmul|gemm)"', line):
            other += 1
    return GemmCount(fp8=fp8, other=other, fp8_operand_types=tuple(types))
