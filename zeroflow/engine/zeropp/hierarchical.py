"""hpZ: the stage-3 compute weights as a secondary copy sharded within each host.

Plain stage 3 keeps the compute-dtype weights 1/N on each of N devices, so every forward and
backward gather reaches every host. With ``ZeroPlan(hierarchical=True)`` on H hosts of L
devices each, ``TrainState.compute`` instead holds one whole copy per host, split over that
host's L devices: stored as a global array with the weight repeated H times along its ZeRO
dimension and that dimension split over ``data``, device ``(host h, local index l)`` holds
piece ``l`` of L of host ``h``'s copy. Each gather is then an all-gather among one host's
devices (``axis_index_groups``: ``HostSplit.within``). The fp32 master, the optimizer state
and the gradient reduce-scatter stay 1/N over all devices, as plain stage 3's.

The copy costs 2 bytes x parameters / L per device in place of stage 3's 2 / N. It is derived
from the master: checkpoints leave it out (as they leave out any compute copy), and it is
rebuilt from the master after every update (``refresh``), on init and on restore (``tile``).

Refreshing: device ``p`` holds piece ``p`` of N of the updated bf16 weight; piece ``l`` of L
(what device ``(h, l)`` needs on every host) is pieces ``l*H ... l*H + H-1`` of N. A device
permutation moves piece ``p`` to device ``(p mod H, p div H)``; then the devices with local
index ``l``, one per host, all-gather their pieces (``HostSplit.across``). That is the only
weight traffic across hosts: about 1/L of a bf16 weight copy per device and step, where plain
stage 3 moves three gathers' worth (forward, backward, and the next forward).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from zeroflow.backend.mesh import zero_axes
from zeroflow.engine.hosts import HostSplit, index_groups
from zeroflow.engine.padding import Entry
from zeroflow.engine.plan import ZeroPlan, is_layout


def copy_entries(layouts) -> tuple[Entry, ...]:
    """The padding entries of the secondary copy (flatten order of ``layouts``): every split leaf
    is stored longer than its own size along its ZeRO dimension (H copies, each padded), so
    ``zeroflow.engine.padding.unpad`` cuts it back to the first copy's own entries."""
    return tuple(
        None if lay.zero_dim is None else (lay.zero_dim, lay.shape[lay.zero_dim])
        for lay in jax.tree.leaves(layouts, is_leaf=is_layout)
    )


def tile(tree, entries: tuple[Entry, ...], copies: int):
    """Each split leaf of ``tree`` (stored padded, global arrays) repeated ``copies`` times along
    its ZeRO dimension: the secondary copy's global form, for init and restore (jit it with the
    state's shardings; the step refreshes with ``refresh`` instead)."""
    if copies == 1:
        return tree
    leaves, treedef = jax.tree.flatten(tree)
    return jax.tree.unflatten(
        treedef,
        [
            x if e is None else jnp.concatenate([x] * copies, axis=e[0])
            for x, e in zip(leaves, entries)
        ],
    )


def _regrouped(piece, dim: int, split: HostSplit):
    """Inside shard_map over ``data``: this device's piece of the secondary copy from every
    device's 1/N piece (the permutation, then the gather across hosts)."""
    hosts, local = split
    moves = [(p, (p % hosts) * local + p // hosts) for p in range(hosts * local)]
    piece = jax.lax.ppermute(piece, zero_axes(), moves)
    return jax.lax.all_gather(
        piece, zero_axes(), axis=dim, tiled=True, axis_index_groups=index_groups(split.across)
    )


def refresh(compute, layouts, plan: ZeroPlan):
    """The secondary copy from ``compute``, the updated compute weights stored 1/N over
    ``data`` (padded, as ``plan`` stores stage-3 weights); ``layouts``: every parameter's,
    frozen ones included."""
    split = plan.host_split
    # ``compute`` holds the trained leaves only: frozen ones are never refreshed (their copy
    # per host is made once, ``zeroflow.engine.state.stored_frozen``)
    lays = [lay for lay in jax.tree.leaves(layouts, is_leaf=is_layout) if lay.trains]
    leaves, treedef = jax.tree.flatten(compute)
    specs = [lay.data_only_spec(True) for lay in lays]

    def regroup(pieces):
        return [
            x if lay.zero_dim is None else _regrouped(x, lay.zero_dim, split)
            for x, lay in zip(pieces, lays)
        ]

    manual = plan.manual_axes
    out = jax.shard_map(
        regroup, mesh=plan.mesh, in_specs=(specs,), out_specs=specs, axis_names=manual
    )(leaves)
    return jax.tree.unflatten(treedef, out)
