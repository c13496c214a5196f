"""Checkpoints that load onto any mesh, ZeRO stage, offload or precision.

What is saved is the *portable* part of a TrainState: step, updates applied, fp32 master
weights, optimizer state, loss scale, model state, the FP8 amax histories (delayed scaling,
``zeroflow.engine.fp8_state``), the rng's key data and the frozen weights
(``zeroflow.engine.frozen``, in their compute dtype), each as a global array in its own (unpadded)
shape. A checkpoint restores only onto a state with the same trainable/frozen split. The compute-dtype copy is not saved: it is a cast of the
master weights and is rebuilt on restore. Restoring reads every array straight into the
sharding that ``like`` (a state built on the target plan, or its abstract shapes) asks for, so a
checkpoint written at ZeRO-3 on (8, 1) loads at ZeRO-1 on (4, 2) or on one device.

ZeRO padding (``zeroflow.engine.padding``) is never saved: a padded leaf is cut to its own shape for
the save (which holds that leaf whole on each device for the moment of the save) and restored
straight into its padded, sharded form (Orbax pads it with zeros as it reads).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp

from zeroflow.engine import checkpoint_digests, fp8_state, padding
from zeroflow.engine.state import TrainState, stored_frozen
from zeroflow.engine.zeropp import hierarchical
from zeroflow.util.tree import path_str

log = logging.getLogger("zeroflow")


class CheckpointError(ValueError):
    """A checkpoint that is missing, unreadable or does not fit the target state."""


OPTIONAL = ("applied", "rng", "loss_scale", "fp8")
"""Saved entries a restore can do without (older checkpoints, another precision or no dropout);
without ``fp8`` a run with delayed FP8 scaling starts its amax histories afresh."""


def _counters(state: TrainState) -> dict[str, Any]:
    """The entries saved as the state holds them: step, updates applied, the loss scale, the
    model state and the FP8 state (``state`` may be abstract)."""
    out: dict[str, Any] = {"step": state.step, "applied": state.applied}
    if state.loss_scale is not None:
        ls = state.loss_scale
        out["loss_scale"] = {"scale": ls.scale, "good_steps": ls.good_steps, "skips": ls.skips}
    if state.model_state is not None:
        out["model_state"] = state.model_state
    if jax.tree.leaves(state.fp8):  # none without delayed scaling, or without FP8 matmuls
        out["fp8"] = state.fp8
    return out


def portable(state: TrainState) -> dict[str, Any]:
    """The saved part of a state, unpadded; the compute copy is derived, so it is left out."""
    out = {
        **_counters(state),
        "master": state.master_params,
        "opt_state": padding.unpad(state.opt_state, state.padding.opt_state),
    }
    if state.rng is not None:
        out["rng"] = jax.random.key_data(state.rng)
    if state.frozen is not None:
        out["frozen"] = state.frozen_params
    return out


def _stored_target(like: TrainState) -> dict[str, Any]:
    """What Orbax reads into: ``portable``'s entries, with master and optimizer state in their
    stored (padded) shapes and shardings. ``like`` may be abstract (ShapeDtypeStructs)."""
    target = {**_counters(like), "master": like.master, "opt_state": like.opt_state}
    if like.rng is not None:
        data = jax.eval_shape(jax.random.key_data, like.rng)
        target["rng"] = jax.ShapeDtypeStruct(
            data.shape, data.dtype, sharding=getattr(like.rng, "sharding", None)
        )
    if like.frozen is not None:
        target["frozen"] = like.frozen
    return target


def _abstract_on_device(tree):
    """Restore targets: shape, dtype and sharding, read into device memory (offloaded arrays
    are moved to the host afterwards with an explicit transfer)."""

    def one(x):
        sharding = getattr(x, "sharding", None)
        if sharding is not None and getattr(sharding, "memory_kind", None) not in (None, "device"):
            sharding = sharding.with_memory_kind("device")
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)

    return jax.tree.map(one, tree)


def _leaf_table(tree) -> dict[str, tuple]:
    return {
        path_str(p): tuple(getattr(x, "shape", ()))
        for p, x in jax.tree_util.tree_leaves_with_path(tree)
    }


def _split_of(table: dict[str, tuple]) -> tuple[set, set]:
    """The parameter paths a leaf table holds as master weights and as frozen weights."""

    def under(prefix):
        return {k[len(prefix) :] for k in table if k.startswith(prefix)}

    return under("master/"), under("frozen/")


def check_same_split(saved_meta, target, where: str) -> None:
    """One line naming the parameters a checkpoint froze that the target trains (or the other
    way round): its master weights and optimizer state cover other leaves."""
    (saved_train, saved_frozen), (want_train, want_frozen) = (
        _split_of(_leaf_table(saved_meta)),
        _split_of(_leaf_table(target)),
    )
    if saved_train | saved_frozen != want_train | want_frozen:
        return  # other parameters altogether: check_compatible names them
    now_trained, now_frozen = sorted(saved_frozen & want_train), sorted(saved_train & want_frozen)
    if now_trained or now_frozen:
        parts = [
            f"{label}: {', '.join(paths[:4])}" + (" ..." if len(paths) > 4 else "")
            for label, paths in (
                ("frozen there, trainable here", now_trained),
                ("trainable there, frozen here", now_frozen),
            )
            if paths
        ]
        raise CheckpointError(
            f"checkpoint {where} was saved with another trainable/frozen "
            f"split than the target state's (init_train_state(trainable=...)): " + "; ".join(parts)
        )


def check_compatible(saved_meta, target, where: str) -> None:
    """One readable line naming what differs between a checkpoint and the target state."""
    check_same_split(saved_meta, target, where)
    saved, want = _leaf_table(saved_meta), _leaf_table(target)
    missing = sorted(set(want) - set(saved))
    extra = sorted(set(saved) - set(want))
    shapes = sorted(k for k in set(saved) & set(want) if saved[k] != want[k])
    if missing or extra or shapes:
        parts = []
        if missing:
            parts.append(
                f"missing in checkpoint: {', '.join(missing[:4])}"
                + (" ..." if len(missing) > 4 else "")
            )
        if extra:
            parts.append(
                f"not in target: {', '.join(extra[:4])}" + (" ..." if len(extra) > 4 else "")
            )
        if shapes:
            k = shapes[0]
            parts.append(
                f"shape of {k} is {saved[k]} in checkpoint, {want[k]} in target"
                + (f" (+{len(shapes) - 1} more)" if len(shapes) > 1 else "")
            )
        raise CheckpointError(
            f"checkpoint {where} does not match the target state: " + "; ".join(parts)
        )


def rebuild_state(restored: dict[str, Any], like: TrainState) -> TrainState:
    """A TrainState on ``like``'s shardings (memory kinds included) from restored arrays (master
    and optimizer state already in their stored, padded shapes)."""

    def place(x, target):
        sharding = getattr(target, "sharding", None)
        return jax.device_put(x, sharding) if sharding is not None else x

    master = jax.tree.map(place, restored["master"], like.master)
    opt_state = jax.tree.map(place, restored["opt_state"], like.opt_state)
    compute = None
    if like.compute is not None:
        pads = like.padding
        cast = jax.tree.map(
            lambda m, t: m.astype(t.dtype), padding.unpad(master, pads.master), like.compute
        )
        compute = jax.tree.map(
            place,
            hierarchical.tile(
                padding.pad(cast, pads.compute, pads.data_size), pads.compute, pads.compute_copies
            ),
            like.compute,
        )
    step = place(restored["step"], like.step)
    # A checkpoint from before updates were counted apart from steps: assume none was skipped.
    applied = place(
        restored["applied"] if "applied" in restored else restored["step"], like.applied
    )
    frozen = None
    if like.frozen is not None:
        frozen = restored["frozen"]
        if like.padding.compute_copies > 1:  # hpZ: one copy per host, read as the first only
            frozen = stored_frozen(padding.unpad(frozen, like.padding.frozen), like.padding)
        frozen = jax.tree.map(place, frozen, like.frozen)
    return TrainState(
        step=step,
        applied=applied,
        master=master,
        compute=compute,
        opt_state=opt_state,
        loss_scale=_loss_scale(restored, like, place),
        model_state=None
        if like.model_state is None
        else jax.tree.map(place, restored["model_state"], like.model_state),
        rng=_rng(restored, like),
        frozen=frozen,
        fp8=_fp8(restored, like, place),
        padding=like.padding,
    )


def _loss_scale(restored, like: TrainState, place):
    """The saved dynamic scale; a static scale is always the configured one (``like``'s)."""
    ls = like.loss_scale
    if ls is None or not ls.dynamic or "loss_scale" not in restored:
        return ls
    saved = restored["loss_scale"]
    return type(ls)(
        scale=place(saved["scale"], ls.scale),
        good_steps=place(saved["good_steps"], ls.good_steps),
        skips=place(saved["skips"], ls.skips) if "skips" in saved else ls.skips,
        dynamic=True,
    )


def _fp8(restored, like: TrainState, place):
    """The saved amax histories; a checkpoint without them (saved under current scaling), or
    with those of other matmul sites (``_other_sites``), resumes delayed scaling from a first
    step's state."""
    if like.fp8 is None or not jax.tree.leaves(like.fp8):
        return like.fp8
    if "fp8" not in restored:
        return fp8_state.fresh_like(like.fp8)
    if _other_sites(restored["fp8"], like.fp8):
        log.warning(
            "the checkpoint's FP8 amax histories are of other matmul sites or history lengths "
            "than this step's (it was traced another way, e.g. by another stage-3 gather route, "
            "or precision.fp8_history changed): delayed scaling starts them afresh; the "
            "weights and optimizer state are restored"
        )
        return fp8_state.fresh_like(like.fp8)
    return jax.tree.map(place, restored["fp8"], like.fp8)


def _other_sites(saved, wanted) -> bool:
    """Whether two amax-history trees name other sites or shapes (history lengths): they are
    keyed by where the traced step's FP8 matmuls are, so a step traced another way has others.
    Histories are statistics of recent steps, not weights: a step without its own starts them
    afresh."""
    return _leaf_table(saved) != _leaf_table(wanted)


def _rng(restored, like: TrainState):
    if like.rng is None or "rng" not in restored:
        return like.rng  # a checkpoint without a key resumes with the configured one
    # An abstract ``like`` does not say its key implementation: jax's default then.
    impl = jax.random.key_impl(like.rng) if isinstance(like.rng, jax.Array) else None
    key = jax.random.wrap_key_data(restored["rng"], impl=impl)
    sharding = getattr(like.rng, "sharding", None)
    return jax.device_put(key, sharding) if sharding is not None else key


def restore_target(like: TrainState, saved_keys) -> dict[str, Any]:
    """What to read: ``like``'s portable entries in their stored shapes and shardings, less the
    optional ones the checkpoint lacks, plus those it has and ``like`` does not (read, dropped)."""
    target = _stored_target(like)
    for key in OPTIONAL:
        if key not in saved_keys:
            target.pop(key, None)
    if "fp8" in saved_keys and "fp8" in target and _other_sites(saved_keys["fp8"], target["fp8"]):
        del target["fp8"]  # other sites' histories: read as saved, then dropped (``_fp8``)
    for key in ("loss_scale", "rng", "fp8"):  # saved, not wanted here: read, then dropped
        if key in saved_keys and key not in target:
            target[key] = jax.tree.map(
                lambda m: jax.ShapeDtypeStruct(tuple(m.shape), m.dtype),
                saved_keys[key],
                is_leaf=lambda m: hasattr(m, "shape"),
            )
    if "loss_scale" in target and "loss_scale" in saved_keys:  # older ones lack "skips"
        saved_fields = saved_keys["loss_scale"]
        target["loss_scale"] = {k: v for k, v in target["loss_scale"].items() if k in saved_fields}
    return _abstract_on_device(target)


def checked_target(like: TrainState, meta_tree, where: str) -> dict[str, Any]:
    """The restore target for a checkpoint whose metadata tree is ``meta_tree``, after checking
    (in one line naming the difference) that it fits ``like``. Read it with
    ``StandardRestore(target, strict=False)``: Orbax then pads a leaf ``like`` stores padded."""
    target = restore_target(like, meta_tree)
    check_compatible(meta_tree, _logical_target(like, target), where)
    return target


def _logical_target(like: TrainState, target: dict[str, Any]) -> dict[str, Any]:
    """``target`` with master and optimizer state in their own shapes, to compare with a
    checkpoint (which is saved unpadded)."""
    out = dict(target)
    out["master"] = padding.unpadded_shapes(like.master, like.padding.master)
    out["opt_state"] = padding.unpadded_shapes(like.opt_state, like.padding.opt_state)
    if like.frozen is not None:
        out["frozen"] = padding.unpadded_shapes(like.frozen, like.padding.frozen)
    return out


def save_checkpoint(
    directory: str | os.PathLike, state: TrainState, *, overwrite: bool = False
) -> Path:
    """Write ``state`` to ``directory`` (which must not exist unless ``overwrite``), then the
    digests of its files (``zeroflow.engine.checkpoint_digests``), which a restore checks."""
    directory = Path(directory).absolute()
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(directory, portable(state), force=overwrite)
        ckptr.wait_until_finished()
    if jax.process_index() == 0:
        checkpoint_digests.write_manifest(directory)
    if jax.process_count() > 1:  # no process returns before the digests are on disk
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices("zeroflow: checkpoint digests written")
    return directory


def restore_checkpoint(directory: str | os.PathLike, like: TrainState) -> TrainState:
    """Load the checkpoint at ``directory`` onto the layout of ``like``.

    ``like`` is a state built on the target plan and precision (``zf.init_train_state``), or
    ``jax.eval_shape`` of one with shardings attached. The mesh, ZeRO stage, offload and
    compute dtype may all differ from the run that saved it.
    """
    directory = Path(directory).absolute()
    if not directory.exists():
        raise CheckpointError(f"no checkpoint at {directory}")
    try:
        verified = checkpoint_digests.verify(directory)
    except checkpoint_digests.DigestMismatch as e:
        raise CheckpointError(f"checkpoint {directory} is unreadable: {e}") from None
    if not verified:
        log.warning(
            "checkpoint %s has no digests (saved before zeroflow recorded them): loaded unverified",
            directory,
        )
    with ocp.StandardCheckpointer() as ckptr:
        try:
            meta = ckptr.metadata(directory)
        except Exception as e:  # orbax raises many types for unreadable metadata
            raise CheckpointError(
                f"checkpoint {directory} is unreadable: {type(e).__name__}: {e}"
            ) from None
        meta_tree = getattr(meta, "item_metadata", meta)
        meta_tree = getattr(meta_tree, "tree", meta_tree)
        target = checked_target(like, meta_tree, str(directory))
        try:
            # strict=False: Orbax pads a leaf the target stores padded with zeros as it reads it.
            restored = ckptr.restore(directory, target, strict=False)
        except Exception as e:
            raise CheckpointError(
                f"checkpoint {directory} could not be read: {type(e).__name__}: "
                f"{str(e).splitlines()[0] if str(e) else ''}"
            ) from None
    return rebuild_state(restored, like)
