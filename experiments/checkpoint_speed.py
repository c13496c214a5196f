"""How long a checkpoint save blocks training, synchronous vs asynchronous, and how fast the
digests are written and checked:

    python experiments/checkpoint_speed.py --gb 1 --out experiments/results/checkpoint_speed.md


A ZeRO-3 train state (fp32 weights of random values, AdamW's two moments) of ``--gb`` GB is
sharded over ``--devices`` emulated CPU devices and saved ``--saves`` times by the trainer's own
``RunCheckpoints``: once with ``checkpoint.async_save=false`` (``save`` returns when the files
and their digests are written) and once with ``true`` (``save`` returns once the state is in
host memory; ``finish`` waits for the rest). Then one step's digests are checked as a resume
checks them (``checkpoint_digests.verify``, several threads). The last section scales the
measured rates by bytes to larger states; those figures are extrapolations, labelled so.

With ``--processes 2`` the same runs as 2 local processes over gloo (``zeroflow.launch``, the
devices split between them), each writing and digesting its own part of every step; then one
step is verified twice: by process 0 alone (every file, as a one-process resume does) and by
every process at once, each its own files (as a multi-process resume does), with 1 thread per
process and with as many as the machine has cores. Its section of ``--out`` is replaced, the
rest of the file kept (and a one-process run keeps that section):

    python experiments/checkpoint_speed.py --gb 1 --processes 2 --out experiments/results/checkpoint_speed.md
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
DEVICES_FLAG = "--devices"
PROCESS_ID = "ZEROFLOW_PROCESS_ID"
"Set by ``zeroflow.launch`` in each process it starts."
SECTION = "## 2 processes over gloo"


def _devices() -> int:
    argv = sys.argv
    return int(argv[argv.index(DEVICES_FLAG) + 1]) if DEVICES_FLAG in argv else 8


from zeroflow.cli.common import start_script  # noqa: E402

start_script()  # before jax: where the CUDA plugin has no driver, a CPU jax without its noise
os.environ.setdefault("JAX_PLATFORMS", "cpu")
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec  # noqa: E402

import zeroflow as zf  # noqa: E402
from experiments.machine import cpu_name  # noqa: E402
from zeroflow.engine import checkpoint_digests  # noqa: E402
from zeroflow.trainer.checkpoints import RunCheckpoints  # noqa: E402

BYTES_PER_PARAM = 14
"A full fine-tuning state with AdamW: bf16 weights (2), fp32 master (4), two fp32 moments (8)."
TARGETS = {  # name: (parameters, GPUs the state is sharded over)
    "Llama-3.1-8B, 8 x H100": (8.03e9, 8),
    "Llama-3.1-70B, 64 x H100": (70.6e9, 64),
}


def make_state(gb: float):
    """A ZeRO-3 state of about ``gb`` GB (weights and two moments, fp32) over every device."""
    n = int(gb * 1e9 / 12) // 64 * 64
    keys = jax.random.split(jax.random.key(0), 8)
    mesh = zf.make_mesh(data=-1, model=1)
    # Built as global arrays, sharded over every process's devices: each process gives its
    # own slices (the same values everywhere, drawn from one seed).
    sharded = NamedSharding(mesh, PartitionSpec("data"))
    params = {}
    for i, k in enumerate(keys):
        values = np.asarray(jax.random.normal(k, (n // 8,), jnp.float32))
        params[f"w{i}"] = jax.make_array_from_callback(values.shape, sharded, values.__getitem__)
        del values
    plan = zf.ZeroPlan(mesh, stage=3)
    state = zf.init_train_state(params, optax.adam(1e-3), plan, zf.Precision(params="fp32"))
    # Moments of random values, as after some training: zeros (or any constant) compress on
    # disk to almost nothing and would write far faster than a trained state.
    noisy = jax.jit(
        lambda tree: jax.tree.map(
            lambda x: (
                x + 1e-3 * jax.random.normal(jax.random.key(1), x.shape, x.dtype)
                if x.dtype == jnp.float32 and x.ndim
                else x
            ),
            tree,
        )
    )
    state = state.replace(opt_state=noisy(state.opt_state))
    jax.block_until_ready(state)
    return state


def time_saves(state, folder: Path, async_save: bool, saves: int) -> dict:
    checkpoints = RunCheckpoints(folder, keep=2, async_save=async_save)
    blocked, total = [], []
    for step in range(1, saves + 1):
        start = time.perf_counter()
        checkpoints.save(step, state, {"step": step, "seed": 0})
        blocked.append(time.perf_counter() - start)
        checkpoints.finish()
        total.append(time.perf_counter() - start)
    checkpoints.close()
    size = sum(f.stat().st_size for f in (folder / str(saves)).rglob("*") if f.is_file())
    return {"blocked": blocked, "total": total, "bytes": size}


def time_verify(step_dir: Path) -> float:
    start = time.perf_counter()
    assert checkpoint_digests.verify(step_dir, expected=True)
    return time.perf_counter() - start


def barrier(name: str) -> None:
    if jax.process_count() > 1:
        multihost_utils.sync_global_devices(f"checkpoint_speed: {name}")


def time_verify_split(step_dir: Path, threads: int) -> tuple[float, float]:
    """``(seconds for process 0 to check the whole step alone, seconds for every process to
    check its own files at once)``, each from a barrier to the last process done; ``threads``
    files hashed at once per process."""
    count, me = jax.process_count(), jax.process_index()
    barrier(f"alone {threads}")
    start = time.perf_counter()
    if me == 0:
        assert checkpoint_digests.verify(step_dir, expected=True, threads=threads)
    barrier(f"alone {threads} done")
    alone = time.perf_counter() - start
    barrier(f"split {threads}")
    start = time.perf_counter()
    assert checkpoint_digests.verify(
        step_dir, expected=True, process=me, process_count=count, threads=threads
    )
    barrier(f"split {threads} done")
    return alone, time.perf_counter() - start


HASH_FILES = """import hashlib, sys
for path in sys.argv[1:]:
    with open(path, "rb") as f:
        hashlib.file_digest(f, "sha256")
"""
"A plain Python process hashing the files it is given, one after another."


def plain_hashing(step_dir: Path, count: int) -> tuple[float, float]:
    """The machine's own ceiling, without jax: ``(seconds for one OS process to hash every file
    of the step, seconds for ``count`` processes at once, each the files one process of the run
    wrote)``."""
    manifest = json.loads((step_dir / checkpoint_digests.MANIFEST).read_text())["files"]
    groups: list[list[str]] = [[] for _ in range(count)]
    for name in sorted(manifest):
        groups[checkpoint_digests.owner(name, count)].append(str(step_dir / name))

    def hashed(file_groups) -> float:
        start = time.perf_counter()
        procs = [subprocess.Popen([sys.executable, "-c", HASH_FILES, *g]) for g in file_groups]
        assert all(p.wait() == 0 for p in procs)
        return time.perf_counter() - start

    return hashed([sum(groups, [])]), hashed(groups)


def bytes_by_process(step_dir: Path, count: int) -> list[int]:
    manifest = json.loads((step_dir / checkpoint_digests.MANIFEST).read_text())["files"]
    out = [0] * count
    for name, entry in manifest.items():
        out[checkpoint_digests.owner(name, count)] += entry["bytes"]
    return out


def median(values: list[float]) -> float:
    return sorted(values)[len(values) // 2]


def report(args, sync: dict, asynchronous: dict, verify_s: float, manifest_s: float) -> str:
    gb = sync["bytes"] / 1e9
    sync_s, async_s = median(sync["blocked"]), median(asynchronous["blocked"])
    lines = [
        "# Checkpoint saves: how long training is blocked, sync vs async",
        "",
        f"Command: `python experiments/checkpoint_speed.py --gb {args.gb} --devices "
        f"{args.devices} --saves {args.saves} --out {args.out}`",
        "",
        f"Machine: {cpu_name()}, {os.cpu_count()} cores, {args.devices} emulated CPU devices "
        f"(jax {jax.__version__}), a local disk shared with other work; date: "
        f"{datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC.",
        f"State: ZeRO-3, fp32 weights and two AdamW moments of random values, {gb:.2f} GB on "
        f"disk per step; {args.saves} saves each way, medians.",
        "",
        "| mode | training blocked per save (s) | save complete with digests (s) | blocked, "
        "share of sync |",
        "|---|---|---|---|",
        f"| sync (`checkpoint.async_save=false`) | {sync_s:.2f} | {median(sync['total']):.2f} "
        "| 100% |",
        f"| async (default) | {async_s:.2f} | {median(asynchronous['total']):.2f} | "
        f"{100 * async_s / sync_s:.1f}% |",
        "",
        f"Digests of one step ({gb:.2f} GB): written in {manifest_s:.2f} s "
        f"({gb / manifest_s:.2f} GB/s), checked before a restore in {verify_s:.2f} s "
        f"({gb / verify_s:.2f} GB/s, several threads, files in the page cache). Save "
        f"throughput, sync: {gb / median(sync['total']):.2f} GB/s.",
        "",
        "On CPU devices the arrays already live in host memory: Orbax's copy to host is a "
        "view of each buffer (no bytes move), so the async blocking time above is Orbax's "
        "bookkeeping alone; while the view is held, XLA:CPU does not donate that buffer to the "
        "next step (it copies instead), so the saved values cannot change under the writer. "
        "The async save completes in about the sync time: the same bytes are written and "
        "hashed, off the training thread.",
        "",
        "## Extrapolated by bytes (not measured)",
        "",
        f"Each figure below is a measured rate of the first table scaled by the bytes of a state at "
        f"{BYTES_PER_PARAM} bytes per parameter; on GPUs the blocking part is the copy of each "
        "GPU's shard to host memory over PCIe, not the memory copy measured here, so the async "
        "column is given at this machine's rate and at an assumed 25 GB/s per GPU.",
        "",
        "| state | bytes | per GPU | sync, one writer (s) | async blocked at this "
        "machine's rate (s) | async blocked at 25 GB/s per GPU (s) |",
        "|---|---|---|---|---|---|",
    ]
    sync_rate = gb / median(sync["total"])
    async_rate = gb / async_s
    for name, (params, gpus) in TARGETS.items():
        total = params * BYTES_PER_PARAM / 1e9
        lines.append(
            f"| {name} | {total:,.0f} GB | {total / gpus:.1f} GB | {total / sync_rate:,.0f} "
            f"| {total / gpus / async_rate:.2f} | {total / gpus / 25:.2f} |"
        )
    return "\n".join(lines) + "\n"


def processes_report(args, sync: dict, asynchronous: dict, step_dir: Path) -> str:
    """The 2-process section: saves as above, then the verification of one step split or not,
    with 1 thread per process and with as many as this machine's cores."""
    count = jax.process_count()
    parts = bytes_by_process(step_dir, count)
    gb = sum(parts) / 1e9
    rows = []
    per_process = 0.0  # GB/s one process reached checking its own files, with most threads
    for threads in sorted({1, os.cpu_count() or 1}):
        time_verify_split(step_dir, threads)  # the files in the page cache for both timings
        alone, split = time_verify_split(step_dir, threads)
        per_process = max(per_process, max(parts) / 1e9 / split)
        rows.append(
            f"| {threads} | {alone:.2f} s ({gb / alone:.2f} GB/s) | {split:.2f} s "
            f"({gb / split:.2f} GB/s) | {alone / split:.2f}x |"
        )
    barrier("plain hashing")
    if jax.process_index() == 0:
        one, several = plain_hashing(step_dir, count)
        rows.append(
            f"| plain SHA-256, no jax (1 thread per OS process) | {one:.2f} s "
            f"({gb / one:.2f} GB/s) | {several:.2f} s ({gb / several:.2f} GB/s) | "
            f"{one / several:.2f}x |"
        )
    barrier("plain hashing done")
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    sync_s, async_s = median(sync["blocked"]), median(asynchronous["blocked"])
    share = ", ".join(f"process {i}: {b / 1e9:.2f} GB" for i, b in enumerate(parts))
    lines = [
        SECTION,
        "",
        f"Command: `python experiments/checkpoint_speed.py --gb {args.gb} --devices "
        f"{args.devices} --processes {count} --saves {args.saves} --out {args.out}`",
        "",
        f"Machine: {cpu_name()}, {os.cpu_count()} cores, {count} local processes over gloo "
        f"(`zeroflow.launch`), {args.devices // count} emulated CPU devices each (jax "
        f"{jax.__version__}); date: {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC. "
        f"The same state, {gb:.2f} GB on disk per step ({share}); process 0's timings, medians "
        f"of {args.saves} saves.",
        "",
        "| mode | training blocked per save (s) | save complete with digests (s) |",
        "|---|---|---|",
        f"| sync | {sync_s:.2f} | {median(sync['total']):.2f} |",
        f"| async (default) | {async_s:.2f} | {median(asynchronous['total']):.2f} |",
        "",
        f"Verification of one step ({gb:.2f} GB, files in the page cache): process 0 alone "
        "checks every file (as a one-process resume does), or each process checks the files "
        "it wrote, at once (as a resume of this run does):",
        "",
        "| threads per process | one process, whole step | each process its own files | speed-up |",
        "|---|---|---|---|",
        *rows,
        "",
        f"Load average at the end (1, 5, 15 min): {load} on {os.cpu_count()} cores shared with "
        "other work.",
        "",
        "Extrapolated by bytes (not measured): a resume's verification with one process per "
        f"host of 8 GPUs, each checking its host's share at the {per_process:.2f} GB/s one "
        "process reached here:",
        "",
        "| state | hosts (processes) | per process | verification before the first step (s) |",
        "|---|---|---|---|",
    ]
    for name, (params, gpus) in TARGETS.items():
        total, hosts = params * BYTES_PER_PARAM / 1e9, max(1, gpus // 8)
        lines.append(
            f"| {name} | {hosts} | {total / hosts:,.0f} GB | {total / hosts / per_process:,.0f} |"
        )
    return "\n".join(lines) + "\n"


def write_section(path: Path, text: str) -> None:
    """``text`` (a section starting with its ``## `` heading) in place of the section of the
    same heading in ``path``, else before the extrapolations, else at the end."""
    heading = text.splitlines()[0]
    old = path.read_text().splitlines(keepends=True) if path.exists() else []
    kept, skipping = [], False
    for line in old:
        if line.startswith("## "):
            skipping = line.rstrip("\n") == heading
        if not skipping:
            kept.append(line)
    body = "".join(kept)
    marker = "## Extrapolated by bytes"
    if marker in body:
        at = body.index(marker)
        body = body[:at] + text + "\n" + body[at:]
    else:
        body = body.rstrip("\n") + ("\n\n" if body else "") + text
    path.write_text(body)


def launched(args) -> int:
    """This program again as ``args.processes`` local processes (``zeroflow.launch``), sharing
    one work folder."""
    with tempfile.TemporaryDirectory(dir=".") as work:
        argv = [a for a in sys.argv[1:]]
        command = [
            sys.executable, "-m", "zeroflow.launch", "--processes", str(args.processes),
            "--cpu-devices", str(args.devices // args.processes), "--",
            sys.executable, str(Path(__file__).resolve()), *argv, "--work", work,
        ]  # fmt: skip
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
        }
        return subprocess.call(command, env=env)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gb", type=float, default=1.0, help="state size in GB")
    p.add_argument(DEVICES_FLAG, type=int, default=8, help="emulated CPU devices (all processes)")
    p.add_argument("--processes", type=int, default=1, help="local processes over gloo")
    p.add_argument("--saves", type=int, default=3)
    p.add_argument("--out", default="experiments/results/checkpoint_speed.md")
    p.add_argument("--work", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.processes > 1 and PROCESS_ID not in os.environ:
        return launched(args)
    if args.processes > 1:
        from zeroflow.engine.distributed import initialize_from_env

        initialize_from_env()  # the devices: zeroflow.launch's JAX_NUM_CPU_DEVICES
    else:
        # The emulated devices, set once the flags are read and before any array exists (a
        # program that imported this module to read its flags has started jax already).
        jax.config.update("jax_num_cpu_devices", _devices())
    state = make_state(args.gb)
    with contextlib.ExitStack() as stack:
        tmp = args.work or stack.enter_context(tempfile.TemporaryDirectory(dir="."))
        sync = time_saves(state, Path(tmp) / "sync", False, args.saves)
        barrier("sync timed")
        if jax.process_index() == 0:
            shutil.rmtree(Path(tmp) / "sync")
        asynchronous = time_saves(state, Path(tmp) / "async", True, args.saves)
        step_dir = Path(tmp) / "async" / str(args.saves)
        if args.processes > 1:
            text = processes_report(args, sync, asynchronous, step_dir)
            if jax.process_index() == 0:
                write_section(Path(args.out), text)
                print(text)
            return 0
        start = time.perf_counter()
        checkpoint_digests.write_manifest(step_dir)
        manifest_s = time.perf_counter() - start
        verify_s = time_verify(step_dir)
    text = report(args, sync, asynchronous, verify_s, manifest_s)
    out = Path(args.out)
    kept = out.read_text() if out.exists() else ""
    out.write_text(text)
    if SECTION in kept:  # the 2-process section of an earlier run stays
        write_section(out, kept[kept.index(SECTION) :].split("\n## ", 1)[0].rstrip("\n") + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
