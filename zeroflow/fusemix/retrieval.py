"""Retrieval evaluation: recall@k from image to text and text to image on held-out pairs.

A query's matches are the candidates of its group: the pair's own partner and any other item
its caption describes identically (the same digit, stroke and slant), since no model can tell
identical descriptions apart. Chance is the recall a random ranking gets, computed exactly.
"""

from __future__ import annotations

from math import comb

import numpy as np

KS = (1, 5, 10)


def first_match(
    similarity: np.ndarray, query_groups: np.ndarray, candidate_groups: np.ndarray
) -> np.ndarray:
    """For each query row, the rank (0-based) of its best-scored matching candidate."""
    order = np.argsort(-similarity, axis=1, kind="stable")
    hits = candidate_groups[order] == query_groups[:, None]
    return hits.argmax(axis=1)


def recall(similarity: np.ndarray, groups: np.ndarray, ks=KS) -> dict[str, float]:
    """``{"i2t_r1": ..., "t2i_r1": ..., ...}`` for ``similarity[image, text]`` of paired rows."""
    out = {}
    for name, sim in (("i2t", similarity), ("t2i", similarity.T)):
        ranks = first_match(sim, groups, groups)
        out.update({f"{name}_r{k}": float((ranks < k).mean()) for k in ks})
    return out


def chance(groups: np.ndarray, ks=KS) -> dict[str, float]:
    """Expected recall@k of a uniformly random ranking (the same both ways)."""
    n = len(groups)
    _, inverse, counts = np.unique(groups, return_inverse=True, return_counts=True)
    sizes = counts[inverse]
    return {f"r{k}": float(np.mean([1 - comb(n - g, k) / comb(n, k) for g in sizes])) for k in ks}
