"""Which optimizer-state leaf belongs to which parameter, read from key paths alone.

optax keeps parameter-shaped state as subtrees keyed like the parameters (``mu["layers"]
["kernel"]``; inside ``optax.multi_transform`` the same, with the other groups' leaves masked
out by ``MaskedNode``). A state leaf mirrors a parameter when its key path ends with that
parameter's key path and its shape is the parameter's. Nothing here asks optax to run an
optimizer on placeholders (``optax.tree_map_params``), which fails where a transform reads
the parameters themselves (a ``multi_transform`` labels function, ``optax.contrib.muon``) or
masks them (``MaskedNode`` beside our own leaf types).
"""

from __future__ import annotations

import jax


def map_mirrored(mirrored, other, opt_state, params, is_leaf=None):
    """``opt_state`` with each leaf ``x`` replaced by ``mirrored(x, p)``, where ``p`` is the
    leaf of ``params`` it mirrors (same shape, key path ending with ``p``'s), or by
    ``other(x)`` (counters, factored moments, anything of another shape). ``params``' leaves
    (found with ``is_leaf``) need a ``shape``."""
    by_path = dict(jax.tree_util.tree_leaves_with_path(params, is_leaf=is_leaf))

    def one(path, x):
        for start in range(len(path) + 1):  # the longest parameter path that ends this one
            p = by_path.get(tuple(path[start:]))
            if p is not None:
                return mirrored(x, p) if tuple(x.shape) == tuple(p.shape) else other(x)
        return other(x)

    return jax.tree_util.tree_map_with_path(one, opt_state)
