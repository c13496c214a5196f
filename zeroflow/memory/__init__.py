"""Memory planning: analytic estimates (ZeRO accounting + GPT activations) and what XLA says.

    from zeroflow import memory
    est = memory.estimate(num_params=7.5e9, num_devices=64, stage=2)   # est.device_bytes ~ 16.6e9
    got = memory.measure(step, state, batch)                            # AOT memory_analysis()

``python -m zeroflow.memory --config X --devices N --device-memory 80GB`` prints every stage x
offload x remat choice and names the cheapest that fits. See docs/memory.md.
"""
from zeroflow.memory.estimate import (
    MemoryEstimate,
    ModelStates,
    activations,
    count_gpt_params,
    estimate,
    estimate_config,
    format_bytes,
    parse_bytes,
)
from zeroflow.memory.measure import MeasuredMemory, measure, measure_config, state_bytes

__all__ = ["MemoryEstimate", "ModelStates", "MeasuredMemory", "activations", "count_gpt_params",
           "estimate", "estimate_config", "format_bytes", "measure", "measure_config",
           "parse_bytes", "state_bytes"]
