"""PAI's bytes cost model for an allow-list op: convert it only if the casts it needs move
fewer bytes than running it in half precision saves.

Every element costs its dtype's width each time it is read or written. For a matmul
``out = dot(a, b)`` run low instead of fp32:

- saved: each operand and the result are read/written at 2 bytes instead of 4 - in the forward
  dot, and (training) in the two backward dots, each of which touches all three again:
  ``2 * (n_a + n_b + n_out)`` per pass, 3 passes;
- spent: every fp32 operand not yet cast is read at 4 and written at 2 (6 bytes per element)
  in the forward pass, and its gradient is cast back up in the backward pass (6 more). That
  holds for an operand read from memory (a weight, an input). An operand that an elementwise
  op computes right here is cast by the same fused kernel, which only writes the extra half
  copy (2 bytes per element, and 2 for its gradient);
- avoided: a half operand that the fp32 op would have to cast up (the same 6 + 6 bytes).

A weight already cast for an earlier use costs nothing more. A loop-invariant weight used in a
loop body is cast once outside the loop, so its cost is divided by the trip count.

The embedding case of the PAI paper is the gather itself, which is neutral here and never
casts its table; the cost model covers its twin, a matmul against a large fp32 table with few
rows on the other side (a tied output projection over a 50k vocabulary with a small batch):
casting the V x D table moves 12 * V * D bytes for a saving of about 6 * N * (V + D).
"""

from __future__ import annotations

import dataclasses
import math

from zeroflow.backend import accelerators, targets

HALF_BYTES, FULL_BYTES = 2, 4
CAST_BYTES = HALF_BYTES + FULL_BYTES


@dataclasses.dataclass(frozen=True)
class Operand:
    """One floating-point operand of the op, as the cost model sees it."""

    size: int
    is_low: bool
    "Already in the half dtype."
    cast_ready: bool
    "An fp32 operand whose half copy already exists (another use cast it)."
    cast_share: float = 1.0
    "Fraction of a cast this op pays (1 / trip count: loop-invariant; 1 / k: read by k matmuls)."
    at_rest: bool = True
    "Read from memory (weights, inputs); False for a value computed by a fusible op here."


@dataclasses.dataclass(frozen=True)
class Verdict:
    convert: bool
    saved_bytes: float
    cast_bytes: float

    def reason(self) -> str:
        verb = "converted" if self.convert else "kept fp32"
        return (
            f"cost model: {verb}; casts move {fmt_bytes(self.cast_bytes)}, "
            f"half precision saves {fmt_bytes(self.saved_bytes)}"
        )


def judge(operands: list[Operand], out_size: int, *, train: bool) -> Verdict:
    passes = 3 if train else 1
    cast_passes = 2 if train else 1  # the forward cast, and its gradient's cast back
    sizes = sum(op.size for op in operands) + out_size
    saved = passes * (FULL_BYTES - HALF_BYTES) * sizes
    spent = avoided = 0.0
    for op in operands:
        per_element = cast_passes * (CAST_BYTES if op.at_rest else HALF_BYTES)
        if op.is_low:
            avoided += per_element * op.size
        elif not op.cast_ready:
            spent += per_element * op.size * op.cast_share
    return Verdict(convert=spent <= saved + avoided, saved_bytes=saved + avoided, cast_bytes=spent)


def fmt_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if abs(n) < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} GB"


def size_of(aval) -> int:
    return math.prod(aval.shape)


# --------------------------------------------------------------------------- FP8 matmuls
# FP8 moves about as many bytes as bf16 (each operand is read for its amax, read again and
# written at 1 byte before the GEMM reads it at 1), so a bytes-only model would never choose
# it: its gain is the tensor cores' doubled rate. The FP8 judgement is therefore a roofline:
# each GEMM takes max(flops / peak, bytes / bandwidth), plus the quantization passes.
# The rates are an H100 SXM's (the accelerator table and its target spec); only their ratios
# decide.
ROOFLINE_GPU = accelerators.required("h100")
HBM_BYTES_PER_S = targets.memory_bandwidth(ROOFLINE_GPU.name)
FP8_MIN_DIM = 16
"A matmul with a side shorter than this stays bf16 (FP8 GEMMs want multiples of 16)."
QUANTIZE_BYTES = 5
"Per element of a bf16 operand cast to FP8: read for its amax (2), read again (2), write (1)."


@dataclasses.dataclass(frozen=True)
class Fp8Verdict:
    convert: bool
    fp8_seconds: float
    bf16_seconds: float
    why: str = ""

    def reason(self) -> str:
        if self.why:
            return f"fp8: kept bf16 ({self.why})"
        verb = "fp8" if self.convert else "kept bf16"
        return (
            f"fp8 roofline: {verb}; {self.fp8_seconds * 1e6:.3g} us in FP8 (quantizing "
            f"included) vs {self.bf16_seconds * 1e6:.3g} us in bf16"
        )


def gemm_seconds(flops: float, nbytes: float, fp8: bool) -> float:
    """A GEMM's roofline time on an H100: its flops at the tensor cores' dense rate for its
    operand type, or its operand + result bytes at the memory's bandwidth, the larger."""
    peak = ROOFLINE_GPU.fp8_flops if fp8 else ROOFLINE_GPU.bf16_flops
    assert peak is not None  # an H100 has FP8 tensor cores
    return max(flops / peak, nbytes / HBM_BYTES_PER_S)


def judge_fp8(batch: int, m: int, k: int, n: int, *, train: bool) -> Fp8Verdict:
    """Run ``[batch] x [m, k] @ [k, n]`` (already bf16) as FP8 GEMMs? The forward product and,
    in training, the two backward ones, against the same in bf16."""
    if min(m, k, n) < FP8_MIN_DIM:
        return Fp8Verdict(False, 0.0, 0.0, f"skinny: a side below {FP8_MIN_DIM}")
    a, b, out = batch * m * k, batch * k * n, batch * m * n
    flops = 2.0 * batch * m * k * n
    bf16 = gemm_seconds(flops, 2 * (a + b + out), fp8=False)
    fp8 = gemm_seconds(flops, a + b + 2 * out, fp8=True)
    fp8 += QUANTIZE_BYTES * (a + b) / HBM_BYTES_PER_S
    if train:  # d_lhs = g @ rhs.T, d_rhs = lhs.T @ g; the gradient is quantized once for both
        bf16 += 2 * gemm_seconds(flops, 2 * (a + b + out), fp8=False)
        fp8 += gemm_seconds(flops, out + b + 2 * a, fp8=True)
        fp8 += gemm_seconds(flops, out + a + 2 * b, fp8=True)
        fp8 += QUANTIZE_BYTES * out / HBM_BYTES_PER_S
    return Fp8Verdict(fp8 < bf16, fp8, bf16)
