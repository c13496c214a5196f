"""Checkpoints that load onto any mesh, ZeRO stage, offload or precision.

What is saved is the *portable* part of a TrainState: step, fp32 master weights, optimizer
state and loss scale, each as a global array. The compute-dtype copy is not saved: it is a
cast of the master weights and is rebuilt on restore. Restoring reads every array straight into
the sharding that ``like`` (a state built on the target plan, or its abstract shapes) asks for,
so a checkpoint written at ZeRO-3 on (8, 1) loads at ZeRO-1 on (4, 2) or on one device.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp

from zeroflow.plan import path_str
from zeroflow.state import TrainState


class CheckpointError(ValueError):
    """A checkpoint that is missing, unreadable or does not fit the target state."""


def portable(state: TrainState) -> dict[str, Any]:
    """The saved part of a state; the compute copy is derived, so it is left out."""
    out = {"step": state.step, "master": state.master, "opt_state": state.opt_state}
    if state.loss_scale is not None:
        out["loss_scale"] = {"scale": state.loss_scale.scale, "good_steps": state.loss_scale.good_steps}
    return out


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
    return {path_str(p): tuple(getattr(x, "shape", ())) for p, x in jax.tree_util.tree_leaves_with_path(tree)}


def check_compatible(saved_meta, target, where: str) -> None:
    """One readable line naming what differs between a checkpoint and the target state."""
    saved, want = _leaf_table(saved_meta), _leaf_table(target)
    missing = sorted(set(want) - set(saved))
    extra = sorted(set(saved) - set(want))
    shapes = sorted(k for k in set(saved) & set(want) if saved[k] != want[k])
    if missing or extra or shapes:
        parts = []
        if missing:
            parts.append(f"missing in checkpoint: {', '.join(missing[:4])}" + (" ..." if len(missing) > 4 else ""))
        if extra:
            parts.append(f"not in target: {', '.join(extra[:4])}" + (" ..." if len(extra) > 4 else ""))
        if shapes:
            k = shapes[0]
            parts.append(f"shape of {k} is {saved[k]} in checkpoint, {want[k]} in target"
                         + (f" (+{len(shapes) - 1} more)" if len(shapes) > 1 else ""))
        raise CheckpointError(f"checkpoint {where} does not match the target state: " + "; ".join(parts))


def rebuild_state(restored: dict[str, Any], like: TrainState) -> TrainState:
    """A TrainState on ``like``'s shardings (memory kinds included) from restored arrays."""
    def place(x, target):
        sharding = getattr(target, "sharding", None)
        return jax.device_put(x, sharding) if sharding is not None else x

    master = jax.tree.map(place, restored["master"], like.master)
    opt_state = jax.tree.map(place, restored["opt_state"], like.opt_state)
    compute = None
    if like.compute is not None:
        compute = jax.tree.map(lambda m, t: place(m.astype(t.dtype), t), master, like.compute)
    loss_scale = like.loss_scale
    if like.loss_scale is not None and "loss_scale" in restored:
        loss_scale = type(like.loss_scale)(
            scale=place(restored["loss_scale"]["scale"], like.loss_scale.scale),
            good_steps=place(restored["loss_scale"]["good_steps"], like.loss_scale.good_steps))
    return TrainState(step=place(restored["step"], like.step), master=master, compute=compute,
                      opt_state=opt_state, loss_scale=loss_scale)


def restore_target(like: TrainState, saved_has_loss_scale: bool) -> dict[str, Any]:
    target = portable(like)
    if not saved_has_loss_scale:
        target.pop("loss_scale", None)
    elif "loss_scale" not in target:  # saved with scaling, restored without: read and drop it
        target["loss_scale"] = {"scale": jax.ShapeDtypeStruct((), jnp.float32),
                                "good_steps": jax.ShapeDtypeStruct((), jnp.int32)}
    return _abstract_on_device(target)


def save_checkpoint(directory: str | os.PathLike, state: TrainState, *, overwrite: bool = False) -> Path:
    """Write ``state`` to ``directory`` (which must not exist unless ``overwrite``)."""
    directory = Path(directory).absolute()
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(directory, portable(state), force=overwrite)
        ckptr.wait_until_finished()
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
    with ocp.StandardCheckpointer() as ckptr:
        try:
            meta = ckptr.metadata(directory)
        except Exception as e:  # orbax raises many types for unreadable metadata
            raise CheckpointError(f"checkpoint {directory} is unreadable: {type(e).__name__}: {e}") from None
        meta_tree = getattr(meta, "item_metadata", meta)
        meta_tree = getattr(meta_tree, "tree", meta_tree)
        target = restore_target(like, "loss_scale" in meta_tree)
        check_compatible(meta_tree, target, str(directory))
        try:
            restored = ckptr.restore(directory, target)
        except Exception as e:
            raise CheckpointError(f"checkpoint {directory} could not be read: {type(e).__name__}: "
                                  f"{str(e).splitlines()[0] if str(e) else ''}") from None
    return rebuild_state(restored, like)
