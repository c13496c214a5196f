"""The optimizer update on the sharded fp32 state, wherever the plan keeps that state.

Where it runs is one value per step layout, ``UpdatePath`` (chosen by ``update_path``, read by
the step and by the memory estimator alike); how the new compute-dtype weights reach their
stored layout is another, ``ComputeRefresh`` (``compute_refresh``). The mechanisms:

- ``apply``: the optax update where the state already is (device, or host under ``compute_on``);
  a non-finite gradient changes nothing.
- ``streamed``: master weights and optimizer state kept in host memory (``offload``) and updated
  on the device one parameter at a time: each parameter's master and optimizer-state leaves are
  copied in, updated and copied back before the next parameter's update starts, so the device
  holds one parameter's state, not the model's. The optax update is traced once and replayed
  grouped by parameter (the computations that read no offloaded state, such as the global
  gradient norm of ``clip_by_global_norm`` or the step count, run first); a transform that
  mixes several parameters' offloaded state (a norm over the updates, say) cannot be split
  (``streamable``), and ``update_path`` brings its state in whole instead.
- ``reshard_leaf_after_leaf``: reshard leaf after leaf (``Traits.widens_half_precision``).
- ``gather_by_slices``: whole stacked weights gathered one leading-axis slice at a time.
"""

from __future__ import annotations

import dataclasses
import enum
import math

import jax
import jax.numpy as jnp
import optax
from jax.extend.core import Literal

from zeroflow.backend.mesh import zero_axes, zero_axis_names
from zeroflow.engine import offload, opt_mirror, padding
from zeroflow.engine.grads.collectives import all_gather, as_words
from zeroflow.engine.grads.sources import dim_in_layer
from zeroflow.engine.ordering import after
from zeroflow.engine.padding import NO_PADDING, StatePadding
from zeroflow.engine.plan import ZeroPlan
from zeroflow.util import jaxprs


class UpdatePath(enum.Enum):
    """Where the optimizer update runs and how the state reaches it (``update_path``)."""

    IN_PLACE = "in device memory, where the state is"
    """The state lives in device memory (no offload): the optax update reads and writes it
    where it is, into the donated buffers (``apply``)."""

    ON_HOST = "on the host (ZeRO-Offload)"
    """``update_on="host"``: the gradients are copied to pinned host memory and the update runs
    on the host CPU, where the offloaded state is; only the compute-dtype weights come back.
    Chosen whenever the plan asks for it: the device never holds the optimizer state."""

    STREAMED = "on the device, one parameter's offloaded state at a time"
    """Offloaded state, ``update_on="device"``: each parameter's master and optimizer state is
    copied in, updated and copied back before the next one's comes in (``streamed``), so the
    device holds one parameter's state. Chosen where host memory is a memory of its own
    (``Traits.separate_host_memory``: the copies are real) and ``tx``'s update splits by
    parameter (``streamable``)."""

    BROUGHT_IN_WHOLE = "on the device, all offloaded state brought in at once"
    """Offloaded state, ``update_on="device"``, copied to the device all at once and updated
    there (``apply``). Chosen where streaming cannot split or help: ``tx`` mixes several
    parameters' state (a norm over the updates), or host memory is device memory (XLA:CPU: the
    copies cost nothing, and streaming would only order them)."""


class ComputeRefresh(enum.Enum):
    """How the new compute-dtype weights reach the layout they are stored in after the update
    (``compute_refresh``)."""

    AS_MADE = "placed as made"
    """Nothing moves them by hand: there are none (fp32), they are split like the master
    (stage 3), they are made where they are stored (an update on the host or streamed from it),
    or the jit's output shardings place them."""

    LEAF_AFTER_LEAF = "gathered whole, leaf after leaf"
    """Whole weights gathered from the updated shards one leaf after the other, half precision
    moved as integer words (``reshard_leaf_after_leaf``): where the compiler widens
    half-precision collectives (``Traits.widens_half_precision``), which would otherwise gather
    every leaf at once through fp32 temporaries."""

    BY_SLICES = "gathered whole, stacks slice by slice"
    """Whole weights gathered from the updated shards, a stack one leading-axis slice at a time
    into the donated old weights (``gather_by_slices``): an update in device memory on a
    compiler that gathers half precision as it is."""


def update_path(plan: ZeroPlan, tx: optax.GradientTransformation, master) -> UpdatePath:
    """Where the step runs ``tx``'s update of the trainable ``master`` (abstract, the
    parameters' own shapes) under ``plan``: see each ``UpdatePath`` member for when and why."""
    if not plan.offloads:
        return UpdatePath.IN_PLACE
    if plan.updates_on_host:
        return UpdatePath.ON_HOST
    if plan.traits.separate_host_memory and streamable(tx, master):
        return UpdatePath.STREAMED
    return UpdatePath.BROUGHT_IN_WHOLE


def compute_refresh(plan: ZeroPlan, compute_dtype, path: UpdatePath) -> ComputeRefresh:
    """How the step makes the new compute weights whole after an update along ``path``: only
    weights kept as a whole compute copy (stages 0-2 in half precision) are moved by hand, where
    the update made them in device memory."""
    whole_copy = plan.keeps_whole_compute_copy(compute_dtype)
    if not whole_copy or path in (UpdatePath.ON_HOST, UpdatePath.STREAMED):
        return ComputeRefresh.AS_MADE
    if plan.traits.widens_half_precision:
        # (weights stored in host memory are copied out as made, by the step's placement)
        in_device = path is UpdatePath.IN_PLACE or not plan.offloads_params
        return ComputeRefresh.LEAF_AFTER_LEAF if in_device else ComputeRefresh.AS_MADE
    return ComputeRefresh.BY_SLICES if path is UpdatePath.IN_PLACE else ComputeRefresh.AS_MADE


def apply(
    grads,
    master,
    opt_state,
    finite,
    *,
    tx: optax.GradientTransformation,
    compute_dtype,
    compute_shardings=None,
    pads: StatePadding = NO_PADDING,
    skip_by_select: bool = False,
):
    """The update on fp32 arrays; returns ``(new_master, new_opt_state, new_compute)``
    (``new_compute`` None for fp32). ``compute_shardings``: where the new compute weights go,
    when they should be moved there one leaf after the other (``reshard_leaf_after_leaf``;
    ``ComputeRefresh.LEAF_AFTER_LEAF``), else None.
    ``pads``: where the stored arrays (and ``grads``, in the master's form) are padded; the
    optimizer sees them unpadded. ``skip_by_select``: a skipped step (``finite`` false) keeps
    the old values through an elementwise select instead of a ``lax.cond`` (see
    ``Traits.cond_updates_in_place``)."""
    grads, master = padding.unpad(grads, pads.master), padding.unpad(master, pads.master)
    opt_state = padding.unpad(opt_state, pads.opt_state)

    def step(grads, master, opt_state):
        updates, new_opt = tx.update(grads, opt_state, master)
        return optax.apply_updates(master, updates), new_opt

    def keep(grads, master, opt_state):
        return master, opt_state

    if skip_by_select:
        # Fused into each leaf's update, writing into the donated buffer.
        new_master, new_opt = jax.tree.map(
            lambda new, old: jnp.where(finite, new, old),
            step(grads, master, opt_state),
            (master, opt_state),
        )
    else:
        # A cond: the skipped branch is never computed, and XLA:CPU updates the optimizer
        # state in place.
        new_master, new_opt = jax.lax.cond(finite, step, keep, grads, master, opt_state)
    new_compute = (
        None
        if compute_dtype is None
        else padding.pad(
            jax.tree.map(lambda x: x.astype(compute_dtype), new_master),
            pads.compute,
            pads.data_size,
        )
    )
    new_master = padding.pad(new_master, pads.master, pads.data_size)
    new_opt = padding.pad(new_opt, pads.opt_state, pads.data_size)
    if compute_dtype is None:
        return new_master, new_opt, None
    if compute_shardings is not None:
        new_compute = reshard_leaf_after_leaf(new_compute, compute_shardings)
    return new_master, new_opt, new_compute


def reshard_leaf_after_leaf(tree, shardings):
    """``tree`` resharded to ``shardings`` leaf after leaf, each move waiting for the one before
    it, and half-precision leaves moved as integer words (``Traits.widens_half_precision``: XLA:CPU
    would gather them through fp32 temporaries, for every leaf at once)."""
    leaves, treedef = jax.tree.flatten(tree)
    moved, previous = [], None
    for x, s in zip(leaves, treedef.flatten_up_to(shardings)):
        if previous is not None:
            x = after(x, previous)
        previous = as_words(x, lambda w, s=s: jax.lax.with_sharding_constraint(w, s))
        moved.append(previous)
    return jax.tree.unflatten(treedef, moved)


def gather_by_slices(tree, stored_shardings, mesh, into=None):
    """``tree``'s leaves whole on every device, where they are stored split over ``DATA``:
    a stack (3 or more dimensions) split along a dimension other than its first is gathered one
    leading-axis slice at a time, into the whole array in place; other leaves are left to
    ``jit``'s output shardings. ``into``: the previous whole weights (donated; same structure),
    whose buffers the slices overwrite, so that no second whole stack is allocated.

    Why: an all-gather writes each device's part contiguously, so gathering a ``(layers, rows,
    cols)`` stack split by rows in one go produces a buffer laid out rows-major, which XLA:GPU
    then copies into the array's own layout: a second whole copy of the stack (the bf16 weights
    at ZeRO-1/2). One slice at a time, each gathered on a new leading (device) axis, the slice
    is written in the stack's own layout and the temporary is one slice."""

    axes = zero_axes(mesh)
    names = zero_axis_names(mesh)
    size = math.prod(mesh.shape[a] for a in names)

    def one(x, sharding, old):
        split = [(d, entry) for d, entry in enumerate(sharding.spec) if entry]
        if (
            x.ndim < 3
            or len(split) != 1
            or split[0][1] not in (axes, names)
            or split[0][0] == 0
            or x.shape[split[0][0]] % size
        ):
            return x
        dim = split[0][0]
        if old is None or old.shape != x.shape or old.dtype != x.dtype:
            old = jnp.zeros(x.shape, x.dtype)

        def local(shard, whole):
            def body(i, whole):
                piece = jax.lax.dynamic_index_in_dim(shard, i, 0, keepdims=False)
                # (sliced: gathered on a new leading axis, then moved into place as the slice
                # is written; gathered along ``dim`` itself, XLA:GPU would lay the whole stack
                # out with that dimension major and copy it into its own layout at the end)
                piece = all_gather(piece, dim_in_layer(dim), piece.dtype, sliced=True)
                return jax.lax.dynamic_update_index_in_dim(whole, piece, i, 0)

            return jax.lax.fori_loop(0, shard.shape[0], body, whole)

        spec = jax.P(*[axes if d == dim else None for d in range(x.ndim)])
        # check_vma off: jax types an all-gather's result as varying over the ZeRO axes,
        # although every device holds the same whole slice.
        return jax.shard_map(
            local,
            mesh=mesh,
            in_specs=(spec, jax.P()),
            out_specs=jax.P(),
            axis_names=set(names),
            check_vma=False,
        )(x, old)

    olds = jax.tree.leaves(into) if into is not None else [None] * len(jax.tree.leaves(tree))
    return jax.tree.unflatten(
        jax.tree.structure(tree),
        [
            one(x, sh, old)
            for x, sh, old in zip(
                jax.tree.leaves(tree), jax.tree.leaves(stored_shardings), olds, strict=True
            )
        ],
    )


def owners(tx: optax.GradientTransformation, master, opt_state) -> list[int]:
    """For each leaf of ``opt_state``, the index of the parameter it belongs to (-1 for state
    shared by all parameters, such as a step count)."""
    leaves, treedef = jax.tree.flatten(master)
    index = jax.tree.unflatten(treedef, [_Owner(i, x.shape) for i, x in enumerate(leaves)])
    mapped = opt_mirror.map_mirrored(
        lambda _, owner: owner.index,
        lambda _: -1,
        opt_state,
        index,
        is_leaf=lambda x: isinstance(x, _Owner),
    )
    return jax.tree.leaves(mapped)


@dataclasses.dataclass(frozen=True)
class _Owner:
    index: int
    shape: tuple


def streamed(
    grads,
    master,
    opt_state,
    finite,
    *,
    tx: optax.GradientTransformation,
    compute_dtype,
    shardings,
    pads: StatePadding = NO_PADDING,
):
    """The update of host-resident ``master`` / ``opt_state`` on the device, one parameter at a
    time; returns ``(new_master, new_opt_state, new_compute)`` with the state back in host
    memory. ``tx`` must split by parameter (``streamable``; ``update_path`` chooses this path
    only then). ``shardings``: the state's ``TrainState`` of shardings; ``pads`` as for
    ``apply``."""
    n_grads, master_leaves = len(jax.tree.leaves(grads)), jax.tree.leaves(master)
    opt_leaves = jax.tree.leaves(opt_state)
    entries, groups, closed, out_shape, grouping = _update_by_parameter(
        tx, grads, master, opt_state, pads
    )
    stored = jax.tree.leaves(grads) + master_leaves + opt_leaves
    host_shardings = jax.tree.leaves(shardings.master) + jax.tree.leaves(shardings.opt_state)

    def repad(x, e):
        return (
            x if e is None else padding.pad_to(x, e[0], -(-e[1] // pads.data_size) * pads.data_size)
        )

    def fetch(k, tie):
        """Input ``k`` on the device in its own shape: grads are there; offloaded state is
        copied in once ``tie`` (the previous parameter's results, back in host memory) is
        there: XLA:GPU would otherwise start every copy in at once, and copy every result out
        at the end of the step, holding the whole state on the device."""
        value = stored[k]
        if k >= n_grads:
            if tie is not None:
                value = jax.lax.optimization_barrier((value, tie))[0]
            value = offload.to_memory(value, host_shardings[k - n_grads], "device")
        return value if entries[k] is None else padding.cut_to(value, *entries[k])

    def send(k, value):
        """Output ``k`` back to host memory, in the state's sharding, padded as stored."""
        return offload.to_memory(
            repad(value, entries[n_grads + k]), host_shardings[k], "pinned_host"
        )

    outs, back = _replay_by_parameter(
        closed, groups, grouping, fetch, send, finite, n_grads=n_grads, n_params=len(master_leaves)
    )
    n_master = len(master_leaves)
    new_compute = (
        None
        if compute_dtype is None
        else [
            repad(x.astype(compute_dtype), e)
            for x, e in zip(outs[:n_master], pads.compute or [None] * n_master)
        ]
    )
    master_tree, opt_tree = out_shape
    new_master = jax.tree.unflatten(jax.tree.structure(master_tree), back[:n_master])
    new_opt = jax.tree.unflatten(jax.tree.structure(opt_tree), back[n_master:])
    if new_compute is not None:
        new_compute = jax.tree.unflatten(jax.tree.structure(master_tree), new_compute)
    return new_master, new_opt, new_compute


def _update_by_parameter(
    tx: optax.GradientTransformation, grads, master, opt_state, pads: StatePadding
):
    """What ``streamed`` replays: ``(entries, groups, closed, out_shape, grouping)``, where
    ``entries`` says where each input leaf (grads, master, opt state, flattened in that order;
    grads in the master's form) is padded, ``groups`` the parameter each input belongs to (-1:
    shared), ``closed`` / ``out_shape`` the update's jaxpr on the unpadded shapes and its
    output trees, ``grouping`` its equations by parameter (``_grouping``). One readable line
    where the update mixes parameters."""
    n_grads, master_leaves = len(jax.tree.leaves(grads)), jax.tree.leaves(master)
    opt_leaves = jax.tree.leaves(opt_state)
    # Where each input leaf is padded (grads are in the master's form), to cut and re-pad it.
    entries = (
        list(pads.master or [None] * n_grads)
        + list(pads.master or [None] * len(master_leaves))
        + list(pads.opt_state or [None] * len(opt_leaves))
    )

    def own(tree, es):
        return jax.tree.unflatten(
            jax.tree.structure(tree),
            [
                jax.ShapeDtypeStruct(_own_shape(x.shape, e), x.dtype)
                for x, e in zip(jax.tree.leaves(tree), es)
            ],
        )

    groups = (
        [-1] * n_grads
        + list(range(len(master_leaves)))
        + owners(
            tx,
            own(master, entries[n_grads : n_grads + len(master_leaves)]),
            own(opt_state, entries[n_grads + len(master_leaves) :]),
        )
    )

    closed, out_shape = _step_jaxpr(
        tx,
        own(grads, entries[:n_grads]),
        own(master, entries[n_grads : n_grads + len(master_leaves)]),
        own(opt_state, entries[n_grads + len(master_leaves) :]),
    )
    grouping = _grouping(closed.jaxpr, groups, n_grads)
    if grouping is None:
        raise ValueError(
            "this optimizer's update mixes several parameters' state (a norm over "
            "the updates, say), so it cannot run one parameter at a time; "
            "update_path brings such state in whole (UpdatePath.BROUGHT_IN_WHOLE)"
        )
    return entries, groups, closed, out_shape, grouping


def _replay_by_parameter(
    closed, groups: list[int], grouping, fetch, send, finite, *, n_grads: int, n_params: int
) -> tuple[list, list]:
    """The update's outputs on the device and as sent (``send(k, value)``, as soon as a group
    has made them), its jaxpr replayed one group at a time (``_grouping``: the shared
    computations first, then parameter after parameter). A group's inputs are fetched when its
    turn comes (``fetch(k, tie)``, ``tie`` the previous parameter's sent results); an output
    keeps its input's value where the step is not ``finite``."""
    jaxpr = closed.jaxpr
    eqn_group, out_group = grouping
    env = dict(zip(jaxpr.constvars, closed.consts))
    fetched: dict = {}

    def read(atom):
        return atom.val if isinstance(atom, Literal) else env[atom]

    outs: list = [None] * len(jaxpr.outvars)
    sent: list = [None] * len(jaxpr.outvars)
    previous = None
    for group in [-1] + list(range(n_params)):
        tie = previous if group >= 0 else None
        for k, var in enumerate(jaxpr.invars):
            if groups[k] == group:
                fetched[k] = env[var] = fetch(k, tie)
        for eqn in (e for e, g in zip(jaxpr.eqns, eqn_group) if g == group):
            for var, value in zip(eqn.outvars, jaxprs.bind(eqn, [read(a) for a in eqn.invars])):
                env[var] = value
        results = []
        for k, var in enumerate(jaxpr.outvars):
            if out_group[k] != group:
                continue
            before = fetched.get(n_grads + k)  # the output's own input (same tree position)
            new = read(var)
            outs[k] = new if before is None else jnp.where(finite, new, before)
            sent[k] = send(k, outs[k])
            results.append(sent[k])
        previous = results or previous
    return outs, sent


def _own_shape(shape, entry):
    return (
        tuple(shape)
        if entry is None
        else tuple(entry[1] if d == entry[0] else s for d, s in enumerate(shape))
    )


def _step_jaxpr(tx, grads, master, opt_state):
    def step(grads, master, opt_state):
        updates, new_opt = tx.update(grads, opt_state, master)
        return optax.apply_updates(master, updates), new_opt

    on_device = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype)  # noqa: E731
    closed, out_shape = jax.make_jaxpr(step, return_shape=True)(
        grads, jax.tree.map(on_device, master), jax.tree.map(on_device, opt_state)
    )
    # Calls opened, so that each equation reads the values it computes with: jax >= 0.11 keeps
    # optax's jit(inline=True) bias correction as one call reading every parameter's moment.
    return jaxprs.inline_calls(closed), out_shape


def streamable(tx: optax.GradientTransformation, master) -> bool:
    """Whether ``streamed`` can update ``tx``'s state one parameter at a time."""
    opt_state = jax.eval_shape(tx.init, master)
    n = len(jax.tree.leaves(master))
    closed, _ = _step_jaxpr(tx, master, master, opt_state)
    return (
        _grouping(closed.jaxpr, [-1] * n + list(range(n)) + owners(tx, master, opt_state), n)
        is not None
    )


def _grouping(jaxpr, groups: list[int], n_grads: int):
    """The parameter each equation and each output belongs to (-1: none, computed first), from
    which offloaded inputs they read; None when an equation reads two parameters' state."""
    owner = {
        var: g
        for var, g, k in zip(jaxpr.invars, groups, range(len(groups)))
        if k >= n_grads and g >= 0
    }
    eqn_group = []
    for eqn in jaxpr.eqns:
        found = {owner[a] for a in eqn.invars if not isinstance(a, Literal) and a in owner}
        if len(found) > 1:
            return None
        group = found.pop() if found else -1
        eqn_group.append(group)
        for var in eqn.outvars:
            if group >= 0:
                owner[var] = group
    out_group = [owner.get(v, -1) if not isinstance(v, Literal) else -1 for v in jaxpr.outvars]
    return eqn_group, out_group
