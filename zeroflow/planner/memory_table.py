"""The memory table of a trainer config: one row per ZeRO stage x offload x remat choice, with
the ZeRO formula's bytes (model states, the GPT's activation formula) and, where the step is
compiled (small configs on emulated CPU devices, always for a GPU target), XLA's peak, the
collectives' overlap and XLA:GPU's estimated step; the cheapest choice that fits, and the
table a person reads. ``python -m zeroflow.memory`` (``zeroflow.cli.memory``) parses its flags
and shows this.

"Cheapest" ranks choices by their usual cost in step time: no offload before offload
(PCIe traffic), then remat none < save_dots < offload_dots (activations over PCIe) < full
(recompute) < offload_input (recompute, and the layer inputs over PCIe), then a lower stage
(stage 3 adds an all-gather per use). A choice fits when its peak is at most the device
memory: XLA's compiled peak where it was compiled, else the formula's.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from zeroflow.backend import accelerators
from zeroflow.memory import schedule
from zeroflow.memory.collectives import collectives, overlap
from zeroflow.memory.estimate import (
    OFFLOADS,
    REMATS,
    STAGES,
    MemoryEstimate,
    format_bytes,
)
from zeroflow.memory.measure import analysed, device_peak
from zeroflow.models import flops_per_token
from zeroflow.models.spec import count_gpt_params, estimate_config, offloaded_activations
from zeroflow.planner.compiling import failure_reason
from zeroflow.trainer.planning import attention_note, compile_config, count_frozen_params

MEASURE_MAX_PARAMS = 50_000_000
"'--measure auto' compiles only models up to this many parameters..."
MEASURE_MAX_DEVICES = 16
"... and only meshes up to this many devices (CPU compile time grows with both)."
REMAT_COST = {"none": 0, "save_dots": 1, "offload_dots": 2, "full": 3, "offload_input": 4}


@dataclasses.dataclass(frozen=True)
class Row:
    stage: int
    offload: str
    remat: str
    update_on: str
    estimate: MemoryEstimate
    "The ZeRO formula's (model states, and the GPT's activations per micro-batch)."
    host_activations: float
    "Activations an offloading remat keeps in host memory per device, by the formula."
    devices_per_process: int
    measured_bytes: float | None = None  # XLA's per-device total, host-kind state removed
    note: str = ""
    overlap: dict | None = None  # zeroflow.memory.collectives.overlap of the compiled step
    measured_host_bytes: float | None = None  # XLA's host-memory buffers per device (host_*)
    timing: dict | None = None  # XLA:GPU's estimated step: step_ms, exposed_ms, mfu (_timing)

    @property
    def need_bytes(self) -> float:
        """XLA's compiled peak where compiled, else the formula's."""
        return self.estimate.device_bytes if self.measured_bytes is None else self.measured_bytes

    @property
    def host_bytes(self) -> float:
        """Pinned host memory per process (its devices' offloaded state and activations):
        XLA's host buffers where it reports them, else the formula's."""
        if self.measured_host_bytes:
            return self.measured_host_bytes * self.devices_per_process
        return self.estimate.host_bytes + self.host_activations * self.devices_per_process

    def as_json(self) -> dict:
        return {
            "stage": self.stage,
            "offload": self.offload,
            "update_on": self.update_on,
            "remat": self.remat,
            "estimated_peak_bytes": round(self.estimate.device_bytes),
            "measured_peak_bytes": None
            if self.measured_bytes is None
            else round(self.measured_bytes),
            "measured_host_bytes": None
            if self.measured_host_bytes is None
            else round(self.measured_host_bytes),
            "host_bytes_per_process": round(self.host_bytes),
            "formula": {
                "model_states": round(self.estimate.device.total),
                "activations": round(self.estimate.activation_bytes),
                "update": round(self.estimate.update_bytes),
            },
            **({"overlap": self.overlap} if self.overlap is not None else {}),
            **({"estimated_step": self.timing} if self.timing is not None else {}),
            **({"note": self.note} if self.note else {}),
        }

    @property
    def cost(self) -> tuple:
        return (OFFLOADS.index(self.offload), REMAT_COST[self.remat], self.stage)


def _measured(
    cfg, devices: int, stage: int, offload: str, remat: str, target: str | None
) -> tuple[float, dict, float, dict | None]:
    """XLA's device peak of one choice, the overlap of its collectives, its host-memory
    bytes per device (offloaded state and activations, where the backend separates them) and,
    for a target in a process started with the scheduler's logging, XLA:GPU's step estimate."""
    update_on = cfg.parallel.update_on if offload != "none" else "device"

    def compile_it():
        return compile_config(
            cfg,
            num_devices=devices,
            stage=stage,
            offload=offload,
            update_on=update_on,
            remat=remat,
            target=target,
        )

    timing, kept = None, []

    def compile_kept():
        kept.append(compile_it())
        return kept[-1]

    if target is not None and schedule.enabled():
        try:
            _, est = schedule.timed(
                compile_kept, text_of=lambda r: r[0].as_text(), peak_flops=_peak_flops(target)
            )
            timing = _timing(est, cfg, devices, target)
        except RuntimeError:
            if not kept:  # the compile failed, not the estimate: the row did not compile
                raise
    compiled, setup = kept[-1] if kept else compile_it()
    got = analysed(compiled)
    return (
        float(device_peak(got, setup.state)),
        overlap(collectives(compiled)),
        float(got.host_total_bytes),
        timing,
    )


def _timing(est, cfg, devices: int, target: str) -> dict:
    """The JSON fields of an estimated step: ms, exposed ms per collective kind, and the MFU
    of the model's FLOPs per token (``zeroflow.models.flops_per_token``: 6 x weights + the
    attention's) x tokens at the dense bf16 peak."""
    tokens = cfg.train.batch_size * cfg.model.seq_len / devices
    flops = flops_per_token(cfg.model) * tokens
    peak = _peak_flops(target)
    return {
        "step_ms": round(est.step_ms, 3),
        "exposed_ms": {k: round(v / 1e3, 3) for k, v in est.exposed_by_kind().items()},
        "mfu": None if peak is None else round(est.mfu(flops, peak), 4),
        "uncosted_loops": list(est.uncosted),
        "is_estimate": True,
        "loops_costed_by_flops": {
            c.name: c.costed_by for c in est.computations if c.costed_by != "xla"
        },
    }


def _peak_flops(target: str) -> float | None:
    found = accelerators.named(target)
    return None if found is None else found.bf16_flops


def plan_rows(
    cfg,
    *,
    devices: int,
    stages=STAGES,
    offloads=OFFLOADS,
    remats=REMATS,
    measure: str = "auto",
    devices_per_process: int | None = None,
    log=None,
    target: str | None = None,
) -> list[Row]:
    """One Row per choice: the formula's peak, and the measured peak where compiled
    (for ``target``'s abstract GPUs when given: XLA:GPU's peak, and its overlap; offloaded
    choices compiled through CPU stand-ins, ``zeroflow.memory.on_target``)."""
    num_params = count_gpt_params(cfg.model)
    if measure == "auto":
        measure = (
            "always"
            if target is not None
            or (
                num_params <= MEASURE_MAX_PARAMS
                and devices * cfg.parallel.model <= MEASURE_MAX_DEVICES
            )
            else "never"
        )
    per_process = devices_per_process or min(devices, 8)
    frozen = count_frozen_params(cfg)
    micro = max(cfg.train.batch_size // (devices * cfg.parallel.grad_accum), 1)
    rows = []
    for stage in stages:
        for offload in offloads:
            for remat in remats:
                update_on = cfg.parallel.update_on if offload != "none" else "device"
                est = estimate_config(
                    cfg,
                    num_devices=devices,
                    stage=stage,
                    offload=offload,
                    update_on=update_on,
                    remat=remat,
                    devices_per_process=per_process,
                    frozen_params=frozen,
                )
                host_acts = offloaded_activations(
                    cfg.model, micro_batch=micro, remat=remat, precision=cfg.precision.params
                )
                measured, note, overlapped, host, timing = None, "", None, None, None
                if measure == "always":
                    if log:
                        log(f"compiling stage {stage}, offload {offload}, remat {remat} ...")
                    try:
                        measured, overlapped, host, timing = _measured(
                            cfg, devices, stage, offload, remat, target
                        )
                        note = attention_note(cfg, target)
                    except Exception as e:  # a choice that cannot compile is reported, not fatal
                        note = failure_reason(e)
                rows.append(
                    Row(
                        stage,
                        offload,
                        remat,
                        update_on,
                        est,
                        host_acts,
                        per_process,
                        measured,
                        note,
                        overlapped,
                        host,
                        timing,
                    )
                )
    return rows


def cheapest_fit(rows: Sequence[Row], device_memory: float) -> Row | None:
    fitting = [r for r in rows if r.need_bytes <= device_memory]
    return min(fitting, key=lambda r: r.cost) if fitting else None


def render(
    rows: Sequence[Row], device_memory: float, title: str, console=None, show_all: bool = False
) -> Row | None:
    """The table (by default the cheapest choice that fits and, per offload kind, its own
    cheapest fit or else its smallest need; every choice with ``show_all``), rows that differ
    only in stage said once, then one line per reason a compile failed, then the answer."""
    from rich.console import Console
    from rich.table import Table

    console = console or Console(width=max(Console().width, 150))
    best = cheapest_fit(rows, device_memory)
    merged = _merged(rows)
    shown = merged if show_all else _compact(merged, best, device_memory)
    console.print(title)
    table = Table()
    with_overlap = any(r.overlap is not None for _, r in shown)
    with_timing = any(r.timing is not None for _, r in shown)
    columns: tuple[str, ...] = (
        "stage",
        "offload",
        "remat",
        "formula/dev",
        "XLA/dev",
        "host/process",
        "fits",
    )
    columns += ("overlapped collectives",) if with_overlap else ()
    for name in columns + (TIMING_COLUMNS if with_timing else ()):
        table.add_column(name, justify="right" if "/" in name else "left")
    for stages, r in shown:
        measured = "-" if r.measured_bytes is None else format_bytes(r.measured_bytes)
        if r.measured_host_bytes:
            measured += f" (+{format_bytes(r.measured_host_bytes)} host)"
        cells = [stages, r.offload, r.remat, format_bytes(r.estimate.device_bytes), measured]
        cells += [format_bytes(r.host_bytes), "yes" if r.need_bytes <= device_memory else "no"]
        if with_overlap:
            total = (r.overlap or {}).get("total", {})
            cells.append(f"{total['overlapped']}/{total['count']}" if total else "-")
        if with_timing:
            cells += _timing_cells(r.timing)
        table.add_row(*cells, style="bold green" if r is best else None)
    console.print(table)
    if len(shown) < len(merged):
        console.print(f"{len(merged) - len(shown)} more choices: --all lists every one")
    _render_notes(rows, with_timing, console)
    console.print(_answer(best, device_memory))
    return best


def _merged(rows: Sequence[Row]) -> list[tuple[str, Row]]:
    """``(stages, row)``: rows that differ only in their stage (stages 0-2 on one device are
    the same program) said once, with their stages."""
    groups: dict = {}
    for r in rows:
        key = (r.offload, r.remat, r.need_bytes, r.host_bytes, r.note, repr(r.timing))
        groups.setdefault(key, []).append(r)
    out = []
    for same in groups.values():
        stages = [r.stage for r in same]
        label = f"{stages[0]}-{stages[-1]}" if len(stages) > 2 else ",".join(map(str, stages))
        out.append((label, same[0]))
    return out


def _compact(merged, best: Row | None, device_memory: float) -> list[tuple[str, Row]]:
    """The cheapest fit, and per offload kind its cheapest fit, else its smallest need."""
    keep = []
    for offload in OFFLOADS:
        kind = [(s, r) for s, r in merged if r.offload == offload]
        fitting = [(s, r) for s, r in kind if r.need_bytes <= device_memory]
        if fitting:
            keep.append(min(fitting, key=lambda sr: sr[1].cost))
        elif kind:
            keep.append(min(kind, key=lambda sr: sr[1].need_bytes))
    if best is not None and all(r is not best for _, r in keep):
        keep.insert(0, next(sr for sr in merged if sr[1] is best))
    return sorted(keep, key=lambda sr: sr[1].cost)


def _answer(best: Row | None, device_memory: float) -> str:
    if best is None:
        return (
            f"Nothing fits in {format_bytes(device_memory)} per device; add devices, "
            "shrink train.batch_size or raise parallel.grad_accum."
        )
    return (
        f"Cheapest choice that fits in {format_bytes(device_memory)}: "
        f"parallel.zero_stage={best.stage} parallel.offload={best.offload} "
        f"model.remat={best.remat} (needs {format_bytes(best.need_bytes)} per device)"
    )


TIMING_COLUMNS = ("est. step (XLA:GPU)", "exposed comm.", "est. MFU")


def _timing_cells(timing: dict | None) -> list[str]:
    if timing is None:
        return ["-", "-", "-"]
    how = set(timing["loops_costed_by_flops"].values())
    mark = (
        "≥ "
        if "peak-flops" in how or (timing["uncosted_loops"] and not how)
        else ("~ " if how else "")
    )
    step = mark + f"{timing['step_ms']:.1f} ms"
    exposed = (
        ", ".join(
            f"{k.replace('all-', '').replace('reduce-scatter', 'RS')} {v:.1f}"
            for k, v in timing["exposed_ms"].items()
        )
        or "0"
    )
    # An MFU from a step with loops XLA did not cost (``~``/``≥``) or above the peak is no
    # figure to print: "-", the legend says why.
    trusted = timing["mfu"] is not None and not mark and timing["mfu"] <= 1
    mfu = f"{100 * timing['mfu']:.0f}%" if trusted else "-"
    return [step, f"{exposed} ms" if exposed != "0" else "0", mfu]


def _render_notes(rows: Sequence[Row], with_timing: bool, console) -> None:
    """The lines under the table: what the columns are, each measured row's note once, and
    one line per reason a choice did not compile."""
    console.print(
        "formula: the ZeRO formula with the GPT's activation formula (no compile); XLA: the "
        "compiled step's peak, which decides what fits where it was compiled"
    )
    if with_timing:
        console.print(
            "est. step: XLA:GPU's latency-hiding scheduler's estimate for the target (its cost "
            "model; nothing ran); exposed comm.: time it waits on collectives; est. MFU: model "
            "FLOPs / est. step / dense bf16 peak, '-' where XLA left loops uncosted (~: costed "
            "at its time per flop, >=: at the peak) or the figure would pass 100%"
        )
    for note in sorted({r.note for r in rows if r.note and r.measured_bytes is not None}):
        console.print(f"measured: {note}")
    failed: dict = {}
    for r in rows:
        if r.note and r.measured_bytes is None:
            failed.setdefault(r.note, []).append(f"{r.stage}/{r.offload}/{r.remat}")
    for reason, which in failed.items():
        more = f" and {len(which) - 2} more" if len(which) > 2 else ""
        console.print(f"did not compile ({', '.join(which[:2])}{more}): {reason}")
