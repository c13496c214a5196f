"""Tensor-parallel placement of the GPT's parameters, by logical axis name.

The short rules table: attention heads and the MLP hidden width are split over ``model``
(column-parallel in, row-parallel out: ``out`` and ``down`` have heads/mlp as their *input*
dimension), and the vocabulary is split over ``model`` (vocab-parallel embedding). Everything
else is replicated over ``model``; ZeRO shards it over ``data``.
"""

from __future__ import annotations

import re

import jax
from jax.sharding import PartitionSpec as P

from zeroflow.backend.mesh import MODEL
from zeroflow.config.schema import ModelConfig
from zeroflow.models import axes
from zeroflow.models.gpt import abstract_params
from zeroflow.util.tree import path_str

LOGICAL_TO_MESH = {axes.HEADS: MODEL, axes.KV_HEADS: MODEL, axes.MLP: MODEL, axes.VOCAB: MODEL}


def gpt_tensor_rules(cfg: ModelConfig, model_size: int | None = None) -> list[tuple[str, P]]:
    """``ZeroPlan(tensor_rules=...)`` for the GPT: one exact-path rule per parameter.

    A dimension whose size does not divide by ``model_size`` (say a single KV head) stays
    replicated rather than failing.
    """
    shapes, names = abstract_params(cfg)
    rules = []
    for (path, leaf), leaf_names in zip(
        jax.tree_util.tree_leaves_with_path(shapes),
        jax.tree.leaves(names, is_leaf=axes.is_axis_names),
    ):
        spec = []
        for size, name in zip(leaf.shape, leaf_names):
            axis = LOGICAL_TO_MESH.get(name)
            spec.append(axis if axis and (model_size is None or size % model_size == 0) else None)
        if any(spec):
            rules.append(("^" + re.escape(path_str(path)) + "$", P(*spec)))
    return rules
