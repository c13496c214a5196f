"""ZeRO++ (Wang et al., "ZeRO++: Extremely Efficient Collective Communication for Giant Model
Training", 2023) for zeroflow's stage 3: quantized weight gathers (qwZ), hierarchical weight
partitions (hpZ), quantized gradient reduction (qgZ), and the bytes each collective moves
inside and across hosts.

- ``quantize`` / ``dequantize``: blockwise symmetric int8 (``zeroflow.engine.zeropp.quantize``);
- ``quantized_all_gather``: a stage-3 shard gathered as int8 values and block scales, then
  dequantized to the compute dtype (``zeroflow.engine.zeropp.gather``);
- ``hierarchical``: hpZ, the stage-3 compute weights kept as one copy per host, gathered
  within the host and refreshed after each update;
- ``quantized_reduce_scatter``: qgZ, a gradient reduce-scattered as int8 in two all-to-all
  hops (within the host, across hosts) with fp32 sums (``zeroflow.engine.zeropp.reduce``);

The host of every device (``zeroflow.engine.hosts``), which the collectives' cross-host bytes
are counted against and the within-host groups are built from, lives beside the plan that
checks it.

Which of them a stage-3 fetch uses is one value,
``zeroflow.engine.grads.sources.Stage3Collectives``.
"""

from zeroflow.engine.zeropp.quantize import Quantized, dequantize, quantize, transit_bytes

__all__ = ["Quantized", "dequantize", "quantize", "transit_bytes"]
