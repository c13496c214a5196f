"""The search over rows (GPU x device count), for any JAX model (``zf.plan``) and for a trainer
config (``plan_config``, what ``python -m zeroflow.planner`` runs: the config's remat policies
and attention kernels searched beside the engine's choices, and advice where nothing fits)."""

from __future__ import annotations

import functools
import tempfile
from collections.abc import Callable, Sequence

import jax

from zeroflow.autocast.precision import Precision
from zeroflow.backend import targets
from zeroflow.memory.estimate import REMATS, STAGES
from zeroflow.models.cudnn_rules import HOPPER, cudnn_attention_problem, cudnn_max_head_dim
from zeroflow.models.gpt import head_dim
from zeroflow.planner import where as places
from zeroflow.planner.advice import advise
from zeroflow.planner.choices import OFFLOAD_PAIRS, Space, check_fp8_rows, with_fp8
from zeroflow.planner.compiling import Compiler
from zeroflow.planner.problems import ConfigProblem, ModelProblem
from zeroflow.planner.results import Plan
from zeroflow.planner.search import MAX_FAILURES, search_row
from zeroflow.planner.where import Where

Progress = Callable[[int, int, str], None]
"progress(done, total, what): compile slots done of the search's bound, and what compiles next."


def plan(
    loss_fn,
    params,
    batch,
    tx,
    *,
    targets: Sequence[str] | None = None,
    devices: Sequence[int] | None = None,
    precision: Precision | None = None,
    margin: float = 0.1,
    stages: Sequence[int] = (0, 1, 2, 3),
    offloads: Sequence[tuple[str, str]] = OFFLOAD_PAIRS,
    grad_accums: Sequence[int] | None = None,
    zeropp: bool = True,
    max_compiles: int = 4,
    min_compiles: int = 2,
    trainable=None,
    gather_per_layer: str | None = None,
    tokens_per_example: int | None = None,
    device_memory: int | None = None,
    progress: Progress | None = None,
    fp8: bool = False,
) -> Plan:
    """Search ZeRO stage, offload (and where the update runs), micro-batch split and ZeRO++
    options for ``zf.make_train_step(loss_fn, tx, plan, precision)`` on each GPU of ``targets``
    (``zf.target_mesh`` names, compiled without the GPU) x each count of ``devices``; without
    ``targets``, on this machine's devices. ``params``: abstract fp32 parameters (arrays or
    ``ShapeDtypeStruct``s); ``batch``: one global batch (its leading dimension is split over
    devices and micro-batches). Peaks and step times are XLA's (see ``zeroflow.planner``);
    a plan fits when its compiled peak is at most ``1 - margin`` of the device's memory.
    ``max_compiles`` bounds the compiles per row that give a peak: one that fails is kept with
    its reason and not counted (``search.MAX_FAILURES`` failures end a row).
    ``tokens_per_example``: to report tokens/s and MFU (else examples/s, no MFU).
    ``fp8``: also try FP8 matmuls (``Space.fp8_matmuls``).
    Returns a ``Plan``: ``plan.summaries()`` per row, ``plan.as_json()`` the whole search."""
    options = dict(trainable=trainable, gather_per_layer=gather_per_layer)
    prec = precision or Precision()
    problem = ModelProblem(
        loss_fn, params, batch, tx, prec, **options, tokens_per_example=tokens_per_example
    )
    space = Space(
        tuple(stages), tuple(offloads), grad_accums=grad_accums, zeropp=zeropp, fp8_matmuls=fp8
    )
    rows = rows_of(targets, devices, device_memory)
    check_fp8_rows(rows, fp8, problem.fp8_problem())
    space_at = functools.partial(with_fp8, space)
    return run(problem, rows, space_at, margin, max_compiles, min_compiles, progress)


def rows_of(
    gpus: Sequence[str] | None, devices: Sequence[int] | None, device_memory: int | None
) -> list[Where]:
    """One ``Where`` per GPU x device count (this machine's devices without ``gpus``)."""
    counts = list(devices or ((1, 8) if gpus else (jax.device_count(),)))
    for n in counts:
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"device counts must be positive ints, got {n!r}")
    if gpus:
        return [places.target(g, n, device_memory) for g in gpus for n in counts]
    return [places.local(n, device_memory) for n in counts]


def run(
    problem,
    rows: Sequence[Where],
    space_for: Callable[[Where], Space],
    margin: float,
    max_compiles: int,
    min_compiles: int,
    progress: Progress | None = None,
) -> Plan:
    """Search every row. Rows with more devices go first: their programs have collectives, so
    XLA costs their loops, and a GPU's time per flop is then known for its one-device rows."""
    if not 0 <= margin < 1:
        raise ValueError(f"margin must be in [0, 1), got {margin!r}")
    if max_compiles < 1 or min_compiles < 1:
        raise ValueError("max_compiles and min_compiles must be >= 1")
    batch = problem.batch_size
    for n in sorted({w.devices for w in rows if batch % w.devices}):
        fits = ", ".join(str(d) for d in range(1, batch + 1) if batch % d == 0)
        raise ValueError(f"{n} devices do not split the batch of {batch}; device counts: {fits}")
    with tempfile.TemporaryDirectory(prefix="zeroflow-planner-") as scratch:
        compiler = Compiler(scratch)
        # A row may add one compile (search.py's last resort) and failed ones, which do
        # not count against max_compiles.
        bound = max_compiles + 1 + MAX_FAILURES
        total, done, found = bound * len(rows), 0, {}
        limits: dict = dict(margin=margin, max_compiles=max_compiles, min_compiles=min_compiles)
        for where in sorted(rows, key=lambda w: -w.devices):
            start = compiler.compiles

            def tick(what: str, start=start, done=done) -> None:
                if progress:
                    progress(done + compiler.compiles - start, total, what)

            space = space_for(where)
            found[where] = search_row(problem, where, space, compiler, on_compile=tick, **limits)
            done += bound
            if progress:
                progress(done, total, f"{where.title} done")
        plan = Plan(problem.title, [found[w] for w in rows], margin, compiler, problem)
        for row in plan.rows if isinstance(problem, ConfigProblem) else ():
            if row.best is None and row.candidates:
                plan.advice[row.where.title] = advise(problem, row, space_for(row.where), compiler)
    return plan


def space_for(
    model,
    where: Where,
    stages=STAGES,
    remats=REMATS,
    attentions=None,
    zeropp=True,
    grad_accums=None,
    fp8=False,
) -> Space:
    """The search space of a config's GPT ``model`` at ``where``: on GPUs the model's attention
    and cuDNN's unless given, less cuDNN where the target's GPUs cannot run its head dim (the
    reason kept as the space's note); on XLA:CPU no cuDNN, and no activation offload (its host
    memory is the device's, so offload_dots is save_dots there); ``fp8``: FP8 matmuls too,
    where the GPU has them."""
    notes: tuple[str, ...] = ()
    if where.is_gpu:
        kernels = list(attentions or dict.fromkeys([model.attention, "cudnn"]))
        kept = list(remats)
        refused = cudnn_refusal(head_dim(model), where) if "cudnn" in kernels else None
        if refused:  # the model's own cuDNN gives way to XLA's; one asked for is not replaced
            kernels = [a for a in kernels if a != "cudnn"] or ([] if attentions else ["xla"])
            left = " and ".join(kernels)
            notes = (f"{refused}; " + (f"planned with {left} attention" if kernels else NO_KERNEL),)
    else:
        own = "xla" if model.attention == "cudnn" else model.attention
        kernels = [a for a in (attentions or [own]) if a != "cudnn"] or ["xla"]
        kept = [r for r in remats if r != "offload_dots"]
    space = dict(remats=tuple(kept), attentions=tuple(kernels), notes=notes, fp8_matmuls=fp8)
    return with_fp8(Space(tuple(stages), grad_accums=grad_accums, zeropp=zeropp, **space), where)


NO_KERNEL = "nothing planned (--attentions leaves no other attention; try --attentions xla)"
"What a row says where the only attention asked for cannot run on its GPUs."


def cudnn_refusal(head: int, where: Where) -> str | None:
    """Why cuDNN attention cannot run heads of ``head`` dims on ``where``'s target GPUs (jax's
    rule, ``zeroflow.models.cudnn_rules``), in a few words; None where it can, and on this
    machine's GPUs (the step's own trace checks those)."""
    if where.local:
        return None
    capability = targets.compute_capability(where.name)
    if cudnn_attention_problem(head, capability, where.device_kind) is None:
        return None
    sm = f"sm_{capability[0]}{capability[1]}"
    if head % 8:
        return f"cuDNN attention needs a head dim that is a multiple of 8 (model.head_dim={head})"
    limit, hopper = cudnn_max_head_dim(capability), f"sm_{HOPPER[0]}{HOPPER[1]}"
    since = "before" if capability < HOPPER else "from"
    return (
        f"cuDNN attention needs head dim <= {limit} {since} {hopper} "
        f"(model.head_dim={head}, {where.name} is {sm})"
    )


def plan_config(
    cfg,
    *,
    name: str,
    gpus: Sequence[str] | None = None,
    devices: Sequence[int] | None = None,
    margin: float = 0.1,
    device_memory: int | None = None,
    max_compiles: int = 3,
    min_compiles: int = 2,
    progress: Progress | None = None,
    **space,
) -> Plan:
    """The plan of ``cfg`` on each GPU x device count (this machine's devices without
    ``gpus``), with advice for the rows where nothing fits; ``space``: ``space_for``'s
    ``stages``, ``remats``, ``attentions``, ``zeropp``, ``grad_accums`` and ``fp8``."""
    if gpus:
        targets.use_cpu_for_targets()
    rows = rows_of(gpus, devices, device_memory)
    problem = ConfigProblem(cfg, name)
    check_fp8_rows(rows, space.get("fp8", False), problem.fp8_problem())
    space_at = functools.partial(space_for, problem.model, **space)
    return run(problem, rows, space_at, margin, max_compiles, min_compiles, progress)
