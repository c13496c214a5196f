"""LoRA in the trainer (``model.lora.rank > 0``, docs/lora.md).

The parameters are ``{"base": the model's weights, "lora": the adapters}``; every base weight
is frozen (stored once in the compute dtype: no master copy, optimizer state or gradient) and
the adapters train. The engine differentiates the ``zf.lora`` loss of the trainer's own loss,
so the model is unchanged; sampling and export read ``merged`` weights.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp

from zeroflow.config.schema import LoraConfig
from zeroflow.engine import quantized
from zeroflow.lora import LoRA, Site, lora
from zeroflow.util.tree import path_str

BASE, ADAPTERS = "base", "lora"
"The two top-level keys of a LoRA run's parameters (those of ``LoRA.loss``)."
LORA_STREAM = 2
"Folded into the seed's key for the adapters' initialisation, apart from the model's."


def make_lora(loss_fn, lora_cfg: LoraConfig, base_shapes) -> LoRA | None:
    """The ``zf.lora`` of ``loss_fn`` for ``model.lora`` (None when the rank is 0). Targets
    that match no parameter are one ValueError listing the parameter paths."""
    if lora_cfg.rank == 0:
        return None
    paths = [path_str(p) for p, _ in jax.tree_util.tree_leaves_with_path(base_shapes)]
    if not any(re.search(lora_cfg.targets, p) for p in paths):
        raise ValueError(
            f"model.lora.targets={lora_cfg.targets!r} matches no parameter; the "
            f"model's parameters are {', '.join(paths)}"
        )
    return lora(
        loss_fn,
        rank=lora_cfg.rank,
        alpha=lora_cfg.alpha,
        targets=lora_cfg.targets,
        dropout=lora_cfg.dropout,
    )


def base_rules(rules):
    """The model's tensor-parallel rules (exact paths, ``^...$``) for its weights under
    ``base/``; the adapters, a few per cent of the parameters, stay replicated over ``model``."""
    prefix = "^" + re.escape(BASE + "/")
    return [(prefix + pattern.removeprefix("^"), spec) for pattern, spec in rules]


def trains_adapters(path: str, _leaf) -> bool:
    """``trainable=`` of a LoRA run: the adapters train, the base weights are frozen."""
    return path.split("/", 1)[0] == ADAPTERS


def adapter_sites(lo: LoRA, base_shapes, batch_shapes, compute_dtype) -> dict[str, Site]:
    """Where each targeted weight is read (found by tracing the loss on shapes, once per
    run); a matched weight the adapters cannot go on is a ValueError naming it. The base is
    traced at ``compute_dtype``, the dtype the step's loss reads it in: a loss that checks
    its operands' dtype (cuDNN attention takes bf16/fp16 only) sees what the step gives it."""
    return lo.sites(compute_shapes(base_shapes, compute_dtype), batch_shapes)


def compute_shapes(shapes, dtype):
    """``shapes`` with every floating-point leaf at ``dtype`` (the others as they are)."""

    def cast(leaf):
        if not jnp.issubdtype(leaf.dtype, jnp.floating):
            return leaf
        return jax.ShapeDtypeStruct(leaf.shape, dtype, sharding=getattr(leaf, "sharding", None))

    return jax.tree.map(cast, shapes)


def init_adapters(lo: LoRA, sites: dict[str, Site], seed: int):
    """Fresh adapters (``a`` Kaiming-uniform, ``b`` zero) from the run's seed; traceable, so
    ``init_train_state`` can create them directly in their shards."""
    return lo.init_at(jax.random.fold_in(jax.random.key(seed), LORA_STREAM), sites)


def merged(lo: LoRA | None, params):
    """The model's weights: ``params`` as they are without LoRA, else the base (dequantized
    first when it is quantized) with the adapters folded in (``W + alpha / r * a b``)."""
    if lo is None:
        return params
    return lo.merge(quantized.dequantized(params[BASE]), params[ADAPTERS])


def banner(lo: LoRA, trained: int, frozen: int, quantize: str = "none") -> str:
    stored = "" if quantize == "none" else f" ({quantize})"
    return f"LoRA r={lo.rank}, {trained:,} adapter params trained, {frozen:,} frozen{stored}"
