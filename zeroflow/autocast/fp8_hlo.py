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
_WIDTH = {"f8": 1, "bf16": 2, "f16": 2, "f32": 4, "f64": 8, "s8": 1, "u8": 1, "s32": 4}
_DEF = re.compile(r"^\s*(?:ROOT\s+)?%([\w.\-]+)\s*=\s*(\w+)\[([\d,]*)\]")
_COMPUTATION = re.compile(r"^%?([\w.\-]+)\s*\(.*\)\s*->.*\{\s*$")
_DOT = re.compile(
    r"=\s*(\w+)\[([\d,]*)\]\S*\s+dot\(%([\w.\-]+),\s*%([\w.\-]+)\).*?"
    r"lhs_contracting_dims=\{([\d,]*)\}"
)
_LAYOUT_OPS = ("transpose", "bitcast", "copy", "reshape")


@dataclasses.dataclass(frozen=True)
class GemmCount:
    fp8: int
    "GEMMs whose two operands are float8."
    other: int
    "GEMMs in another type (bf16, f32)."
    fp8_operand_types: tuple
    "The (lhs, rhs) float8 types of each FP8 GEMM (e4m3 x e4m3 forward, e5m2 x e4m3 backward)."
    fp8_flops: float = 0.0
    "2 x output size x contracted size, summed over the FP8 GEMM fusions."
    other_flops: float = 0.0
    fp8_bytes: float = 0.0
    "Operand and result bytes the FP8 GEMM fusions' dots read and write."
    other_bytes: float = 0.0


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


def _dims(text: str) -> list[int]:
    return [int(d) for d in text.split(",") if d]


def _size(dims) -> int:
    out = 1
    for d in dims:
        out *= d
    return out


def _width(dtype: str) -> int:
    return 1 if dtype.startswith("f8") else _WIDTH.get(dtype, 4)


def _source(name: str, defs: dict) -> tuple[str, list[int]]:
    """The element type ``name`` has before any layout-only op (transpose, bitcast...), and
    its own shape."""
    shape = defs.get(name, ("", [], ""))[1]
    for _ in range(8):
        dtype, _, line = defs.get(name, ("", [], ""))
        op = re.search(r"\]\S*\s+(\w+)\(%([\w.\-]+)", line)
        if op is None or op[1] not in _LAYOUT_OPS:
            return dtype, shape
        name = op[2]
    return defs.get(name, ("", [], ""))[0], shape


def _fusion_dots(lines: list[str]):
    """``(lhs type, rhs type, flops, bytes)`` of each dot in one GEMM fusion."""
    defs = {m[1]: (m[2], _dims(m[3]), line) for line in lines if (m := _DEF.match(line))}
    for line in lines:
        dot = _DOT.search(line)
        if dot is None:
            continue
        out_dtype, out_dims = dot[1], _dims(dot[2])
        (lt, lhs), (rt, rhs) = _source(dot[3], defs), _source(dot[4], defs)
        k = _size(lhs[d] for d in _dims(dot[5]) if d < len(lhs))
        flops = 2.0 * _size(out_dims) * k
        nbytes = _size(lhs) * _width(lt) + _size(rhs) * _width(rt)
        yield lt, rt, flops, nbytes + _size(out_dims) * _width(out_dtype)


def count_gemms(hlo_text: str) -> GemmCount:
    """Count the GEMM fusions and cuBLAS calls of a compiled module's text
    (``compiled.as_text()``) by operand type, with the GEMM fusions' flops and bytes."""
    fp8 = other = 0
    flops, nbytes, types = [0.0, 0.0], [0.0, 0.0], []
    for name, lines in _computations(hlo_text).items():
        if "gemm_fusion" not in name and "triton_gemm" not in name:
            continue
        for lt, rt, f, b in _fusion_dots(lines):
            is_fp8 = lt in F8 and rt in F8
            fp8, other = fp8 + is_fp8, other + (not is_fp8)
            flops[not is_fp8] += f
            nbytes[not is_fp8] += b
            if is_fp8:
                types.append((lt, rt))
    for line in hlo_text.splitlines():
        if 'custom_call_target="__cublas$lt$matmul$f8"' in line:
            fp8 += 1
            types.append(("f8", "f8"))
        elif re.search(r'custom_call_target="__cublas\$(lt\$)?(matmul|gemm)"', line):
            other += 1
    return GemmCount(fp8, other, tuple(types), flops[0], flops[1], nbytes[0], nbytes[1])
