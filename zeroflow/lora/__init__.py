"""LoRA on any JAX loss, with no change to the model (docs/lora.md).

    lo = zf.lora(loss_fn, rank=8, alpha=16, targets=r"attn/(query|value)/kernel", dropout=0.0)
    adapters = lo.init(rng, params, batch)
    loss = lo.loss({"base": params, "lora": adapters}, batch)
    merged = lo.merge(params, adapters)          # or zf.lora_merge(params, adapters, alpha=16)

- ``transform.py``: ``lora``, ``LoRA`` and ``lora_merge``;
- ``replay.py``: the jaxpr interpreter that adds the low-rank path to the matmuls;
- ``views.py``: a weight followed through casts, transposes, reshapes and scans;
- ``adapters.py``: the factors' layout, initialisation and the merged update;
- ``peft.py``: the adapters as a Hugging Face peft folder.
"""

from zeroflow.lora.adapters import Site
from zeroflow.lora.transform import LoRA, lora, lora_merge

__all__ = ["LoRA", "Site", "lora", "lora_merge"]
