"""What XLA says a compiled train step needs, and what a state's arrays occupy, per device.

Steps are compiled ahead of time from abstract inputs (``jax.ShapeDtypeStruct`` with
shardings): nothing model-sized is allocated. XLA:CPU's ``memory_analysis()`` counts
``pinned_host`` arrays as arguments; ``state_bytes`` splits by memory kind.
"""

from __future__ import annotations

import dataclasses
import math
from collections import defaultdict

import jax
import numpy as np

from zeroflow.backend import accelerators
from zeroflow.engine.state import abstract_master, init_train_state, state_shardings
from zeroflow.engine.step import make_train_step
from zeroflow.memory import on_target
from zeroflow.memory.traced import itemsize
from zeroflow.xla import schedule


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
    host_alias_bytes: int = 0

    @property
    def total_bytes(self) -> int:
        return self.argument_bytes + self.output_bytes + self.temp_bytes - self.alias_bytes

    @property
    def host_total_bytes(self) -> int:
        """Host memory the same way: host arguments + outputs + temporaries - aliased."""
        return (
            self.host_argument_bytes
            + self.host_output_bytes
            + self.host_temp_bytes
            - self.host_alias_bytes
        )


_XLA_NAMES = {"peak_bytes": "peak_memory_in_bytes"}
"``memory_analysis()``'s name of each ``MeasuredMemory`` field: ``x_bytes`` is ``x_size_in_bytes``."


def from_memory_analysis(stats) -> MeasuredMemory:
    return MeasuredMemory(
        **{  # fields vary by backend: a missing one is 0
            f.name: int(
                getattr(stats, _XLA_NAMES.get(f.name, f"{f.name[:-6]}_size_in_bytes"), 0) or 0
            )
            for f in dataclasses.fields(MeasuredMemory)
        }
    )


def measure(step, state, batch) -> MeasuredMemory:
    """Compile ``step`` ahead of time for ``(state, batch)`` (arrays or ShapeDtypeStructs with
    shardings) and report XLA's per-device memory analysis. Nothing runs."""
    return analysed(step.lower(state, batch).compile())


def analysed(compiled) -> MeasuredMemory:
    """XLA's per-device memory analysis of a compiled step."""
    stats = compiled.memory_analysis()
    if stats is None:
        raise RuntimeError("this backend's compiler gives no memory analysis")
    return from_memory_analysis(stats)


def measure_step(loss_fn, params, batch, tx, plan, prec, **options) -> tuple[MeasuredMemory, float]:
    """``(memory_analysis, device peak)`` of ``make_train_step(loss_fn, tx, plan, prec, ...)``
    for abstract fp32 ``params`` and global ``batch`` (arrays or ``ShapeDtypeStruct``s):
    the state is built abstractly in the plan's shardings, nothing is allocated or run. The
    device peak leaves out the offloaded state, which XLA:CPU counts as device arguments.
    On a ``zf.target_mesh`` this is XLA:GPU's number. ``options``: ``abstract_step``'s
    keywords (``grad_accum``, ``gather_per_layer``, ``model_state`` / ``rng`` / ``trainable``
    as ``zf.init_train_state`` takes them, and more of ``make_train_step``'s: ``prefetch``,
    ``compiler_options``). An offloaded plan on a target mesh is compiled through CPU devices
    standing in for the GPUs (``zeroflow.memory.on_target``), so its offloaded state stays in
    host memory as on a GPU."""
    compiled, state = compile_step(loss_fn, params, batch, tx, plan, prec, **options)
    got = analysed(compiled)
    return got, float(device_peak(got, state))


def device_peak(got: MeasuredMemory, state) -> int:
    """The device's peak from a memory analysis: on a backend that does not separate host
    memory (XLA:CPU counts pinned_host arguments as device ones), less the offloaded state."""
    if got.host_argument_bytes == 0:
        return got.total_bytes - state_bytes(state).get("pinned_host", 0)
    return got.total_bytes


def compile_step(loss_fn, params, batch, tx, plan, prec, **options):
    """``(compiled step, abstract state)`` for the arguments of ``measure_step``: read the
    compiled program's collectives with ``zf.memory.collectives``."""
    step, state, placed, target = abstract_step(loss_fn, params, batch, tx, plan, prec, **options)
    if target is not None:
        return on_target.compile_for(step, state, placed, target), state
    return step.lower(state, placed).compile(), state


def abstract_step(
    loss_fn,
    params,
    batch,
    tx,
    plan,
    prec,
    *,
    grad_accum: int = 1,
    gather_per_layer: str | None = None,
    model_state=None,
    rng=None,
    trainable=None,
    **step_options,
):
    """``(step, abstract state, abstract batch, target)`` for the arguments of
    ``measure_step``: the state and batch as ``ShapeDtypeStruct``s in the plan's shardings;
    ``target`` the abstract GPUs' mesh where an offloaded plan is planned on CPU stand-ins
    for them (else None)."""
    # Offloaded state on abstract GPUs: planned on CPU stand-ins that keep its host memory.
    target = plan.mesh if plan.offloads and on_target.is_abstract(plan.mesh) else None
    if target is not None:
        plan = dataclasses.replace(plan, mesh=on_target.stand_in_mesh(target))
    master = abstract_master(params)
    abstract = jax.eval_shape(
        lambda ms, key: init_train_state(
            master, tx, plan, prec, model_state=ms, rng=key, trainable=trainable
        ),
        model_state,
        rng,
    )
    shardings = state_shardings(master, tx, plan, prec, model_state, rng, trainable=trainable)
    state = jax.tree.map(
        lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), abstract, shardings
    )
    placed = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(
            np.shape(x), x.dtype, sharding=plan.batch_sharding(np.ndim(x))
        ),
        batch,
    )
    step = make_train_step(
        loss_fn, tx, plan, prec, grad_accum, gather_per_layer=gather_per_layer, **step_options
    )
    return step, state, placed, target


def step_time(loss_fn, params, batch, tx, plan, prec, **options):
    """XLA:GPU's estimated step (``zeroflow.xla.schedule.StepTime``: ``step_ms``,
    ``exposed_us(kind)``, ``exposed_by_kind()``, ``mfu(...)``) of the step ``compile_step``
    compiles for the same arguments, on a ``zf.target_mesh`` (or GPUs). An estimate of XLA's
    cost model, not a measurement; the process must have been started with
    ``schedule.LOG_ENV`` in its environment (a one-line ``RuntimeError`` says so otherwise)."""
    return compile_step_timed(loss_fn, params, batch, tx, plan, prec, **options)[2]


def compile_step_timed(loss_fn, params, batch, tx, plan, prec, **options):
    """``(compiled step, abstract state, StepTime)``: ``compile_step`` and ``step_time`` from
    one compile (the peak and the estimate of the same program)."""
    peak = accelerators.peak_flops(str(plan.mesh.devices.flat[0].device_kind), "bf16")
    (compiled, state), est = schedule.timed(
        lambda: compile_step(loss_fn, params, batch, tx, plan, prec, **options),
        text_of=lambda result: result[0].as_text(),
        peak_flops=peak,
    )
    return compiled, state, est


def state_bytes(tree) -> dict[str, int]:
    """Bytes one device holds for ``tree``, by memory kind (``{"device": .., "pinned_host": ..}``).

    Works on arrays and on ShapeDtypeStructs that carry shardings. Shards are assumed even, as
    ZeroPlan makes them (a leaf is split only over a dimension the axis size divides).
    """
    out: dict[str, int] = defaultdict(int)
    for leaf in jax.tree.leaves(tree):
        sharding, shape = leaf.sharding, tuple(leaf.shape)
        local = sharding.shard_shape(shape) if sharding is not None else shape
        kind = getattr(sharding, "memory_kind", None) or "device"
        out[kind] += math.prod(local) * itemsize(leaf.dtype)
    return dict(out)
