"""Host offload primitives: explicit moves between memory kinds, and running a function on the
host inside a jitted step.

Every host<->device move in the engine goes through ``to_memory`` (an explicit
``jax.device_put`` to a sharding of the named memory kind) or ``to_device`` (the same inside a
loop body, where only the memory space changes), so a reader can find each transfer by
searching for them. ``on_host`` runs a function with ``compute_on("device_host")`` (through
``zeroflow.util.compat.host_compute``, whose form changed in jax 0.11): its inputs must already be in
``pinned_host`` memory, and its outputs stay there.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
from jax.sharding import Sharding

from zeroflow.util.compat import host_compute

MEMORY_KINDS = ("device", "pinned_host")


def to_memory(tree, shardings, kind: str):
    """Move every leaf of ``tree`` to ``kind`` memory, keeping the layout ``shardings`` gives.

    ``shardings`` is one sharding for all leaves or a tree of them matching ``tree``; only
    their partitioning is used, the memory kind comes from ``kind``.
    """
    if kind not in MEMORY_KINDS:
        raise ValueError(f"unknown memory kind {kind!r}; choose one of {list(MEMORY_KINDS)}")
    if isinstance(shardings, Sharding):
        return jax.tree.map(lambda x: jax.device_put(x, shardings.with_memory_kind(kind)), tree)
    return jax.tree.map(lambda x, s: jax.device_put(x, s.with_memory_kind(kind)), tree, shardings)


def to_device(tree):
    """Every leaf of ``tree`` in device memory, its sharding unchanged (a no-op for leaves already
    there). Used inside traced code, e.g. on one layer's slice of host-resident weights."""
    return jax.tree.map(lambda x: jax.device_put(x, jax.memory.Space.Device), tree)


def on_host(fn: Callable) -> Callable:
    """``fn`` compiled to run on the host CPU of each device (``compute_on("device_host")``).

    Call it inside a ``jax.jit`` with ``pinned_host`` arrays; its results are ``pinned_host``
    arrays. Inside, the inputs are relabelled to the default memory space before ``fn`` runs:
    jax (0.10) creates every fresh constant (``zeros_like``, ``x.imag`` of a real ``x``, as in
    ``optax.clip_by_global_norm``) in the default space and refuses to mix it with a host-space
    operand, so without the relabel most optax chains fail to trace.
    """

    def relabelled(*args):
        args = jax.tree.map(lambda x: jax.device_put(x, jax.memory.Space.Device), args)
        out = fn(*args)
        return jax.tree.map(lambda x: jax.device_put(x, jax.memory.Space.Host), out)

    return host_compute(relabelled)


def memory_kinds(tree) -> set[str]:
    """The set of memory kinds the array leaves of ``tree`` live in (``None`` leaves skipped)."""
    return {leaf.sharding.memory_kind for leaf in jax.tree.leaves(tree)}
