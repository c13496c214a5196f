"""ZeRO++ (Wang et al., "ZeRO++: Extremely Efficient Collective Communication for Giant Model
Training", 2023) for zeroflow's stage 3: quantized weight gathers (qwZ) and the bytes each
collective moves inside and across hosts.

- ``quantize`` / ``dequantize``: blockwise symmetric int8 (``zeroflow.zeropp.quantize``);
- ``quantized_all_gather``: a stage-3 shard gathered as int8 values and block scales, then
  dequantized to the compute dtype (``zeroflow.zeropp.gather``);
- ``hosts_of``: the host of every device of a mesh, which the collectives' cross-host bytes
  are counted against (``zeroflow.zeropp.hosts``).
"""
from zeroflow.zeropp.quantize import Quantized, dequantize, quantize, transit_bytes

__all__ = ["Quantized", "dequantize", "quantize", "transit_bytes"]
