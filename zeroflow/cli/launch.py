"""``python -m zeroflow.launch --processes P [--cpu-devices D] -- COMMAND ...``

Starts P local copies of COMMAND as one multi-process jax job: each gets the coordinator
environment (``ZEROFLOW_COORDINATOR`` on a free localhost port, ``ZEROFLOW_NUM_PROCESSES``,
``ZEROFLOW_PROCESS_ID``) and its output is streamed line by line as ``[p0] ...``. If a process
fails the others are stopped and the launcher exits with the failing code. SIGINT/SIGTERM are
forwarded to every process, which save and stop (a second signal kills them).
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from typing import IO

from zeroflow.cli.common import ArgumentParser
from zeroflow.engine.job_env import (
    ENV_COORDINATOR,
    ENV_LOCAL_DEVICE_IDS,
    ENV_NUM_PROCESSES,
    ENV_PROCESS_ID,
)

PROG = "zeroflow.launch"
STOP_GRACE_S = 5.0
POLL_S = 0.05


def free_port(host: str = "127.0.0.1") -> int:
    """A port nobody listens on right now (the coordinator binds it moments later)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def process_env(
    base: Mapping[str, str],
    *,
    index: int,
    processes: int,
    coordinator: str,
    cpu_devices: int | None,
    devices_per_process: int | None,
) -> dict[str, str]:
    """The environment of process ``index``."""
    env = {
        **base,
        ENV_COORDINATOR: coordinator,
        ENV_NUM_PROCESSES: str(processes),
        ENV_PROCESS_ID: str(index),
        "PYTHONUNBUFFERED": "1",
    }
    if cpu_devices:
        env["JAX_PLATFORMS"] = "cpu"
        env["JAX_NUM_CPU_DEVICES"] = str(cpu_devices)
        # An inherited device-count flag would fight JAX_NUM_CPU_DEVICES.
        flags = re.sub(
            r"--xla_force_host_platform_device_count=\S*", "", env.get("XLA_FLAGS", "")
        ).strip()
        env.pop("XLA_FLAGS", None)
        if flags:
            env["XLA_FLAGS"] = flags
    if devices_per_process:
        first = index * devices_per_process
        env[ENV_LOCAL_DEVICE_IDS] = ",".join(
            str(d) for d in range(first, first + devices_per_process)
        )
    return env


class Job:
    """P child processes, each in its own process group, with prefixed output."""

    def __init__(self, command: Sequence[str], envs: Sequence[Mapping[str, str]]):
        self.lock = threading.Lock()
        self.procs: list[subprocess.Popen] = []
        self.readers: list[threading.Thread] = []
        for i, env in enumerate(envs):
            try:
                proc = subprocess.Popen(
                    list(command),
                    env=dict(env),
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    process_group=0,
                )
            except OSError:
                self.stop()
                raise
            self.procs.append(proc)
            for pipe, sink in ((proc.stdout, sys.stdout), (proc.stderr, sys.stderr)):
                t = threading.Thread(target=self._relay, args=(pipe, sink, f"[p{i}] "), daemon=True)
                t.start()
                self.readers.append(t)

    def _relay(self, pipe: IO[bytes], sink: IO[str], prefix: str) -> None:
        for raw in iter(pipe.readline, b""):
            line = raw.decode("utf-8", errors="replace").rstrip("\r\n")
            with self.lock:
                sink.write(f"{prefix}{line}\n")
                sink.flush()
        pipe.close()

    def signal(self, signum: int, *, skip: int | None = None) -> None:
        for i, proc in enumerate(self.procs):
            if i != skip and proc.poll() is None:
                try:
                    os.killpg(proc.pid, signum)
                except ProcessLookupError:
                    pass

    def stop(self, skip: int | None = None) -> None:
        """SIGTERM the live processes, SIGKILL what is left after a grace period."""
        self.signal(signal.SIGTERM, skip=skip)
        deadline = time.monotonic() + STOP_GRACE_S
        while time.monotonic() < deadline and any(p.poll() is None for p in self.procs):
            time.sleep(POLL_S)
        self.signal(signal.SIGKILL, skip=skip)
        for p in self.procs:
            p.wait()

    def finish_output(self) -> None:
        for t in self.readers:
            t.join(timeout=STOP_GRACE_S)


def exit_code(returncode: int) -> int:
    """A child's return code as a shell would report it (killed by signal N -> 128 + N)."""
    return 128 - returncode if returncode < 0 else returncode


# Exit codes of a graceful stop (the trainer saves a checkpoint and exits 128 + signal). Every
# process stops at the same step, so the others are left to finish rather than killed.
STOPPED_BY_SIGNAL = (128 + signal.SIGINT, 128 + signal.SIGTERM)


def say(message: str) -> None:
    print(f"{PROG}: {message}", file=sys.stderr, flush=True)


def _first_failure(job: Job) -> tuple[int, int] | None:
    """(index, exit code) of the first process that exited with an error, if any."""
    for i, proc in enumerate(job.procs):
        code = None if proc.poll() is None else exit_code(proc.returncode)
        if code and code not in STOPPED_BY_SIGNAL:
            return i, code
    return None


def launch(
    command: Sequence[str],
    processes: int,
    *,
    cpu_devices: int | None = None,
    devices_per_process: int | None = None,
    host: str = "127.0.0.1",
    port: int | None = None,
) -> int:
    """Run the job to completion; returns 0, or the exit code of the first process that failed."""
    coordinator = f"{host}:{port or free_port(host)}"
    envs = [
        process_env(
            os.environ,
            index=i,
            processes=processes,
            coordinator=coordinator,
            cpu_devices=cpu_devices,
            devices_per_process=devices_per_process,
        )
        for i in range(processes)
    ]
    forwarded: list[int] = []
    job: Job | None = None

    def forward(signum, _frame):
        forwarded.append(signum)
        if job is not None:
            job.signal(signal.SIGKILL if len(forwarded) > 1 else signum)

    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        job = Job(command, envs)
        if forwarded:  # a signal arrived while the processes were starting
            job.signal(forwarded[0])
        while any(p.poll() is None for p in job.procs):
            # After a forwarded signal each process saves and exits by itself: no fail-fast.
            failed = None if forwarded else _first_failure(job)
            if failed:
                live = sum(p.poll() is None for p in job.procs)
                say(
                    f"process {failed[0]} failed with exit code {failed[1]}; stopping the other {live}"
                )
                job.stop(skip=failed[0])
                job.finish_output()
                return failed[1]
            time.sleep(POLL_S)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if job is not None and any(
            p.poll() is None for p in job.procs
        ):  # the launcher itself failed
            job.stop()
    job.finish_output()
    codes = [exit_code(p.returncode) for p in job.procs]
    bad = next((i for i, c in enumerate(codes) if c), None)
    if bad is None:
        return 0
    after = f" after {signal.Signals(forwarded[0]).name}" if forwarded else ""
    say(f"process {bad} exited with code {codes[bad]}{after}")
    return codes[bad]


def parser() -> argparse.ArgumentParser:
    p = ArgumentParser(
        prog=f"python -m {PROG}",
        description=__doc__.split("\n\n")[1],
        usage=f"python -m {PROG} --processes P [options] -- COMMAND ...",
    )
    p.add_argument(
        "--processes", type=int, required=True, metavar="P", help="how many processes to start"
    )
    p.add_argument(
        "--cpu-devices",
        type=int,
        default=None,
        metavar="D",
        help="run on CPU with D emulated devices per process (collectives over gloo)",
    )
    p.add_argument(
        "--devices-per-process",
        type=int,
        default=None,
        metavar="K",
        help="GPU: process i uses accelerators i*K .. i*K+K-1",
    )
    p.add_argument("--host", default="127.0.0.1", help="coordinator address (default: %(default)s)")
    p.add_argument("--port", type=int, default=None, help="coordinator port (default: a free one)")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--" not in argv:
        if any(a in ("-h", "--help") for a in argv):
            parser().parse_args(["--help"])  # prints usage and every option, then exits 0
        parser().error(
            "give the command after --, e.g. -- python -m zeroflow.train --config configs/tiny.yaml"
        )
    split = argv.index("--")
    args, command = parser().parse_args(argv[:split]), argv[split + 1 :]
    if not command:
        parser().error("the command after -- is empty")
    for name in ("processes", "cpu_devices", "devices_per_process"):
        value = getattr(args, name)
        if value is not None and value < 1:
            parser().error(f"--{name.replace('_', '-')} must be at least 1, got {value}")
    try:
        return launch(
            command,
            args.processes,
            cpu_devices=args.cpu_devices,
            devices_per_process=args.devices_per_process,
            host=args.host,
            port=args.port,
        )
    except OSError as e:  # the command could not be started
        say(f"error: cannot start {command[0]!r}: {e.strerror or e}")
        return 127


if __name__ == "__main__":
    sys.exit(main())
