"""Optimizers as optax transforms: AdamW with 8-bit (blockwise-quantized) or bf16 moments.

    tx = zf.optim.adamw_8bit(3e-4, weight_decay=0.1)   # 2 bytes per parameter + block scales
    tx = zf.optim.adamw_bf16(3e-4)                      # 4 bytes per parameter
"""
from zeroflow.optim.adam import (ADAMW_CHOICES, ScaleByAdam8bitState, ScaleByAdamBf16State, adamw_8bit,
                                 adamw_bf16, scale_by_adam_8bit, scale_by_adam_bf16)
from zeroflow.optim.blockwise import dequantize, dynamic_map, quantize

__all__ = ["ADAMW_CHOICES", "adamw_8bit", "adamw_bf16", "scale_by_adam_8bit", "scale_by_adam_bf16",
           "ScaleByAdam8bitState", "ScaleByAdamBf16State", "quantize", "dequantize",
           "dynamic_map"]
