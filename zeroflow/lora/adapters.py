"""Adapter factors: their layout, their initialisation, and folding them into the weights.

A weight ``W`` read by matmuls that contract its axes ``I`` (the *input* axes) and keep the
others (the *output* axes) gets two factors, laid out like ``W`` so that nothing else is
needed to tell which axis is which:

- ``a``: ``W``'s shape with every output axis set to 1, and a trailing rank axis;
- ``b``: ``W``'s shape with every input axis set to 1, and a trailing rank axis.

Leading stacked (layer) axes, which a scan takes one index at a time, are kept whole in both
(one adapter per layer). For a plain ``[in, out]`` kernel that is ``a [in, 1, r]`` and
``b [1, out, r]`` (peft's ``lora_A`` and ``lora_B`` are ``a`` transposed and ``b`` as it is);
for a stack of them ``a [layers, in, 1, r]``, ``b [layers, 1, out, r]``. The update to the
weight is ``(alpha / r) * sum_r a[..., r] * b[..., r]``, which has ``W``'s shape by
broadcasting.

The adapters form a tree of nested dicts along the parameter's path (``layers/attn/query/
kernel`` -> ``adapters["layers"]["attn"]["query"]["kernel"] = {"a": ..., "b": ...}``).
"""

from __future__ import annotations

import dataclasses
import math
import string

import jax
import jax.numpy as jnp

from zeroflow.util.tree import path_str


@dataclasses.dataclass(frozen=True)
class Site:
    """Where a weight is adapted: its path and shape, how many leading axes are stacked
    layers, and which of its axes the matmuls contract."""

    path: str
    shape: tuple[int, ...]
    stack: int
    inputs: tuple[int, ...]

    def factor_shapes(self, rank: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
        body = range(self.stack, len(self.shape))
        a = [self.shape[k] if k in self.inputs else 1 for k in body]
        b = [1 if k in self.inputs else self.shape[k] for k in body]
        lead = self.shape[: self.stack]
        return (*lead, *a, rank), (*lead, *b, rank)

    @property
    def fan_in(self) -> int:
        return math.prod(self.shape[k] for k in self.inputs)


def nest(flat: dict[str, object]) -> dict:
    """``{"x/y": v}`` -> ``{"x": {"y": v}}``."""
    out: dict = {}
    for path, value in flat.items():
        node = out
        *parents, last = path.split("/")
        for key in parents:
            node = node.setdefault(key, {})
        node[last] = value
    return out


def flatten(adapters) -> dict[str, dict]:
    """The adapter tree as ``{parameter path: {"a": ..., "b": ...}}``."""
    out: dict[str, dict] = {}
    for path, leaf in jax.tree_util.tree_leaves_with_path(adapters):
        key = path_str(path)
        parent, _, name = key.rpartition("/")
        if name not in ("a", "b") or not parent:
            raise ValueError(
                f"adapter leaf {key!r} is not an 'a' or 'b' factor; adapters are "
                "the tree that LoRA.init returns"
            )
        out.setdefault(parent, {})[name] = leaf
    for parent, pair in out.items():
        if set(pair) != {"a", "b"}:
            raise ValueError(f"adapter {parent!r} has {sorted(pair)}; it needs both 'a' and 'b'")
    return out


def init_factors(site: Site, rank: int, key, dtype=jnp.float32) -> dict:
    """``a`` uniform in ``+-1/sqrt(fan_in)`` (peft's default, Kaiming-uniform with
    ``a=sqrt(5)``, as torch initialises a Linear layer), ``b`` zero: the adapted model starts
    as the base model (LoRA paper, section 4.1)."""
    a_shape, b_shape = site.factor_shapes(rank)
    bound = 1.0 / math.sqrt(site.fan_in)
    return {
        "a": jax.random.uniform(key, a_shape, dtype, -bound, bound),
        "b": jnp.zeros(b_shape, dtype),
    }


def update(weight_shape, a, b, scale: float):
    """``scale * sum_r a[..., r] * b[..., r]`` in fp32, with ``weight_shape``: an axis that
    only ``a`` holds is an input axis, one only ``b`` holds an output axis, one both hold a
    stacked (layer) axis."""
    weight_shape = tuple(weight_shape)
    if len(a.shape) != len(weight_shape) + 1 or len(b.shape) != len(a.shape):
        raise ValueError(
            f"factors a {tuple(a.shape)} and b {tuple(b.shape)} do not fit a "
            f"weight of shape {weight_shape}"
        )
    letters = iter(string.ascii_letters)
    a_sub, b_sub, out_sub = [], [], []
    for n, x, y in zip(weight_shape, a.shape[:-1], b.shape[:-1]):
        if n == 1 and (x, y) == (1, 1):
            continue
        if n == 1 or (x, y) not in ((n, n), (n, 1), (1, n)):
            raise ValueError(
                f"factors a {tuple(a.shape)} and b {tuple(b.shape)} do not fit "
                f"a weight of shape {weight_shape}"
            )
        c = next(letters)
        a_sub += [c] if x == n else []
        b_sub += [c] if y == n else []
        out_sub.append(c)
    r = next(letters)
    a = jnp.asarray(a, jnp.float32).reshape([n for n in a.shape[:-1] if n != 1] + [a.shape[-1]])
    b = jnp.asarray(b, jnp.float32).reshape([n for n in b.shape[:-1] if n != 1] + [b.shape[-1]])
    delta = jnp.einsum(f"{''.join(a_sub)}{r},{''.join(b_sub)}{r}->{''.join(out_sub)}", a, b)
    return (scale * delta).reshape(weight_shape)
