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
import itertools
import json
import tempfile
from collections.abc import Sequence

from zeroflow.backend import targets
from zeroflow.config.io import CONFIG_KEYS, apply_overrides
from zeroflow.engine.plan_rules import batch_split_problem
from zeroflow.memory.estimate import (
    OFFLOADS,
    REMATS,
    STAGES,
    MemoryEstimate,
    format_bytes,
)
from zeroflow.models.gpt import head_dim
from zeroflow.models.spec import count_gpt_params, estimate_config, offloaded_activations
from zeroflow.planner import where as places
from zeroflow.planner.choices import first_equal_stage, remat_dtypes_of
from zeroflow.planner.compiling import Compiler
from zeroflow.planner.library import cudnn_refusal
from zeroflow.planner.problems import ConfigProblem
from zeroflow.trainer.planning import attention_note, count_frozen_params
from zeroflow.trainer.setup import run_model_config
from zeroflow.util.units import parse_bytes

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
    timing: dict | None = None  # XLA:GPU's estimated step: step_ms, exposed_ms, mfu, costed_by
    remat_dtype: str | None = None  # what the remat keeps saved activations in; None: the config's
    attention: str | None = None
    "The attention figured in place of the config's, which the target cannot run..."
    attention_why: str = ""
    "... and why, one line (said once under the table)."

    @property
    def remat_label(self) -> str:
        """The remat policy, with ' fp8' where asked for FP8 residuals (``--remat-dtypes``)."""
        return self.remat + (" fp8" if self.remat_dtype == "fp8" else "")

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
            **({"remat_dtype": self.remat_dtype} if self.remat_dtype is not None else {}),
            **({"attention": self.attention} if self.attention is not None else {}),
            **({"attention_why": self.attention_why} if self.attention_why else {}),
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
        """FP8 residuals rank right after the same remat in the compute dtype: about as fast,
        but their gradients are approximate."""
        fp8 = self.remat_dtype == "fp8"
        return (OFFLOADS.index(self.offload), REMAT_COST[self.remat], fp8, self.stage)


def setting(cfg, *, name: str, devices: int | None, target: str | None, device_memory):
    """``(data devices, device memory, title)`` of the table of ``cfg``: ``devices``, else
    ``parallel.data``, else this machine's devices over the other axes; ``device_memory``,
    else the target GPU's, else 80 GB. A batch the devices cannot split is refused here."""
    import jax

    if target is not None:
        targets.use_cpu_for_targets()
        spec = targets.spec_text(target)
        device_memory = device_memory or int(targets.spec_field(spec, "device_memory_size"))
    par = cfg.parallel
    devices = devices or (
        par.data if par.data > 0 else jax.device_count() // (par.model * par.context)
    )
    problem = batch_split_problem(cfg.train.batch_size, par.grad_accum, devices, CONFIG_KEYS)
    if problem:
        raise ValueError(f"{devices} data devices: {problem}; give --devices that divides it")
    where = (
        f"{devices} x {target} (XLA:GPU, compiled without the GPU)"
        if target
        else f"{devices} devices (measured: XLA:{jax.default_backend().upper()} of this machine)"
    )
    title = (
        f"{name}: {count_gpt_params(cfg.model):,} params, batch {cfg.train.batch_size}, "
        f"{cfg.precision.params}, {where}"
    )
    return devices, device_memory or parse_bytes("80GB"), title


def show(rows, device_memory: float, title: str, *, as_json: bool, show_all: bool, target):
    """The table, or with ``as_json`` one JSON object per row."""
    if not as_json:
        render(rows, device_memory, title, show_all=show_all)
        return
    for row in rows:
        fits = {"fits": row.need_bytes <= device_memory, "device_memory_bytes": device_memory}
        print(json.dumps({**row.as_json(), **fits, **({"target": target} if target else {})}))


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
    remat_dtypes: Sequence[str] | None = None,
) -> list[Row]:
    """One Row per choice: the formula's peak, and where compiled (``measure``) the planner's
    compile of it (``zeroflow.planner.compiling``: for ``target``'s abstract GPUs XLA:GPU's
    peak and step estimate; offloaded choices through CPU stand-ins). On one device a stage
    that makes the engine's decisions of a lower one is that stage's compile. ``remat_dtypes``:
    each remat in each of these dtypes where it applies (FP8 only where the policy saves
    something); None: the config's ``model.remat_dtype``."""
    cfg, replaced = runnable_attention(cfg, target)
    if measure == "auto":
        small = count_gpt_params(cfg.model) <= MEASURE_MAX_PARAMS
        few = devices * cfg.parallel.model <= MEASURE_MAX_DEVICES
        measure = "always" if target is not None or (small and few) else "never"
    per_process = devices_per_process or min(devices, 8)
    frozen = count_frozen_params(cfg)
    micro = max(cfg.train.batch_size // (devices * cfg.parallel.grad_accum), 1)
    rows = []
    for stage, offload, remat in itertools.product(stages, offloads, remats):
        update_on = cfg.parallel.update_on if offload != "none" else "device"
        dtypes = [None] if remat_dtypes is None else remat_dtypes_of(remat, remat_dtypes)
        for dtype in dtypes:
            est = estimate_config(
                cfg,
                num_devices=devices,
                stage=stage,
                offload=offload,
                update_on=update_on,
                remat=remat,
                devices_per_process=per_process,
                frozen_params=frozen,
                remat_dtype=dtype,
            )
            host_acts = offloaded_activations(
                cfg.model,
                micro_batch=micro,
                remat=remat,
                precision=cfg.precision.params,
                remat_dtype=dtype,
            )
            row = Row(stage, offload, remat, update_on, est, host_acts, per_process)
            rows.append(dataclasses.replace(row, remat_dtype=dtype, **replaced))
    if measure != "always":
        return rows
    with tempfile.TemporaryDirectory(prefix="zeroflow-memory-") as scratch:
        compiler = Compiler(scratch, overlaps=True)
        where = places.target(target, devices) if target else places.local(devices)
        problem, note = ConfigProblem(cfg), attention_note(cfg, target)
        return [_measured(r, problem, compiler, where, note, log) for r in rows]


def runnable_attention(cfg, target: str | None) -> tuple:
    """``(cfg, row fields)``: where ``target``'s GPUs cannot run the config's cuDNN attention
    at its head dim, the config with XLA's attention and the fields saying so (``attention``,
    ``attention_why``), so the table answers with what runs; else ``cfg`` as given."""
    if target is None or cfg.model.attention != "cudnn":
        return cfg, {}
    refused = cudnn_refusal(head_dim(run_model_config(cfg)), places.target(target, 1))
    if refused is None:
        return cfg, {}
    note = f"{target}: {refused}; figured with model.attention=xla"
    return apply_overrides(cfg, ["model.attention=xla"]), {
        "attention": "xla",
        "attention_why": note,
    }


def _measured(row: Row, problem, compiler: Compiler, where, note: str, log) -> Row:
    """``row`` with the compile's figures, or the one-line reason it did not compile."""
    stage = row.stage
    if where.devices == 1:
        stage = first_equal_stage(stage, row.offload, row.update_on, problem.cfg.precision.params)
    choice = problem.own_choice(stage, row.offload, row.remat)
    choice = dataclasses.replace(choice, remat_dtype=row.remat_dtype)
    if log and (problem.key, where, choice) not in compiler.results:
        log(f"compiling stage {stage}, offload {row.offload}, remat {row.remat_label} ...")
    got = compiler.measure(problem, choice, where)
    if isinstance(got, str):
        return dataclasses.replace(row, note=got)
    step_ms = got.step_ms(compiler.rates, where)
    timing = None
    if step_ms is not None:
        mfu = problem.model_flops() / where.devices / (step_ms / 1e3) / where.peak_flops
        timing = {
            "step_ms": round(step_ms, 3),
            "exposed_ms": {k: round(v / 1e3, 3) for k, v in got.exposed_us.items()},
            "mfu": round(mfu, 4),
            "costed_by": got.costed_by(compiler.rates, where),
            "is_estimate": True,
        }
    return dataclasses.replace(
        row,
        measured_bytes=got.peak_bytes,
        note=note,
        overlap=got.overlap,
        measured_host_bytes=got.host_bytes,
        timing=timing,
    )


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
    collectives = any(((r.overlap or {}).get("total") or {}).get("count") for _, r in shown)
    timed = [r.timing for _, r in shown if r.timing is not None]
    exposed = any(t["exposed_ms"] for t in timed)
    columns = ["stage", "offload", "remat", "formula/dev", "XLA/dev", "host/process", "fits"]
    columns += ["overlapped collectives"] * collectives + ["est. step (XLA:GPU)"] * bool(timed)
    columns += ["exposed comm."] * exposed + ["est. MFU"] * bool(timed)
    for name in columns:
        table.add_column(name, justify="right" if "/" in name else "left")
    for stages, r in shown:
        measured = "-" if r.measured_bytes is None else format_bytes(r.measured_bytes)
        cells = [stages, r.offload, r.remat_label, format_bytes(r.estimate.device_bytes), measured]
        cells += [format_bytes(r.host_bytes), "yes" if r.need_bytes <= device_memory else "no"]
        if collectives:
            total = (r.overlap or {}).get("total", {})
            cells.append(f"{total['overlapped']}/{total['count']}" if total else "-")
        if timed:
            step, comm, mfu = _timing_cells(r.timing)
            cells += [step, *[comm] * exposed, mfu]
        table.add_row(*cells, style="bold green" if r is best else None)
    console.print(table)
    if len(shown) < len(merged):
        console.print(f"{len(merged) - len(shown)} more choices: --all lists every one")
    _render_notes(rows, bool(timed), console)
    console.print(_answer(best, device_memory))
    return best


def _merged(rows: Sequence[Row]) -> list[tuple[str, Row]]:
    """``(stages, row)``: rows that differ only in their stage (stages 0-2 on one device are
    the same program) said once, with their stages."""
    groups: dict = {}
    for r in rows:
        key = (r.offload, r.remat_label, r.need_bytes, r.host_bytes, r.note, repr(r.timing))
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
        f"model.remat={best.remat}"
        + (" model.remat_dtype=fp8" if best.remat_dtype == "fp8" else "")
        + (f" model.attention={best.attention}" if best.attention else "")
        + f" (needs {format_bytes(best.need_bytes)} per device)"
    )


STEP_MARK = {"xla": "", "xla-target": "~ ", "peak": "≥ "}
"How a step's loops were costed (``Measured.costed_by``), as the planner's table marks it."


def _timing_cells(timing: dict | None) -> list[str]:
    """(est. step, exposed comm., est. MFU). A step shorter than the model's FLOPs at the dense
    peak (XLA's cost model leaves custom calls such as cuDNN attention out) is shown as that
    bound; an MFU from a step with loops XLA did not cost (``~``/``≥``), or above 100%, as
    "-": the legend says why."""
    if timing is None:
        return ["-", "-", "-"]
    mark, step, mfu = STEP_MARK[timing["costed_by"]], timing["step_ms"], timing["mfu"]
    if mfu > 1:
        mark, step = "≥ ", step * mfu
    exposed = ", ".join(
        f"{k.replace('all-', '').replace('reduce-scatter', 'RS')} {v:.1f}"
        for k, v in timing["exposed_ms"].items()
    )
    shown = f"{step:.1f} ms" if step < 1e4 else f"{step / 1e3:,.0f} s"
    return [mark + shown, f"{exposed} ms" if exposed else "0", "-" if mark else f"{100 * mfu:.0f}%"]


def _render_notes(rows: Sequence[Row], with_timing: bool, console) -> None:
    """The lines under the table: what the columns are, each measured row's note once, and
    one line per reason a choice did not compile."""
    console.print(
        "formula: the ZeRO formula with the GPT's activation formula (no compile); XLA: the "
        "compiled step's peak, which decides what fits where it was compiled; host/process: "
        "XLA's host buffers per device (else the formula's) x the devices of a process"
    )
    if with_timing:
        console.print(
            "est. step: XLA:GPU's latency-hiding scheduler's estimate for the target (its cost "
            "model; nothing ran); exposed comm.: time it waits on collectives; est. MFU: model "
            "FLOPs / est. step / dense bf16 peak, '-' where XLA left loops uncosted (~: costed "
            "at its time per matmul flop elsewhere) or for a lower bound (≥: loops costed at the "
            "dense peak, or the model's FLOPs at the dense peak where XLA's estimate is below "
            "them: its cost model leaves custom calls such as cuDNN attention out)"
        )
    for why in sorted({r.attention_why for r in rows if r.attention_why}):  # once, not per row
        console.print(why)
    for note in sorted({r.note for r in rows if r.note and r.measured_bytes is not None}):
        console.print(f"measured: {note}")
    failed: dict = {}
    for stages, r in _merged(rows):
        if r.note and r.measured_bytes is None:
            failed.setdefault(r.note, []).append(f"{stages}/{r.offload}/{r.remat_label}")
    for reason, which in failed.items():
        more = f" and {len(which) - 2} more" if len(which) > 2 else ""
        console.print(f"did not compile ({', '.join(which[:2])}{more}): {reason}")
