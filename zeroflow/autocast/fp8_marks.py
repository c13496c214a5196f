"""Which equations of a traced program are ``zf.autocast``'s FP8 matmuls, and how they scale.

Autocast binds each FP8 matmul (``fp8.scaled_dot``, ``fp8_delayed.scaled_dot_delayed``) inside
a name scope ``zf_fp8_dot_<n>``, ``n`` indexing a ``DotSpec`` (its dimension numbers, result
dtype, scaling and margin). A pass that later replays the program (the stage-3 weight fetch,
``zeroflow.engine.grads.gather_on_use``) reads the spec back from the equation's name stack
and may compute the same matmul another way: a weight gathered in FP8 is then fed to the FP8
GEMM as the gathered e4m3 bytes (``zeroflow.engine.zeropp.fp8_dot``), instead of being
dequantized and cast again. The scope changes nothing else of the program (names in the HLO's
metadata).
"""

from __future__ import annotations

import dataclasses
import re
import threading

_PREFIX = "zf_fp8_dot_"
_SCOPE = re.compile(_PREFIX + r"(\d+)")


@dataclasses.dataclass(frozen=True)
class DotSpec:
    """The static arguments of one FP8 matmul: ``dot_general``'s dimension numbers (tuples),
    the result dtype's name, the scaling (``"tensor"``, ``"row"`` or ``"delayed"``) and, for
    delayed scaling, the margin."""

    dims: tuple
    out_dtype: str
    scaling: str
    margin: int = 0


_SPECS: list[DotSpec] = []
_INDEX: dict[DotSpec, int] = {}
_LOCK = threading.Lock()


def scope(spec: DotSpec) -> str:
    """The name scope to bind the matmul of ``spec`` under (one per distinct spec)."""
    with _LOCK:
        if spec not in _INDEX:
            _INDEX[spec] = len(_SPECS)
            _SPECS.append(spec)
        return f"{_PREFIX}{_INDEX[spec]}"


def spec_of(eqn) -> DotSpec | None:
    """The ``DotSpec`` of ``eqn`` when it is an FP8 matmul bound by autocast (its custom-vjp
    call, the innermost such scope of its name stack), else None."""
    if eqn.primitive.name != "custom_vjp_call":
        return None
    found = _SCOPE.findall(str(eqn.source_info.name_stack))
    return _SPECS[int(found[-1])] if found else None
