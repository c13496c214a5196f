"""What XLA says a compiled train step needs, and what a state's arrays occupy, per device.

Nothing here allocates model-sized arrays: steps are lowered and compiled ahead of time from
abstract inputs (``jax.ShapeDtypeStruct`` with shardings), and state bytes are read from
shardings (``shard_shape``) when the state is abstract.

On the CPU backend ``memory_analysis()`` counts ``pinned_host`` arrays as ordinary arguments,
so there its numbers do not show what offload saves; ``state_bytes`` splits by memory kind.
"""
from __future__ import annotations

import dataclasses
import math
from collections import defaultdict
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass(frozen=True)
class MeasuredMemory:
    """Per-device bytes from ``compiled.memory_analysis()``.

    ``total_bytes`` = arguments + outputs + temporaries - aliased (outputs written into donated
    arguments), the usual peak estimate; ``peak_bytes`` is XLA's own peak where the backend
    reports one (0 otherwise). ``host_*``: the same for host-memory buffers where the backend
    separates them (GPU/TPU; 0 on CPU).
    """
    argument_bytes: int
    output_bytes: int
    temp_bytes: int
    alias_bytes: int
    generated_code_bytes: int = 0
    peak_bytes: int = 0
    host_argument_bytes: int = 0
    host_output_bytes: int = 0
    host_temp_bytes: int = 0

    @property
    def total_bytes(self) -> int:
        return self.argument_bytes + self.output_bytes + self.temp_bytes - self.alias_bytes


def from_memory_analysis(stats) -> MeasuredMemory:
    get = lambda name: int(getattr(stats, name, 0) or 0)  # noqa: E731  fields vary by backend
    return MeasuredMemory(
        argument_bytes=get("argument_size_in_bytes"), output_bytes=get("output_size_in_bytes"),
        temp_bytes=get("temp_size_in_bytes"), alias_bytes=get("alias_size_in_bytes"),
        generated_code_bytes=get("generated_code_size_in_bytes"), peak_bytes=get("peak_memory_in_bytes"),
        host_argument_bytes=get("host_argument_size_in_bytes"),
        host_output_bytes=get("host_output_size_in_bytes"), host_temp_bytes=get("host_temp_size_in_bytes"))


def measure(step, state, batch) -> MeasuredMemory:
    """Compile ``step`` ahead of time for ``(state, batch)`` (arrays or ShapeDtypeStructs with
    shardings) and report XLA's per-device memory analysis. Nothing runs."""
    stats = step.lower(state, batch).compile().memory_analysis()
    if stats is None:
        raise RuntimeError(f"the {jax.default_backend()} backend gives no memory analysis")
    return from_memory_analysis(stats)


def _shard_nbytes(leaf) -> tuple[str, int]:
    sharding = leaf.sharding
    shape = sharding.shard_shape(tuple(leaf.shape)) if sharding is not None else tuple(leaf.shape)
    kind = getattr(sharding, "memory_kind", None) or "device"
    return kind, math.prod(shape) * jnp.dtype(leaf.dtype).itemsize


def state_bytes(tree) -> dict[str, int]:
    """Bytes one device holds for ``tree``, by memory kind (``{"device": .., "pinned_host": ..}``).

    Works on arrays and on ShapeDtypeStructs that carry shardings. Shards are assumed even, as
    ZeroPlan makes them (a leaf is split only over a dimension the axis size divides).
    """
    out: dict[str, int] = defaultdict(int)
    for leaf in jax.tree.leaves(tree):
        kind, nbytes = _shard_nbytes(leaf)
        out[kind] += nbytes
    return dict(out)


# --------------------------------------------------------------------------- from a Config
@dataclasses.dataclass(frozen=True)
class StepSetup:
    """A jitted step with abstract inputs for one stage / offload / remat choice."""
    step: Any
    state: Any
    batch: Any
    plan: Any
    num_params: int


def abstract_setup(cfg, *, num_devices: int, stage: int, offload: str, update_on: str,
                   remat: str) -> StepSetup:
    """The trainer's GPT train step of ``cfg`` (``build_run``: same optimizer, precision and
    layer-wise gathering) on the first ``num_devices`` data devices, with abstract state and
    batch: parameters are never materialised."""
    from zeroflow.padding import unpadded_shapes
    from zeroflow.trainer.setup import build_run

    model_parallel = cfg.parallel.model
    if jax.device_count() < num_devices * model_parallel:
        raise ValueError(f"measuring needs {num_devices * model_parallel} devices, "
                         f"{jax.device_count()} available ({jax.default_backend()})")
    cfg = dataclasses.replace(
        cfg, model=dataclasses.replace(cfg.model, remat=remat),
        parallel=dataclasses.replace(cfg.parallel, data=num_devices, zero_stage=stage,
                                     offload=offload,
                                     update_on=update_on if offload != "none" else "device"))
    run = build_run(cfg, with_data=False, devices=jax.devices()[:num_devices * model_parallel])
    state = run.abstract_state()
    batch = {"tokens": jax.ShapeDtypeStruct((cfg.train.batch_size, cfg.model.seq_len + 1), np.int32,
                                            sharding=run.plan.batch_sharding())}
    shapes = unpadded_shapes(state.master, state.padding.master)
    num_params = sum(math.prod(x.shape) for x in jax.tree.leaves(shapes))
    return StepSetup(step=run.make_step(), state=state, batch=batch, plan=run.plan,
                     num_params=num_params)


def measure_config(cfg, **choice) -> tuple[MeasuredMemory, dict[str, int]]:
    """AOT memory analysis and per-device state bytes (by memory kind) for one choice
    (keywords of ``abstract_setup``)."""
    setup = abstract_setup(cfg, **choice)
    return measure(setup.step, setup.state, setup.batch), state_bytes(setup.state)
