"""Remember what tracing a loss found, per loss function and abstract inputs.

A memory plan estimates dozens of choices (ZeRO stage x offload x remat) of one model; each
traces the model's loss to find its activation residuals, and the trace does not depend on
the stage or the offload. Tracing takes about half a second for even a tiny GPT, so the plan
of ``configs/tiny.yaml`` spent most of a minute tracing the same three losses again and again.
"""

from __future__ import annotations

import functools
from collections import OrderedDict
from collections.abc import Callable

import jax
import numpy as np

from zeroflow import backend

MAX_ENTRIES = 64


def _abstract(tree) -> tuple:
    leaves, treedef = jax.tree.flatten(tree)
    return treedef, tuple(
        (tuple(np.shape(x)), str(getattr(x, "dtype", type(x))), getattr(x, "sharding", None))
        for x in leaves
    )


_SCALARS = (str, int, float, bool, type(None))


def _option(value):
    if isinstance(value, _SCALARS):
        return value
    if isinstance(value, tuple) and all(isinstance(v, _SCALARS) for v in value):
        return value  # e.g. a flat trainable mask: its values, not just its shape, matter
    return _abstract(value)


def remembered(trace: Callable[..., list]) -> Callable[..., list]:
    """``trace(loss_fn, *trees, **options) -> list``, kept per loss function (by identity),
    the trees' shapes, dtypes and shardings, the options and the backend traced for; a fresh
    list is returned each call."""
    cache: OrderedDict = OrderedDict()

    @functools.wraps(trace)
    def wrapper(loss_fn, *trees, **options):
        try:
            key = (
                loss_fn,
                tuple(_abstract(t) for t in trees),
                tuple(sorted((k, _option(v)) for k, v in options.items())),
                backend.current(),
            )
            hash(key)
        except TypeError:  # something unhashable: trace as usual
            return trace(loss_fn, *trees, **options)
        if key not in cache:
            cache[key] = trace(loss_fn, *trees, **options)
            while len(cache) > MAX_ENTRIES:
                cache.popitem(last=False)
        return list(cache[key])

    return wrapper
