"""Optimizers as optax transforms: AdamW with 8-bit (blockwise-quantized) or bf16 moments.

tx = zf.optim.adamw_8bit(3e-4, weight_decay=0.1)   # 2 bytes per parameter + block scales;
                                                    # fp32 below 4,096 entries
tx = zf.optim.adamw_bf16(3e-4)                      # 4 bytes per parameter
"""

from zeroflow.optim.adam import (
    ADAMW_CHOICES,
    BLOCK_SIZE,
    MIN_8BIT_SIZE,
    ScaleByAdam8bitState,
    ScaleByAdamBf16State,
    adamw_8bit,
    adamw_bf16,
    keeps_fp32,
    moment_bytes,
    scale_by_adam_8bit,
    scale_by_adam_bf16,
)
from zeroflow.optim.blockwise import dequantize, dynamic_map, quantize

__all__ = [
    "ADAMW_CHOICES",
    "BLOCK_SIZE",
    "MIN_8BIT_SIZE",
    "adamw_8bit",
    "adamw_bf16",
    "scale_by_adam_8bit",
    "scale_by_adam_bf16",
    "ScaleByAdam8bitState",
    "ScaleByAdamBf16State",
    "keeps_fp32",
    "moment_bytes",
    "quantize",
    "dequantize",
    "dynamic_map",
]
