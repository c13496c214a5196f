"""``python -m zeroflow.memory --config X [--target h100] [--devices N] --max-seq``: the
longest sequence per row that the config's own step fits in device memory, decided by
compiling it (``zeroflow.memory.max_seq``) with the config's ZeRO stage, offload, remat,
context axis, loss and MLP chunks (set them with ``key=value``).

Each probe compiles the trainer's whole GPT step at one ``model.seq_len`` (for ``--target``'s
abstract GPUs: XLA:GPU's memory analysis; else this machine's devices) and reads the device
peak (``zeroflow.memory.measure.device_peak``) and the host memory it keeps per device
(offloaded state, layer inputs on the host, the host update's temporaries).
"""

from __future__ import annotations

import dataclasses
import json
import math
import sys

from zeroflow.memory.estimate import format_bytes
from zeroflow.memory.max_seq import Probe, Search, longest_fitting
from zeroflow.memory.measure import analysed, device_peak, state_bytes
from zeroflow.planner.compiling import failure_reason
from zeroflow.trainer.planning import compile_config


def granule_of(cfg, step: int) -> int:
    """Lengths the search tries are multiples of ``step`` and of what the context axis needs
    (the ring's load-balanced layout cuts each row into ``2 x context`` equal chunks)."""
    context = cfg.parallel.context
    return math.lcm(step, 2 * context if context > 1 else 1)


def probe_config(cfg, *, devices: int, target: str | None):
    """``seq -> Probe``: the config's step compiled at ``seq`` tokens per row."""
    par = cfg.parallel

    def probe(seq: int) -> Probe:
        at = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, seq_len=seq))
        try:
            compiled, setup = compile_config(
                at,
                num_devices=devices,
                stage=par.zero_stage,
                offload=par.offload,
                update_on=par.update_on,
                remat=cfg.model.remat,
                target=target,
            )
        except Exception as e:  # a length XLA or the engine refuses does not fit
            return Probe(seq, None, None, failure_reason(e))
        got = analysed(compiled)
        # Backends that do not separate host memory (XLA:CPU) report none: the offloaded
        # state's own bytes are then the host memory it needs.
        host = got.host_total_bytes or state_bytes(setup.state).get("pinned_host", 0)
        return Probe(seq, float(device_peak(got, setup.state)), float(host))

    return probe


def progress(probe: Probe, left: int, device_memory: float) -> None:
    """One line per compile on stderr."""
    if probe.peak_bytes is None:
        what = f"does not compile ({probe.note})"
    else:
        verdict = "fits" if probe.fits(device_memory) else "too long"
        what = f"peak {format_bytes(probe.peak_bytes)}/device: {verdict}"
    print(f"  seq {probe.seq:,}: {what} (compiles left: {left})", file=sys.stderr, flush=True)


def search_config(
    cfg,
    *,
    devices: int,
    target: str | None,
    device_memory: float,
    step: int,
    limit: int,
    max_compiles: int,
) -> Search:
    granule = granule_of(cfg, step)
    print(
        f"searching the longest sequence in steps of {granule:,} tokens (at most "
        f"{max_compiles} compiles, up to {limit:,}):",
        file=sys.stderr,
        flush=True,
    )
    return longest_fitting(
        probe_config(cfg, devices=devices, target=target),
        device_memory,
        start=cfg.model.seq_len,
        granule=granule,
        limit=limit,
        max_compiles=max_compiles,
        log=lambda p, left: progress(p, left, device_memory),
    )


def as_json(search: Search, *, device_memory: float, devices_per_process: int) -> dict:
    best, over = search.best, search.first_too_long
    return {
        "max_seq": None if best is None else best.seq,
        "peak_bytes": None if best is None else round(best.peak_bytes or 0),
        "host_bytes_per_device": None if best is None else round(best.host_bytes or 0),
        "host_bytes_per_process": None
        if best is None
        else round((best.host_bytes or 0) * devices_per_process),
        "first_too_long": None if over is None else over.seq,
        "converged": search.converged,
        "device_memory_bytes": device_memory,
        "compiles": [dataclasses.asdict(p) for p in search.probes],
    }


def report(search: Search, *, device_memory: float, devices_per_process: int, title: str) -> str:
    """The answer in words."""
    best, over = search.best, search.first_too_long
    if best is None:
        shortest = min(p.seq for p in search.probes)
        return (
            f"{title}: not even {shortest:,} tokens per row fit in "
            f"{format_bytes(device_memory)} per device."
        )
    host = best.host_bytes or 0
    lines = [
        f"{title}: longest sequence that fits in {format_bytes(device_memory)} per device: "
        f"{best.seq:,} tokens per row (compiled peak {format_bytes(best.peak_bytes or 0)} "
        f"per device).",
        f"Host memory to provision: {format_bytes(host * devices_per_process)} per process "
        f"({format_bytes(host)} per device x {devices_per_process} devices per process).",
    ]
    if over is None:
        lines.append(f"Every length tried fitted: {best.seq:,} is the search's limit.")
    elif not search.converged:
        lines.append(
            f"{over.seq:,} does not fit; the compile budget ran out before the search "
            f"narrowed to one step of {search.granule:,} (raise --max-compiles)."
        )
    else:
        lines.append(f"{over.seq:,} does not fit.")
    return "\n".join(lines)


def run(args, cfg, devices: int, device_memory: float, title: str, target, per_process: int):
    """``--max-seq``: the search, then its answer, in words or (``--json``) as one object."""
    search = search_config(
        cfg,
        devices=devices,
        target=target,
        device_memory=device_memory,
        step=args.seq_step,
        limit=args.seq_limit,
        max_compiles=args.max_compiles,
    )
    total = devices * cfg.parallel.model * cfg.parallel.context
    if total != devices:
        title += f", {total} devices in all (context {cfg.parallel.context})"
    if args.json:
        print(
            json.dumps(
                as_json(search, device_memory=device_memory, devices_per_process=per_process)
            )
        )
    else:
        print(
            report(
                search, device_memory=device_memory, devices_per_process=per_process, title=title
            )
        )
    return 0
