"""Multi-process JAX: ``initialize()`` wraps ``jax.distributed.initialize``.

Where the settings come from, first match wins for each value:

1. explicit arguments to ``initialize()``;
2. zeroflow's environment variables (``python -m zeroflow.launch`` sets them):

   ==========================  ===================================================
   ``ZEROFLOW_COORDINATOR``    ``host:port`` of process 0's coordination service
   ``ZEROFLOW_NUM_PROCESSES``  how many processes take part
   ``ZEROFLOW_PROCESS_ID``     this process's index, ``0 .. num_processes - 1``
   ``ZEROFLOW_LOCAL_DEVICE_IDS``  optional, e.g. ``0,1``: the accelerators this
                               process uses (GPU only; default: all, or one per
                               task under SLURM)
   ==========================  ===================================================

3. jax's own: ``JAX_COORDINATOR_ADDRESS``, ``JAX_LOCAL_DEVICE_IDS``, and cluster
   auto-detection (SLURM, Open MPI, Cloud TPU), which fills whatever is still unset.

The train CLI calls ``initialize_from_env()``, which initializes only when the environment asks
for more than one process (see ``requested``); ``ZEROFLOW_DISTRIBUTED=0`` turns that off and
``ZEROFLOW_DISTRIBUTED=1`` forces it (e.g. under Open MPI).

Cross-process collectives on CPU need an implementation; jax's ``jax_cpu_collectives_implementation``
is set to gloo unless the user chose one (``JAX_CPU_COLLECTIVES_IMPLEMENTATION=mpi``).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AbstractMesh, Mesh, NamedSharding, PartitionSpec

from zeroflow.engine.job_env import (
    ENV_COORDINATOR,
    ENV_DISTRIBUTED,
    ENV_LOCAL_DEVICE_IDS,
    ENV_NUM_PROCESSES,
    ENV_PROCESS_ID,
)

# What jax's SLURM detection needs (jax/_src/clusters/slurm_cluster.py); mirrored so that
# ``requested`` agrees with jax about when a SLURM step is present.
SLURM_STEP_VARS = (
    "SLURM_JOB_ID",
    "SLURM_STEP_NODELIST",
    "SLURM_NTASKS",
    "SLURM_PROCID",
    "SLURM_LOCALID",
)


@dataclasses.dataclass(frozen=True)
class ProcessSettings:
    """What is known before jax fills in the rest; ``None`` means "let jax detect it"."""

    coordinator_address: str | None = None
    num_processes: int | None = None
    process_id: int | None = None
    local_device_ids: tuple[int, ...] | None = None

    def merged_over(self, fallback: ProcessSettings) -> ProcessSettings:
        """These values, with ``fallback``'s where these are unset."""
        return ProcessSettings(
            *(
                mine if mine is not None else theirs
                for mine, theirs in zip(dataclasses.astuple(self), dataclasses.astuple(fallback))
            )
        )


_initialized_with: ProcessSettings | None = None


def _as_int(value, name: str, minimum: int) -> int:
    text = str(value).strip()
    if isinstance(value, bool) or not text.lstrip("-").isdigit() or int(text) < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return int(text)


def _as_address(value, name: str) -> str:
    host, sep, port = str(value).strip().rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{name} must be host:port (e.g. 10.0.0.1:1234), got {value!r}")
    return f"{host}:{port}"


def _as_device_ids(value, name: str) -> tuple[int, ...]:
    items = (
        value.split(",")
        if isinstance(value, str)
        else (value if isinstance(value, Sequence) else [value])
    )
    try:
        return tuple(_as_int(v, name, 0) for v in items)
    except ValueError:
        raise ValueError(f"{name} must be device ids like 0,1,2, got {value!r}") from None


def _checked(raw: Sequence[object], names: Sequence[str]) -> ProcessSettings:
    """The settings from ``raw`` (one value per name, as given: text, numbers or None)."""
    coordinator, num, pid, devices = raw
    num_processes = None if num is None else _as_int(num, names[1], 1)
    process_id = None if pid is None else _as_int(pid, names[2], 0)
    if num_processes is not None and process_id is not None and process_id >= num_processes:
        raise ValueError(f"{names[2]}={process_id} is not below {names[1]}={num_processes}")
    return ProcessSettings(
        coordinator_address=None if coordinator is None else _as_address(coordinator, names[0]),
        num_processes=num_processes,
        process_id=process_id,
        local_device_ids=None if devices is None else _as_device_ids(devices, names[3]),
    )


ARG_NAMES = ("coordinator_address", "num_processes", "process_id", "local_device_ids")
ENV_NAMES = (ENV_COORDINATOR, ENV_NUM_PROCESSES, ENV_PROCESS_ID, ENV_LOCAL_DEVICE_IDS)


def settings_from_env(environ: Mapping[str, str] | None = None) -> ProcessSettings:
    """The ``ZEROFLOW_*`` settings; empty variables count as unset."""
    environ = os.environ if environ is None else environ
    return _checked([environ.get(name) or None for name in ENV_NAMES], ENV_NAMES)


def requested(environ: Mapping[str, str] | None = None) -> bool:
    """Whether the environment describes a multi-process run that should initialize."""
    environ = os.environ if environ is None else environ
    switch = environ.get(ENV_DISTRIBUTED, "").strip().lower()
    if switch in ("0", "false", "no", "off"):
        return False
    if switch in ("1", "true", "yes", "on"):
        return True
    if switch:
        raise ValueError(f"{ENV_DISTRIBUTED} must be 0 or 1 (unset: automatic), got {switch!r}")
    if any(
        environ.get(name)
        for name in (ENV_COORDINATOR, ENV_NUM_PROCESSES, ENV_PROCESS_ID, "JAX_COORDINATOR_ADDRESS")
    ):
        return True
    return all(v in environ for v in SLURM_STEP_VARS) and environ["SLURM_NTASKS"].strip() not in (
        "",
        "1",
    )


def _use_gloo_on_cpu() -> None:
    """Cross-process collectives on the CPU backend go over gloo unless the user picked one."""
    # jax's options are dynamic attributes of jax.config, which its type does not declare
    if jax.config.jax_cpu_collectives_implementation is None:  # type: ignore[attr-defined]
        jax.config.update("jax_cpu_collectives_implementation", "gloo")


def _agree(previous: ProcessSettings, wanted: ProcessSettings) -> None:
    for name, old, new in zip(
        ARG_NAMES, dataclasses.astuple(previous), dataclasses.astuple(wanted)
    ):
        if None not in (old, new) and old != new:
            raise ValueError(
                f"already initialized with {name}={old!r}; cannot re-initialize with {new!r}"
            )


_JAX_MISSING = {
    "coordinator_address": ENV_COORDINATOR,
    "Number of processes": ENV_NUM_PROCESSES,
    "process id": ENV_PROCESS_ID,
}


def initialize(
    coordinator_address: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    local_device_ids: int | Sequence[int] | None = None,
    *,
    initialization_timeout: int = 300,
    environ: Mapping[str, str] | None = None,
) -> None:
    """Join the multi-process job; must run before anything uses a jax backend.

    Unset arguments come from the ``ZEROFLOW_*`` variables, then from jax (its variables and
    SLURM / Open MPI / TPU detection). Calling it again is harmless; calling it again with
    different values is an error.
    """
    wanted = _checked(
        (coordinator_address, num_processes, process_id, local_device_ids), ARG_NAMES
    ).merged_over(settings_from_env(environ))
    global _initialized_with
    if jax.distributed.is_initialized():
        if (
            _initialized_with is not None
        ):  # None: someone called jax.distributed.initialize directly
            _agree(_initialized_with, wanted)
        return
    _use_gloo_on_cpu()
    try:
        jax.distributed.initialize(
            wanted.coordinator_address,
            wanted.num_processes,
            wanted.process_id,
            None if wanted.local_device_ids is None else list(wanted.local_device_ids),
            initialization_timeout=initialization_timeout,
        )
    except ValueError as e:
        missing = next((env for needle, env in _JAX_MISSING.items() if needle in str(e)), None)
        if missing is None:
            raise
        raise ValueError(
            f"multi-process setup is incomplete: set {missing} (no SLURM, Open MPI or TPU "
            f"environment was detected to provide it)"
        ) from None
    except RuntimeError as e:
        message = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        if "must be called before" in message:
            message = "initialize() must run before jax is used (jax.devices(), any computation)"
        where = wanted.coordinator_address or "the detected coordinator"
        raise RuntimeError(f"multi-process setup failed (coordinator {where}): {message}") from None
    _initialized_with = wanted


def initialize_from_env(environ: Mapping[str, str] | None = None) -> bool:
    """``initialize()`` when the environment asks for it (see ``requested``); True if initialized."""
    if requested(environ):
        initialize(environ=environ)
    return jax.distributed.is_initialized()


# Long enough for any compile; the barrier only waits for the slowest process to finish one.
LOCKSTEP_TIMEOUT_MS = 60 * 60 * 1000


def _coordination_client():
    # jax exposes no public barrier of its coordination service; the client it initialized
    # is where its own multi-process tests wait.
    from jax._src import distributed as jax_distributed

    return jax_distributed.global_state.client


def _signature(args) -> tuple:
    leaves, treedef = jax.tree.flatten(args)
    return treedef, tuple(
        (np.shape(x), np.result_type(x), getattr(x, "sharding", None)) for x in leaves
    )


class InLockstep:
    """``fn`` (a jitted function: it has ``lower``) that every process compiles before any of
    them runs it.

    Processes compile at their own speed, and the first to run a new program waits for the
    others inside its collectives; the CPU collectives (gloo) give up after 30 seconds, so a
    loaded machine could fail a healthy run. With several processes each new input signature
    is therefore compiled ahead (the call then finds it in jit's cache), and the processes meet
    at a barrier of jax's coordination service, which waits as long as compiling takes. One
    process calls ``fn`` as it is.
    """

    def __init__(self, fn, name: str):
        self.fn, self.name = fn, name
        self.seen: set = set()
        self.multi = jax.process_count() > 1

    def __call__(self, *args):
        if self.multi:
            key = _signature(args)
            if key not in self.seen:
                self.fn.lower(*args).compile()
                barrier = f"zeroflow:{self.name}:{len(self.seen)}"
                _coordination_client().wait_at_barrier(barrier, LOCKSTEP_TIMEOUT_MS)
                self.seen.add(key)
        return self.fn(*args)


class StopVote:
    """Agrees across processes on the step where a caught signal ends a training loop.

    Processes catch a signal at different steps, or only some of them do; one that stops alone
    leaves the others waiting in the next step's collectives. So each step every process casts
    its caught signal number (0: none) into a max over all devices, dispatched without waiting,
    and ``cast`` returns the previous step's result: ready by then (the loop has already waited
    for that step's metrics) and the same on every process. The run stops one step later than
    the signal, at the same step everywhere. With one process the vote is the local value.
    """

    def __init__(self, mesh: Mesh | AbstractMesh):
        self.pending: jax.Array | None = None
        self.multi = jax.process_count() > 1
        if self.multi:
            if not isinstance(mesh, Mesh):  # a planning mesh: no devices to vote on
                raise ValueError("a training loop across processes needs a mesh of devices")
            flat = Mesh(mesh.devices.reshape(-1), ("all",))
            self.sharding = NamedSharding(flat, PartitionSpec("all"))
            self.local_count = len(flat.local_devices)
            reduce = jax.jit(jnp.max, out_shardings=NamedSharding(flat, PartitionSpec()))
            self.reduce = InLockstep(reduce, "stop vote")

    def cast(self, signum: int) -> int:
        """Vote ``signum`` for this step; returns the signal all processes agreed on, or 0."""
        if not self.multi:
            return signum
        agreed = 0 if self.pending is None else int(self.pending)
        local = np.full(self.local_count, signum, np.int32)
        self.pending = self.reduce(jax.make_array_from_process_local_data(self.sharding, local))
        return agreed
