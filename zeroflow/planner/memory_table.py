"""``python -m zeroflow.memory``'s table, a view of the planner's core: one row per ZeRO stage x
offload x remat of a trainer config, each a planner ``Candidate`` (``zeroflow.planner.search``)
of the config's own plan with that stage, offload and remat: the what-if's formula figures, the
instant estimate of its step where it can be traced here (``zf.memory.estimate_traced``, no
compile) and, where compiled (small configs on emulated CPU devices, always for a GPU target),
the planner's compile of it (``zeroflow.planner.compiling``). ``zeroflow.cli.memory`` parses
the flags.

"Cheapest" ranks choices by their usual cost in step time: no offload before offload
(PCIe traffic), then remat none < save_dots < offload_dots (activations over PCIe) < full
(recompute) < offload_input (recompute, and the layer inputs over PCIe), then a lower stage
(stage 3 adds an all-gather per use). A choice fits when its peak is at most the device
memory: XLA's compiled peak where it was compiled, else the traced step's, else the formula's.
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
from zeroflow.memory.estimate import OFFLOADS, REMATS, STAGES, format_bytes
from zeroflow.models.gpt import head_dim
from zeroflow.models.spec import count_gpt_params
from zeroflow.planner import where as places
from zeroflow.planner.choices import first_equal_stage, remat_dtypes_of
from zeroflow.planner.compiling import Compiler, failure_reason
from zeroflow.planner.library import cudnn_refusal
from zeroflow.planner.problems import ConfigProblem
from zeroflow.planner.results import STEP_MARK, grouped_failures
from zeroflow.planner.search import FAILED, Candidate
from zeroflow.planner.whatif import what_if
from zeroflow.trainer.planning import attention_note
from zeroflow.trainer.setup import run_model_config
from zeroflow.util.units import parse_bytes

MEASURE_MAX_PARAMS = 50_000_000
"'--measure auto' compiles only models up to this many parameters..."
MEASURE_MAX_DEVICES = 16
"... and only meshes up to this many devices (CPU compile time grows with both)."
REMAT_COST = {"none": 0, "save_dots": 1, "offload_dots": 2, "full": 3, "offload_input": 4}


@dataclasses.dataclass
class Table:
    """The rows of one config on one device count, and what they are read against."""

    title: str
    device_memory: float
    problem: ConfigProblem
    where: places.Where
    per_process: int
    "Devices sharing a host process (its pinned host memory)."
    rows: list[Candidate] = dataclasses.field(default_factory=list)
    compiler: Compiler | None = None
    attention_why: str = ""
    "Why the target's GPUs cannot run the config's cuDNN attention, where XLA's is figured."
    traced: dict = dataclasses.field(default_factory=dict)
    "Choice -> its step's instant estimate (``StepEstimate``), or why it did not trace."

    def instant(self, c: Candidate) -> float | None:
        """The peak per device of the row's traced step (no compile), where it was traced."""
        got = self.traced.get(c.choice)
        return None if got is None or isinstance(got, str) else got.peak_bytes

    def need(self, c: Candidate) -> float:
        """XLA's compiled peak, else the traced step's, else the formula's."""
        if c.measured is not None:
            return c.measured.peak_bytes
        instant = self.instant(c)
        return c.what_if.predicted_bytes if instant is None else instant

    def host(self, c: Candidate) -> float:
        return c.host_bytes(self.per_process)

    def fits(self, c: Candidate) -> bool:
        return self.need(c) <= self.device_memory

    def step(self, c: Candidate) -> tuple[float | None, str, float | None]:
        """``(ms, costed by, MFU)`` of XLA:GPU's estimate (``Measured.step``)."""
        if c.measured is None or self.compiler is None:
            return None, "what-if", None
        return c.measured.step(self.compiler.rates, self.where, self.problem.model_flops())

    def note(self, c: Candidate) -> str:
        """Why the row did not compile, or what its compile measured (the attention)."""
        return c.reason or (attention_note(self.problem.cfg, self.target) if c.measured else "")

    @property
    def target(self) -> str | None:
        return None if self.where.local else self.where.name

    def cheapest(self) -> Candidate | None:
        return min(filter(self.fits, self.rows), key=cost, default=None)

    def as_json(self, c: Candidate) -> dict:
        ch, w, got, instant = c.choice, c.what_if, c.measured, self.instant(c)
        ms, costed, mfu = self.step(c)
        formula = dict(
            model_states=w.model_states, activations=w.activations, update=w.update_bytes
        )
        timing = (
            got
            and ms is not None
            and {
                "step_ms": round(ms, 3),
                "exposed_ms": {k: round(v / 1e3, 3) for k, v in got.exposed_us.items()},
                "mfu": None if mfu is None else round(mfu, 4),
                "costed_by": costed,
                "is_estimate": True,
            }
        )
        out = {k: getattr(ch, k) for k in ("stage", "offload", "update_on", "remat", "remat_dtype")}
        out |= {"attention": self.attention_why and "xla", "attention_why": self.attention_why}
        out |= {
            "estimated_peak_bytes": round(w.predicted_bytes),
            "instant_peak_bytes": None if instant is None else round(instant),
            "measured_peak_bytes": got and round(got.peak_bytes),
            "measured_host_bytes": got and round(got.host_bytes),
            "host_bytes_per_process": round(self.host(c)),
            "formula": {k: round(v) for k, v in formula.items()},
            "overlap": got and got.overlap,
            "estimated_step": timing,
            "note": self.note(c),
        }
        out = {k: v for k, v in out.items() if v or k not in OPTIONAL_JSON}
        target = {"target": self.target} if self.target else {}
        return {**out, "fits": self.fits(c), "device_memory_bytes": self.device_memory, **target}


OPTIONAL_JSON = {"remat_dtype", "attention", "attention_why", "overlap", "estimated_step", "note"}
"Keys of a JSON row left out where they say nothing."


def cost(c: Candidate) -> tuple:
    """FP8 residuals rank right after the same remat in the compute dtype: about as fast, but
    their gradients are approximate."""
    ch = c.choice
    return (OFFLOADS.index(ch.offload), REMAT_COST[str(ch.remat)], ch.fp8_residuals(), ch.stage)


def remat_label(c: Candidate) -> str:
    return f"{c.choice.remat}{' fp8' if c.choice.fp8_residuals() else ''}"


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
    params = count_gpt_params(cfg.model)
    title = f"{name}: {params:,} params, batch {cfg.train.batch_size}, {cfg.precision.params}, "
    return devices, device_memory or parse_bytes("80GB"), title + where


def build(
    cfg,
    *,
    devices: int,
    device_memory: float | None = None,
    title: str = "",
    stages=STAGES,
    offloads=OFFLOADS,
    remats=REMATS,
    measure: str = "auto",
    devices_per_process: int | None = None,
    log=None,
    target: str | None = None,
    remat_dtypes: Sequence[str] | None = None,
    instant: bool = True,
) -> Table:
    """One row per choice with the what-if's figures and, where compiled (``measure``), the
    planner's compile of it (for ``target``'s abstract GPUs XLA:GPU's peak and step estimate;
    offloaded choices through CPU stand-ins). On one device a stage that makes the engine's
    decisions of a lower one is that stage's compile. ``remat_dtypes``: each remat in each of
    these dtypes where it applies (FP8 only where the policy saves something); None: the
    config's ``model.remat_dtype``. ``instant``: trace each row's step for its instant
    estimate too, where ``measure`` is not 'never' and the mesh's devices are here."""
    cfg, why = runnable_attention(cfg, target)
    problem = ConfigProblem(cfg)
    trace = instant and measure != "never"
    if measure == "auto":
        small = problem.spec.num_params <= MEASURE_MAX_PARAMS
        few = devices * cfg.parallel.model <= MEASURE_MAX_DEVICES
        measure = "always" if target is not None or (small and few) else "never"
    where = (
        places.target(target, devices)
        if target
        else places.local(devices, int(device_memory) if device_memory else None)
    )
    per_process = devices_per_process or min(devices, 8)
    table = Table(title, device_memory or where.memory_bytes, problem, where, per_process)
    table.attention_why = why
    for stage, offload, remat in itertools.product(stages, offloads, remats):
        dtypes = [None] if remat_dtypes is None else remat_dtypes_of(remat, remat_dtypes)
        for dtype in dtypes:
            choice = dataclasses.replace(
                problem.own_choice(stage, offload, remat), remat_dtype=dtype
            )
            table.rows.append(Candidate(choice, what_if(problem, choice, where, per_process)))
    if trace and _traceable(table):
        _trace(table, log)
    if measure == "always":
        with tempfile.TemporaryDirectory(prefix="zeroflow-memory-") as scratch:
            table.compiler = Compiler(scratch, overlaps=True)
            for c in table.rows:
                _measure(table, c, log)
    return table


def runnable_attention(cfg, target: str | None) -> tuple:
    """``(cfg, why)``: where ``target``'s GPUs cannot run the config's cuDNN attention at its
    head dim, the config with XLA's attention and the line saying so, so the table answers with
    what runs; else ``(cfg, "")``."""
    if target is None or cfg.model.attention != "cudnn":
        return cfg, ""
    refused = cudnn_refusal(head_dim(run_model_config(cfg)), places.target(target, 1))
    if refused is None:
        return cfg, ""
    note = f"{target}: {refused}; figured with model.attention=xla"
    return apply_overrides(cfg, ["model.attention=xla"]), note


def _traceable(table: Table) -> bool:
    """Whether the rows' steps can be traced here: a target's abstract GPUs, or as many of
    this machine's devices as the mesh holds."""
    import jax

    par = table.problem.cfg.parallel
    return table.target is not None or (
        jax.device_count() >= table.where.devices * par.model * par.context
    )


def _trace(table: Table, log) -> None:
    """Each row's instant estimate: its step traced (``zf.memory.estimate_traced``), or the
    one-line reason it did not trace."""
    if log:
        log(f"tracing {len(table.rows)} choices (the instant estimate, no compile) ...")
    for c in table.rows:
        choice = _program_of(table, c.choice)
        if choice not in table.traced:
            try:
                table.traced[choice] = table.problem.trace(choice, table.where)
            except Exception as e:  # a step that cannot trace is a row with its reason
                table.traced[choice] = failure_reason(e)
        table.traced[c.choice] = table.traced[choice]


def _program_of(table: Table, choice):
    """``choice``, or on one device the lowest stage whose program it is."""
    if table.where.devices > 1:
        return choice
    stage = first_equal_stage(
        choice.stage, choice.offload, choice.update_on, table.problem.spec.precision
    )
    return dataclasses.replace(choice, stage=stage)


def _measure(table: Table, c: Candidate, log) -> None:
    """Compile ``c``'s plan (on one device, the lowest stage with its program): its figures,
    or the one-line reason it did not compile."""
    compiler = table.compiler
    assert compiler is not None
    choice, where = _program_of(table, c.choice), table.where
    if log and (table.problem.key, where, choice) not in compiler.results:
        log(f"compiling stage {choice.stage}, offload {choice.offload}, remat {remat_label(c)} ...")
    c.record(compiler.measure(table.problem, choice, where))


def show(table: Table, *, as_json: bool, show_all: bool) -> None:
    """The table, or with ``as_json`` one JSON object per row."""
    if not as_json:
        render(table, show_all=show_all)
    for c in table.rows if as_json else ():
        print(json.dumps(table.as_json(c)))


def render(table: Table, console=None, show_all: bool = False) -> Candidate | None:
    """The table (by default the cheapest choice that fits and, per offload kind, its own
    cheapest fit or else its smallest need; every choice with ``show_all``), rows that differ
    only in stage said once, then one line per reason a compile failed, then the answer."""
    from rich.console import Console
    from rich.table import Table as Grid

    console = console or Console(width=max(Console().width, 150))
    best = table.cheapest()
    merged = _merged(table)
    shown = merged if show_all else _compact(table, merged, best)
    console.print(table.title)
    grid = Grid()
    overlaps = [((c.measured.overlap or {}).get("total") or {}) for _, c in shown if c.measured]
    collectives = any(total.get("count") for total in overlaps)
    timed = [c for _, c in shown if table.step(c)[0] is not None]
    exposed = any(c.measured and c.measured.exposed_us for c in timed)
    first = "instant/dev" if table.traced else "formula/dev"
    columns = ["stage", "offload", "remat", first, "XLA/dev", "host/process", "fits"]
    columns += ["overlapped collectives"] * collectives + ["est. step (XLA:GPU)"] * bool(timed)
    columns += ["exposed comm."] * exposed + ["est. MFU"] * bool(timed)
    for name in columns:
        grid.add_column(name, justify="right" if "/" in name else "left")
    for stages, c in shown:
        got = c.measured
        cells = [stages, c.choice.offload, remat_label(c), _first_cell(table, c)]
        cells += ["-" if got is None else format_bytes(got.peak_bytes)]
        cells += [format_bytes(table.host(c)), "yes" if table.fits(c) else "no"]
        if collectives:
            total = ((got and got.overlap) or {}).get("total", {})
            cells.append(f"{total['overlapped']}/{total['count']}" if total else "-")
        if timed:
            step, comm, mfu = _timing_cells(table, c)
            cells += [step, *[comm] * exposed, mfu]
        grid.add_row(*cells, style="bold green" if c is best else None)
    console.print(grid)
    if len(shown) < len(merged):
        console.print(f"{len(merged) - len(shown)} more choices: --all lists every one")
    for line in _notes(table, bool(timed)):
        console.print(line)
    console.print(_answer(table, best))
    return best


def _first_cell(table: Table, c: Candidate) -> str:
    """The instant figure: the traced step's peak where the table traced its rows ("-" for a
    row that did not trace), else the formula's."""
    if not table.traced:
        return format_bytes(c.what_if.predicted_bytes)
    instant = table.instant(c)
    return "-" if instant is None else format_bytes(instant)


def _merged(table: Table) -> list[tuple[str, Candidate]]:
    """``(stages, row)``: rows that differ only in their stage (stages 0-2 on one device are
    the same program) said once, with their stages."""
    groups: dict = {}
    for c in table.rows:
        shown = (_first_cell(table, c), table.host(c), table.note(c), table.step(c))
        groups.setdefault((c.choice.offload, remat_label(c), table.need(c), *shown), []).append(c)
    out = []
    for same in groups.values():
        stages = [c.choice.stage for c in same]
        label = f"{stages[0]}-{stages[-1]}" if len(stages) > 2 else ",".join(map(str, stages))
        out.append((label, same[0]))
    return out


def _compact(table: Table, merged, best: Candidate | None) -> list[tuple[str, Candidate]]:
    """The cheapest fit, and per offload kind its cheapest fit, else its smallest need."""
    keep = []
    for offload in OFFLOADS:
        kind = [(s, c) for s, c in merged if c.choice.offload == offload]
        fitting = [(s, c) for s, c in kind if table.fits(c)]
        if fitting:
            keep.append(min(fitting, key=lambda sc: cost(sc[1])))
        elif kind:
            keep.append(min(kind, key=lambda sc: table.need(sc[1])))
    if best is not None and all(c is not best for _, c in keep):
        keep.insert(0, next(sc for sc in merged if sc[1] is best))
    return sorted(keep, key=lambda sc: cost(sc[1]))


def _answer(table: Table, best: Candidate | None) -> str:
    memory = format_bytes(table.device_memory)
    if best is None:
        return (
            f"Nothing fits in {memory} per device; add devices, "
            "shrink train.batch_size or raise parallel.grad_accum."
        )
    ch = best.choice
    return (
        f"Cheapest choice that fits in {memory}: parallel.zero_stage={ch.stage} "
        f"parallel.offload={ch.offload} model.remat={ch.remat}"
        + (" model.remat_dtype=fp8" if ch.fp8_residuals() else "")
        + (" model.attention=xla" if table.attention_why else "")
        + f" (needs {format_bytes(table.need(best))} per device)"
    )


def _timing_cells(table: Table, c: Candidate) -> list[str]:
    """(est. step, exposed comm., est. MFU). A step shorter than the model's FLOPs at the dense
    peak is shown as that bound (``Measured.step``); an MFU from a step with loops XLA did not
    cost (``~``/``≥``) as "-": the legend says why."""
    ms, costed, mfu = table.step(c)
    if ms is None or c.measured is None:
        return ["-", "-", "-"]
    exposed = ", ".join(
        f"{k.replace('all-', '').replace('reduce-scatter', 'RS')} {v / 1e3:.1f}"
        for k, v in c.measured.exposed_us.items()
    )
    shown = f"{ms:.1f} ms" if ms < 1e4 else f"{ms / 1e3:,.0f} s"
    mfu_cell = "-" if costed != "xla" or mfu is None else f"{100 * mfu:.0f}%"
    return [STEP_MARK[costed] + shown, f"{exposed} ms" if exposed else "0", mfu_cell]


def _notes(table: Table, with_timing: bool) -> list[str]:
    """The lines under the table: what the columns are, what the compiles measured, once,
    and one line per reason a choice did not compile."""
    first = (
        "instant: the step's peak from its traced program (zf.memory.estimate_traced: the state, "
        "what the backward pass saves, the largest temporary; no compile), which decides what "
        "fits where nothing was compiled"
        if table.traced
        else "formula: the ZeRO formula with the GPT's activation formula (no compile)"
    )
    out = [
        f"{first}; XLA: the compiled step's peak, which decides what fits where it was compiled; "
        "host/process: XLA's host buffers per device (else the formula's) x the devices of a "
        "process"
    ]
    if with_timing:
        out.append(
            "est. step: XLA:GPU's latency-hiding scheduler's estimate for the target (its cost "
            "model; nothing ran); exposed comm.: time it waits on collectives; est. MFU: model "
            "FLOPs / est. step / dense bf16 peak, '-' where XLA left loops uncosted (~: costed "
            "at its time per matmul flop elsewhere) or for a lower bound (≥: loops costed at the "
            "dense peak, or the model's FLOPs at the dense peak where XLA's estimate is below "
            "them: its cost model leaves custom calls such as cuDNN attention out)"
        )
    out += [table.attention_why] if table.attention_why else []
    measured = {table.note(c) for c in table.rows if c.measured and table.note(c)}
    out += [f"measured: {note}" for note in sorted(measured)]
    failed = [
        (c.reason, f"{s}/{c.choice.offload}/{remat_label(c)}")
        for s, c in _merged(table)
        if c.status == FAILED
    ]
    untraced = [
        (got, f"{s}/{c.choice.offload}/{remat_label(c)}")
        for s, c in _merged(table)
        if isinstance(got := table.traced.get(c.choice), str)
    ]
    out += [f"did not trace ({which}): {why}" for why, which in grouped_failures(untraced, 2)]
    return out + [f"did not compile ({which}): {why}" for why, which in grouped_failures(failed, 2)]
