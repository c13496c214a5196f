"""The model FLOPs an MFU counts: one count for the trainer's reports and the planner alike.

A matmul weight of ``n`` elements costs per token ``2n`` in the forward pass, ``2n`` for its
own gradient when it trains, and ``2n`` for its input's gradient when something before it
trains (the backward pass must go through it). Full training is therefore the usual
``6 * N`` (Kaplan et al. 2020; PaLM, Chowdhery et al. 2022, appendix B); a frozen weight under
LoRA adapters or ``train.freeze`` costs ``4n``, and only ``2n`` where nothing before it trains
(a head trained on a frozen body). LoRA's adapters on a weight with ``in`` inputs and ``out``
outputs hold ``rank * (in + out)`` elements and cost ``6`` each: two matmuls, both trained.

The matmul weights are read from the model's own abstract parameters (``kernel`` of every
projection, ``blocks`` of a block-sparse one: its kept fraction only) plus the output (logits)
projection, tied or not; the input embedding is a gather and the norms are negligible, so
neither counts. Attention's scores and weighted values add ``4 * heads * head_dim * seq_len``
per layer and token forward, three times that when the backward pass goes through the layers:
the full seq x seq matrix (causal masking and sliding windows not subtracted) and no remat
recomputation, following the usual MFU convention. Where the backward pass enters the layer
stack, every layer counts as reached (a layer's own first weights before anything trains in
it: at most one layer's input gradients too many).
"""

from __future__ import annotations

import dataclasses
import math
import re

import jax

from zeroflow.config.schema import ModelConfig
from zeroflow.models.axes import EMBED, LAYERS, is_axis_names
from zeroflow.models.gpt import LAYER_STACK, abstract_params, head_dim
from zeroflow.util.tree import path_str

MATMUL_LEAVES = ("kernel", "blocks")
"Names of the leaves that are matmul weights (dense projections, block-sparse blocks)."
BEFORE_LAYERS = ("embedding", "position_embedding")
"Top-level parameters read before the layer stack."
STACK = LAYER_STACK + "/"
"Path prefix of the stacked decoder blocks' parameters."
HEAD = "lm_head"
"Path of the untied output projection."


@dataclasses.dataclass(frozen=True)
class MatmulWeight:
    """One matmul weight of the model: its parameter path, its elements (all layers), how
    many layers it is stacked over and, per layer, its inputs plus outputs."""

    path: str
    elements: int
    layers: int
    in_plus_out: int


def flops_per_token(cfg: ModelConfig, freeze: str = "") -> float:
    """Training (forward + backward) FLOPs per token of the GPT of ``cfg`` for an MFU, with
    ``cfg.lora``'s adapters (the base frozen) or ``freeze`` (``train.freeze``'s regex on
    parameter paths) taken into account (see the module doc)."""
    shapes, _ = abstract_params(cfg)
    paths = [path_str(p) for p, _ in jax.tree_util.tree_leaves_with_path(shapes)]
    rank = cfg.lora.rank

    def frozen(path: str) -> bool:
        return rank > 0 or bool(freeze) and re.search(freeze, path) is not None

    def adapted(path: str) -> bool:
        return rank > 0 and re.search(cfg.lora.targets, path) is not None

    def trains(path: str) -> bool:
        return not frozen(path) or adapted(path)

    # Everything but an untied head is read before the logits; the embeddings and the
    # layers themselves before (and in) the layer stack.
    into_head = any(trains(p) for p in paths if p != HEAD)
    into_layers = any(trains(p) for p in paths if p.startswith(STACK) or p in BEFORE_LAYERS)
    total = 0.0
    for w in matmul_weights(cfg):
        reached = into_layers if w.path.startswith(STACK) else into_head
        total += 2.0 * w.elements * (1 + (not frozen(w.path)) + reached)
        if adapted(w.path):
            total += 6.0 * w.layers * rank * w.in_plus_out
    attention = 4.0 * cfg.num_layers * cfg.num_heads * head_dim(cfg) * cfg.seq_len
    return total + attention * (3 if into_layers else 1)


def matmul_weights(cfg: ModelConfig) -> list[MatmulWeight]:
    """The matmul weights of the GPT of ``cfg``, read from its abstract parameters and their
    logical axes: every projection's ``kernel`` (a block-sparse one's kept ``blocks``) and the
    output projection (``lm_head``, or the embedding where tied)."""
    shapes, axes = abstract_params(cfg)
    flat_axes = jax.tree.leaves(axes, is_leaf=is_axis_names)
    out = []
    for (path, leaf), names in zip(
        jax.tree_util.tree_leaves_with_path(shapes), flat_axes, strict=True
    ):
        name = path_str(path)
        is_head = name == HEAD or (cfg.tie_embeddings and name == "embedding")
        if name.rsplit("/", 1)[-1] not in MATMUL_LEAVES and not is_head:
            continue
        stacked = [n for n, axis in zip(leaf.shape, names, strict=True) if axis == LAYERS]
        body = [(n, axis) for n, axis in zip(leaf.shape, names, strict=True) if axis != LAYERS]
        per_layer = math.prod(n for n, _ in body)
        # A projection reads or writes the residual stream (embed): that axis is one side of
        # the matmul, the rest the other.
        side = next((n for n, axis in body if axis == EMBED), body[0][0])
        out.append(
            MatmulWeight(name, math.prod(leaf.shape), math.prod(stacked), side + per_layer // side)
        )
    return out
