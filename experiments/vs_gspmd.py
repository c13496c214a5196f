"""zeroflow against what a JAX user writes instead: plain ``jax.jit`` GSPMD FSDP, and DDP.

One plain-JAX Llama-shaped loss (``experiments/llama_shapes.py``) through
(a) GSPMD FSDP: ``jax.jit`` of loss + grad + AdamW with every parameter and optimizer-state
    leaf sharded over ``data`` on its largest divisible dimension, the batch sharded, the state
    donated: as the model is written (no annotations, XLA's default options), and as a
    MaxText user runs it (every activation constrained to batch sharding,
    ``llama_shapes.batch_constraint``) under each XLA option set of
    ``experiments/xla_option_sets.py`` (``--plain-sets``), the fastest being the baseline;
(b) DDP: the same step with everything replicated;
(c) zeroflow stages 0-3 (``zf.memory.compile_step``), and ZeRO++ options at stage 3;
with cuDNN attention (``jax.nn.dot_product_attention(implementation="cudnn")``) too for the
shapes of ``--cudnn-shapes``;
each compiled for abstract GPUs (``zf.target_mesh``: 8 x H100, 8 x A100) by XLA:GPU, on a
machine without them. Per row: XLA:GPU's peak per device (``memory_analysis``), its ratio to
the ZeRO paper's model-state formula, XLA:GPU's *estimated* step time (its latency-hiding
scheduler's cost model, ``zeroflow.xla.schedule``; not a measurement), exposed time per
collective kind, how many all-gathers / reduce-scatters have compute beside them, and the
estimated MFU (6 x parameters x tokens / step / the GPU's dense bf16 peak; attention's own
flops are left out). Then the tiny shape actually run on 8 emulated CPU devices: zeroflow
stage 3 against GSPMD FSDP, steps alternating, the ratio of medians and the losses' agreement.

    python experiments/vs_gspmd.py                 # writes experiments/results/vs_gspmd.md
    python experiments/vs_gspmd.py --quick         # 1B shape, H100, remat full only
    python experiments/vs_gspmd.py --plain-sets zeroflow,recipe-triton+2 --zeroflow-sets ""
                                                   # only the 2 sets fastest at 1B, remat full

Every compile runs in its own process started with the scheduler's logging on (XLA reads it
at start-up), so a crash or an out-of-memory compile is one row's note.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import sys
import time
from pathlib import Path

from child_rows import child_env, run_row
from zeroflow.cli.common import start_script

start_script()  # before jax: where the CUDA plugin has no driver, a CPU jax without its noise

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results" / "vs_gspmd.md"
SEQ = 2048
DATE = "2026-11-27"
"When this version's rows were compiled (rows a --resume keeps from an earlier run say theirs)."
PER_DEVICE = {"1b": 2, "8b": 1, "70b": 1}
"Sequences of SEQ tokens per device and step."
TIMED_TARGETS = ("h100",)
"""Targets whose step XLA:GPU's scheduler models in microseconds (its analytical model of
Hopper); for an A100 target it uses a coarser estimator (the plain jit steps print no statistics
and zeroflow's come out 7-10x the H100's), so those rows give peak and overlap only."""
ZEROPP = {"qwZ": {"quantize_weights": "int8"}, "qgZ": {"quantize_grads": "int8"},
          "hpZ": {"hierarchical": True}}


def fsdp_spec(shape, devices: int, replicate: bool):
    """GSPMD FSDP's sharding of one leaf: its largest dimension that divides by ``devices``."""
    from jax.sharding import PartitionSpec as P

    dims = [i for i, n in enumerate(shape) if n % devices == 0]
    if replicate or not dims:
        return P()
    split = max(dims, key=lambda i: shape[i])
    return P(*["data" if i == split else None for i in range(len(shape))])


def compile_plain(loss, params, batch, tx, mesh, replicate: bool, options: dict | None = None):
    """The plain ``jax.jit`` step (GSPMD FSDP, or DDP with ``replicate``), compiled with the XLA
    ``options``."""
    import jax
    import optax
    from jax.sharding import NamedSharding, PartitionSpec as P

    devices = mesh.shape["data"]

    def shard(tree):
        return jax.tree.map(lambda x: NamedSharding(mesh, fsdp_spec(x.shape, devices, replicate)),
                            tree)

    def step(state, batch):
        p, opt = state
        value, grads = jax.value_and_grad(loss)(p, batch)
        updates, opt = tx.update(grads, opt, p)
        return (optax.apply_updates(p, updates), opt), value

    opt = jax.eval_shape(tx.init, params)
    shardings = (shard(params), shard(opt))
    jitted = jax.jit(step, in_shardings=(shardings, NamedSharding(mesh, P("data"))),
                     out_shardings=(shardings, NamedSharding(mesh, P())), donate_argnums=0)
    return jitted.lower((params, opt), batch).compile(options or None)


def formula_bytes(system: str, psi: int, n: int) -> float:
    """The ZeRO paper's model states per device (bf16 weights and gradients, fp32 master and
    Adam moments: K = 12)."""
    if system in ("ddp", "stage0"):
        return 16 * psi
    if system == "stage1":
        return 4 * psi + 12 * psi / n
    if system == "stage2":
        return 2 * psi + 14 * psi / n
    return 16 * psi / n


def compile_row(row: dict) -> dict:
    """One row, in this process (started with the logging on): compile and read."""
    import jax
    import jax.numpy as jnp
    import optax

    import zeroflow as zf
    from llama_shapes import SHAPES, abstract_params, batch_constraint, make_loss, num_params
    from xla_option_sets import option_set
    from zeroflow import backend
    from zeroflow.backend import accelerators
    from zeroflow.xla import schedule
    from zeroflow.memory.measure import analysed
    from zeroflow.util.compat import cudnn_for_target

    shape = SHAPES[row["shape"]]
    mesh = zf.target_mesh(row["target"], data=row["devices"], hosts=row.get("hosts", 1))
    params = abstract_params(shape)
    batch = {"tokens": jax.ShapeDtypeStruct((row["devices"] * PER_DEVICE[row["shape"]], SEQ + 1),
                                            jnp.int32)}
    constrain = batch_constraint(mesh) if row.get("annotated") else None
    loss = make_loss(shape, row["remat"], constrain=constrain,
                     attention=row.get("attention", "xla"))
    tx = optax.adamw(1e-4)
    system, start = row["system"], time.time()
    if system in ("gspmd", "ddp"):
        options = option_set(row.get("options") or "default", backend.of(mesh))

        def compile_it():
            return compile_plain(loss, params, batch, tx, mesh, system == "ddp", options)
    else:
        plan = zf.ZeroPlan(mesh, stage=int(system[-1]), **ZEROPP.get(row.get("zeropp"), {}))
        prec = zf.Precision(params="bf16", master="fp32", reduce=row.get("reduce", "fp32"))
        extra = option_set(row["options"]) if row.get("options") else None

        def compile_it():
            return zf.memory.compile_step(loss, params, batch, tx, plan, prec,
                                          compiler_options=extra)[0]
    if row.get("attention") == "cudnn":  # lowered for the target's cuDNN without a local one
        plain_compile = compile_it

        def compile_it():
            with cudnn_for_target():
                return plain_compile()
    if row["target"] not in TIMED_TARGETS:
        return _untimed(row, compile_it(), shape, start)
    peak_flops = accelerators.required(row["target"]).bf16_flops
    compiled, est = schedule.timed(compile_it, peak_flops=peak_flops)
    psi, n = num_params(shape), row["devices"]
    peak = analysed(compiled).total_bytes
    flops = 6 * psi * PER_DEVICE[row["shape"]] * SEQ
    total = zf.memory.overlap(zf.memory.collectives(compiled))["total"]
    return {**row, "date": DATE, "compile_s": round(time.time() - start, 1), "params": psi,
            "peak_bytes": peak,
            "formula_bytes": formula_bytes(system, psi, n), "step_ms": est.step_ms,
            "exposed_ms": {k: v / 1e3 for k, v in est.exposed_by_kind().items()},
            "overlapped": f"{total['overlapped']}/{total['count']}",
            "mfu": est.mfu(flops, peak_flops), "uncosted": list(est.uncosted),
            "costed_by_flops": {c.name: c.costed_by for c in est.computations
                                if c.costed_by != "xla"},
            "by_computation": [[c.name, c.trips, round(c.total_us * c.trips / 1e3, 2),
                                round(sum(c.wasted_us.values()) * c.trips / 1e3, 2)]
                               for c in est.computations]}


def _untimed(row: dict, compiled, shape: dict, start: float) -> dict:
    """A row for a target whose schedule XLA does not model in microseconds: peak and overlap."""
    import zeroflow as zf
    from llama_shapes import num_params
    from zeroflow.memory.measure import analysed

    total = zf.memory.overlap(zf.memory.collectives(compiled))["total"]
    psi = num_params(shape)
    return {**row, "compile_s": round(time.time() - start, 1), "params": psi,
            "peak_bytes": analysed(compiled).total_bytes,
            "formula_bytes": formula_bytes(row["system"], psi, row["devices"]),
            "overlapped": f"{total['overlapped']}/{total['count']}"}


def run_cpu(steps: int = 8) -> dict:
    """The tiny shape on 8 emulated CPU devices: zeroflow stage 3 and GSPMD FSDP from the same
    parameters and batch, losses compared step by step, then steps timed alternately."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from jax.sharding import NamedSharding, PartitionSpec as P

    import zeroflow as zf
    from llama_shapes import SHAPES, init_params, make_loss

    shape, tx = SHAPES["tiny"], optax.adamw(1e-3)
    loss = make_loss(shape, "full")
    mesh = zf.make_mesh(data=8, model=1)
    tokens = jax.random.randint(jax.random.key(1), (16, 129), 0, shape["vocab"], jnp.int32)
    batch = {"tokens": jax.device_put(tokens, NamedSharding(mesh, P("data")))}
    plan = zf.ZeroPlan(mesh, stage=3)
    zf_step = zf.make_train_step(loss, tx, plan, zf.Precision(params="bf16", master="fp32"))
    zf_state = zf.init_train_state(init_params(shape), tx, plan,
                                   zf.Precision(params="bf16", master="fp32"))
    plain = jax.jit(lambda s, b: _plain_step(loss, tx, s, b), donate_argnums=0)
    params = init_params(shape)
    spec = lambda x: NamedSharding(mesh, fsdp_spec(x.shape, 8, False))  # noqa: E731
    plain_state = jax.device_put((params, tx.init(params)),
                                 jax.tree.map(spec, (params, tx.init(params))))
    losses, times = {"zeroflow": [], "gspmd": []}, {"zeroflow": [], "gspmd": []}
    for i in range(steps + 2):
        for name in ("zeroflow", "gspmd"):
            start = time.perf_counter()
            if name == "zeroflow":
                zf_state, metrics = zf_step(zf_state, batch)
                value = float(metrics["loss"])
            else:
                plain_state, value = plain(plain_state, batch)
                value = float(value)
            if i >= 2:  # the first two compile and warm up
                times[name].append(time.perf_counter() - start)
            losses[name].append(value)
    diff = float(np.max(np.abs(np.array(losses["zeroflow"]) - np.array(losses["gspmd"]))))
    med = {k: float(np.median(v)) for k, v in times.items()}
    return {"median_s": med, "ratio": med["zeroflow"] / med["gspmd"], "steps": steps,
            "losses": losses, "max_loss_diff": diff}


def _plain_step(loss, tx, state, batch):
    import jax
    import optax

    params, opt = state
    value, grads = jax.value_and_grad(loss)(params, batch)
    updates, opt = tx.update(grads, opt, params)
    return (optax.apply_updates(params, updates), opt), value


def plan_rows(args) -> list[dict]:
    rows = []
    for target in args.targets:
        for shape in args.shapes:
            for remat in args.remats:
                base = {"target": target, "shape": shape, "remat": remat, "devices": 8}
                rows += _written_rows(base)
                if target in TIMED_TARGETS:
                    rows += _tuned_rows(base, args)
                if target in TIMED_TARGETS and shape in args.cudnn_shapes:
                    cudnn = {**base, "attention": "cudnn"}
                    rows += [{**cudnn, "system": s} for s in ("gspmd", "ddp", "stage2", "stage3")]
                    rows.append({**cudnn, "system": "stage3", "reduce": "bf16"})
                    rows += _tuned_rows(cudnn, args)
    if args.with_70b:
        base = {"target": "h100", "shape": "70b", "remat": "full", "devices": 16, "hosts": 2}
        rows += [{**base, "system": s} for s in ("gspmd", "stage3")]
    return rows


def _written_rows(base: dict) -> list[dict]:
    """The model as written (no activation annotations), XLA's default options for the plain
    jit steps and zeroflow's own for zeroflow: DDP, stages 0-3, ZeRO++."""
    target, shape, remat = base["target"], base["shape"], base["remat"]
    systems = ["gspmd", "ddp", "stage2", "stage3"]
    if target == "h100" and (shape == "1b" or remat == "full"):
        systems[2:2] = ["stage0", "stage1"]
    rows = [{**base, "system": s} for s in systems]
    # Gradients summed in bf16, as the plain jit program sums them
    rows += [{**base, "system": s, "reduce": "bf16"} for s in ("stage2", "stage3")]
    if target == "h100" and remat == "full":
        rows += [{**base, "system": "stage3", "zeropp": z} for z in ("qwZ", "qgZ")]
        rows.append({**base, "system": "stage3", "zeropp": "hpZ", "hosts": 2})
    return rows


def _tuned_rows(base: dict, args) -> list[dict]:
    """The strongest baseline: GSPMD FSDP with its activations constrained to batch sharding
    (as MaxText's logical axis rules do), under each XLA option set of ``--plain-sets``; zeroflow
    stages 2 and 3 under each set of ``--zeroflow-sets`` added to its own options."""
    rows = [{**base, "system": "gspmd", "annotated": True, "options": o} for o in args.plain_sets]
    rows += [{**base, "system": s, "options": o} for o in args.zeroflow_sets
             for s in ("stage2", "stage3")]
    return rows


def run_child(payload: dict, mode: str, timeout: float) -> dict:
    """One compile (or the CPU run) in a fresh process; its failure becomes the row's note."""
    cmd = [sys.executable, str(Path(__file__).resolve()), f"--{mode}", json.dumps(payload)]
    env = child_env()
    if mode == "cpu":
        env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8")
        env.pop("TF_CPP_VMODULE", None)
        env["TF_CPP_MIN_LOG_LEVEL"] = "1"
    return run_row(cmd, env, payload, timeout, note_width=160)


def _label(row: dict) -> str:
    names = {"gspmd": "plain jit GSPMD FSDP", "ddp": "plain jit DDP (replicated)"}
    label = names.get(row["system"], f"zeroflow stage {row['system'][-1]}")
    if row.get("annotated"):
        label += ", activations annotated"
    if row.get("options"):
        label += f", XLA options {row['options']}"
    if row.get("zeropp"):
        label += f" + {row['zeropp']}" + (f" ({row['hosts']} hosts)" if row.get("hosts") else "")
    if row.get("reduce"):
        label += f", {row['reduce']} reduction"
    if "peak_bytes" in row and not row.get("date"):
        label += " (2026-11-25 run)"
    return label


def _groups(rows: list[dict]) -> dict:
    """Rows by target x shape x remat x devices x attention, in order."""
    groups: dict = {}
    for row in rows:
        key = (row["target"], row["shape"], row["remat"], row["devices"],
               row.get("attention", "xla"))
        groups.setdefault(key, []).append(row)
    return groups


def _best(group: list[dict], **match) -> dict | None:
    """The row of ``group`` with the shortest estimated step among those matching ``match``
    (a key given as None matches a row without it)."""
    timed = [r for r in group if "step_ms" in r
             and all(r.get(k) == v for k, v in match.items())]
    return min(timed, key=lambda r: r["step_ms"]) if timed else None


def tuned_gspmd(group: list[dict]) -> dict | None:
    """The strongest plain-jit baseline of a group: activations annotated, best option set."""
    return _best(group, system="gspmd", annotated=True)


def table_lines(rows: list[dict]) -> list[str]:
    """Markdown, one table per target x shape x remat x attention, with each step relative to
    GSPMD's as written and to the annotated, tuned GSPMD's."""
    out = []
    for (target, shape, remat, devices, attention), group in _groups(rows).items():
        gspmd = _best(group, system="gspmd", annotated=None)
        tuned = tuned_gspmd(group)
        out += ["", f"### {shape}, remat {remat}, {attention} attention, {devices} x "
                f"{target.upper()} ({PER_DEVICE[shape]} x {SEQ} tokens per device)", "",
                "| system | peak / device | / ZeRO formula | est. step (x GSPMD as written) | "
                "x tuned annotated GSPMD (peak, step) | exposed collectives, ms | "
                "overlapped AG+RS | est. MFU | compile |",
                "|---|---|---|---|---|---|---|---|---|"]
        for r in group:
            out.append(_table_row(r, gspmd, tuned))
    return out


def _table_row(r: dict, gspmd: dict | None, tuned: dict | None) -> str:
    if "peak_bytes" not in r:
        return f"| {_label(r)} | {r.get('note', '-')} | | | | | | | |"
    if "step_ms" not in r:
        return (f"| {_label(r)} | {r['peak_bytes'] / 1e9:.2f} GB | "
                f"{r['peak_bytes'] / r['formula_bytes']:.2f}x | n/a | n/a | n/a | "
                f"{r['overlapped']} | n/a | {r['compile_s']:.0f} s |")
    rel = f" ({r['step_ms'] / gspmd['step_ms']:.2f}x)" if gspmd else ""
    how = set(r.get("costed_by_flops", {}).values())
    mark = ">= " if "peak-flops" in how or (r["uncosted"] and not how) else ("~ " if how else "")
    rel = mark + f"{r['step_ms']:.1f} ms{rel}"
    vs_tuned = (f"{r['peak_bytes'] / tuned['peak_bytes']:.2f}x, "
                f"{r['step_ms'] / tuned['step_ms']:.2f}x") if tuned else "-"
    exposed = ", ".join(f"{k} {v:.1f}" for k, v in r["exposed_ms"].items()) or "0"
    return (f"| {_label(r)} | {r['peak_bytes'] / 1e9:.2f} GB | "
            f"{r['peak_bytes'] / r['formula_bytes']:.2f}x | {rel} | {vs_tuned} | "
            f"{exposed} | {r['overlapped']} | {100 * r['mfu']:.1f}% | {r['compile_s']:.0f} s |")


def _ms(row: dict | None) -> str:
    return f"{row['step_ms']:.0f} ms" if row else "-"


def summary_lines(rows: list[dict]) -> list[str]:
    """One line per timed group: GSPMD as written, the tuned annotated GSPMD, zeroflow stage 3
    (its best option set) with both ratios, and stage 2 against DDP."""
    out = ["| shape, remat, attention | GSPMD FSDP as written | GSPMD FSDP annotated + best "
           "options | zeroflow stage 3 | stage 3 / as written (peak, step) | stage 3 / "
           "annotated tuned (peak, step) | stage 3 bf16 reduction / annotated tuned | "
           "DDP step | stage 2 step |", "|---|---|---|---|---|---|---|---|---|"]
    for (_, shape, remat, _, attention), group in _groups(rows).items():
        written, tuned = _best(group, system="gspmd", annotated=None), tuned_gspmd(group)
        stage3 = _best(group, system="stage3", zeropp=None, reduce=None)
        bf16 = _best(group, system="stage3", zeropp=None, reduce="bf16")
        ddp, stage2 = _best(group, system="ddp"), _best(group, system="stage2", reduce=None)
        if not (tuned and stage3):
            continue

        def cell(r):
            return f"{r['peak_bytes'] / 1e9:.2f} GB / {r['step_ms']:.0f} ms" if r else "-"

        def ratio(r, base):
            if not (r and base):
                return "-"
            return (f"{r['peak_bytes'] / base['peak_bytes']:.2f}x / "
                    f"{r['step_ms'] / base['step_ms']:.2f}x")
        out.append(f"| {shape}, {remat}, {attention} | {cell(written)} | {cell(tuned)} "
                   f"({tuned.get('options')}) | {cell(stage3)} ({stage3.get('options') or 'own'}) "
                   f"| {ratio(stage3, written)} | **{ratio(stage3, tuned)}** | "
                   f"{ratio(bf16, tuned)} | {_ms(ddp)} | {_ms(stage2)} |")
    return out


def write_report(rows: list[dict], cpu: dict | None, command: str, path: Path) -> None:
    import jax

    lines = ["# zeroflow vs plain `jax.jit` GSPMD FSDP and DDP, compiled for 8 GPUs without them",
             "", f"Machine: {platform.machine()} CPU, {os.cpu_count()} cores, no GPU; "
             f"{DATE}; jax {jax.__version__} with jax-cuda12-plugin (XLA:GPU compiles for "
             f"`zf.target_mesh`); command: `{command}`.", "",
             "Peak: XLA:GPU's `memory_analysis()` per device (arguments + outputs + temporaries "
             "- aliased). ZeRO formula: 16 Psi/N (stage 3, FSDP), 2 Psi + 14 Psi/N (stage 2), "
             "4 Psi + 12 Psi/N (stage 1), 16 Psi (DDP, stage 0). **Est. step is XLA:GPU's "
             "latency-hiding scheduler's estimate for the target (its analytical cost model, "
             "nothing ran, no autotuning), not a measurement**; exposed: time its schedule "
             "waits on a collective, per kind; overlapped AG+RS: all-gathers and "
             "reduce-scatters with a kernel between start and done. Est. MFU: 6 x parameters "
             "x tokens / est. step / dense bf16 peak (H100 SXM 989 TFLOPS, A100 SXM 312); "
             "attention's QK^T and PV flops are excluded. AdamW, bf16 compute, fp32 master. "
             "Loops XLA printed no statistics for (no asynchronous collective inside) are "
             "costed from their matmul flops at the time per flop "
             "XLA's model gave the same program's costed loops (~), or, where no loop is "
             "costed, at the dense peak (>=, a lower bound). The loops are listed below "
             "the tables.",
             "", "ZeRO++ rows: qwZ = int8 weight gathers, qgZ = int8 two-hop gradient "
             "reduction, hpZ = a bf16 weight copy per host (2 hosts x 4 GPUs here).", "",
             "A100 rows give peak and overlap only: for an A100 target XLA:GPU schedules with "
             "a coarser latency estimator (the plain jit steps print no statistics, zeroflow's "
             "come out 7-10x the H100's), so no step time is read there."]
    lines += ["", "## Summary (8 x H100, XLA:GPU's estimates)", "",
              "GSPMD FSDP annotated + best options: the plain jit step with every activation "
              "constrained to batch sharding (MaxText's logical axis rules under FSDP) and the "
              "XLA option set (`experiments/xla_option_sets.py`) that gives it the shortest "
              "estimated step; zeroflow stage 3: its shortest row with fp32 gradient reduction and "
              "no ZeRO++ (its own options, or its own with the options both systems share "
              "where that row was compiled; the set is in brackets). Each cell: peak per "
              "device / estimated step.", "", *summary_lines(rows)]
    lines += table_lines(rows)
    uncosted = [f"- {r['shape']} {r['remat']} {r['target']} {_label(r)}: {', '.join(r['uncosted'])}"
                for r in rows if r.get("uncosted")]
    if uncosted:
        lines += ["", "Loops without statistics (left out of the estimate):", *uncosted]
    if cpu is not None:
        lines += ["", "## Run on 8 emulated CPU devices (tiny shape, 16 x 128 tokens)", ""]
        if "ratio" in cpu:
            lines += [f"zeroflow stage 3 / GSPMD FSDP, median of {cpu['steps']} steps each, "
                      f"alternating: **{cpu['ratio']:.2f}x** ({cpu['median_s']['zeroflow'] * 1e3:.1f}"
                      f" ms vs {cpu['median_s']['gspmd'] * 1e3:.1f} ms); losses over "
                      f"{len(cpu['losses']['gspmd'])} steps from the same parameters agree within "
                      f"{cpu['max_loss_diff']:.1e} (first {cpu['losses']['gspmd'][0]:.4f}, last "
                      f"{cpu['losses']['gspmd'][-1]:.4f} / {cpu['losses']['zeroflow'][-1]:.4f}). "
                      "The CPU runs the program XLA:CPU makes: it says nothing about the GPU's."]
        else:
            lines.append(f"failed: {cpu.get('note')}")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")
    path.with_suffix(".json").write_text(json.dumps({"rows": rows, "cpu": cpu}, indent=1) + "\n")


def _progress(i: int, total: int, row: dict) -> str:
    head = f"[{i}/{total}] {row['target']} {row['shape']} {row['remat']:4s} {_label(row):34s}"
    if "peak_bytes" not in row:
        return f"{head} {row.get('note')}"
    if "step_ms" not in row:
        return f"{head} peak {row['peak_bytes'] / 1e9:6.2f} GB (no step estimate for this target)"
    return (f"{head} peak {row['peak_bytes'] / 1e9:6.2f} GB ({row['peak_bytes'] / row['formula_bytes']:.2f}x)"
            f"  est. step {row['step_ms']:7.1f} ms  MFU {100 * row['mfu']:4.1f}%  "
            f"({row['compile_s']:.0f} s)")


def _key(row: dict) -> tuple:
    return tuple(row.get(k) for k in ("target", "shape", "remat", "devices", "system", "zeropp",
                                      "reduce", "annotated", "options", "attention"))


def _previous(out: Path) -> dict:
    """The rows (and CPU run) an earlier run wrote, by row, that compiled."""
    path = out.with_suffix(".json")
    if not path.exists():
        return {}
    saved = json.loads(path.read_text())
    done = {_key(r): r for r in saved["rows"]
            if "step_ms" in r or ("peak_bytes" in r and r["target"] not in TIMED_TARGETS)}
    if saved.get("cpu") and "ratio" in saved["cpu"]:
        done["cpu"] = saved["cpu"]
    return done


def main(argv=None) -> int:
    from xla_option_sets import PLAIN_SETS

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--targets", default="h100,a100")
    parser.add_argument("--shapes", default="1b,8b")
    parser.add_argument("--remats", default="full,dots")
    parser.add_argument("--with-70b", action="store_true", help="Llama-3-70B shape on 2 x 8 H100")
    parser.add_argument("--quick", action="store_true", help="1B shape, H100, remat full")
    parser.add_argument("--plain-sets", default=",".join(PLAIN_SETS),
                        help="XLA option sets (experiments/xla_option_sets.py) the annotated "
                             "GSPMD step is compiled with; its best is the baseline")
    parser.add_argument("--zeroflow-sets", default="shared",
                        help="option sets added to zeroflow's own for stages 2 and 3 ('' none)")
    parser.add_argument("--cudnn-shapes", default="8b",
                        help="shapes that get cuDNN attention rows too (H100 targets)")
    parser.add_argument("--no-cpu", action="store_true", help="skip the emulated-CPU run")
    parser.add_argument("--timeout", type=float, default=900, help="seconds per compile")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--resume", action="store_true",
                        help="keep the rows an earlier run wrote to --out's .json")
    parser.add_argument("--row", help=argparse.SUPPRESS)
    parser.add_argument("--cpu", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.row:
        print(json.dumps(compile_row(json.loads(args.row))))
        return 0
    if args.cpu:
        print(json.dumps(run_cpu()))
        return 0
    from zeroflow.xla import schedule

    schedule.drop_info_lines()  # jax's start-up INFO lines, in this process too
    if args.quick:
        args.targets, args.shapes, args.remats = "h100", "1b", "full"
    args.targets, args.shapes, args.remats, args.cudnn_shapes = (
        a.split(",") for a in (args.targets, args.shapes, args.remats, args.cudnn_shapes))
    args.plain_sets, args.zeroflow_sets = (
        [x for x in a.split(",") if x] for a in (args.plain_sets, args.zeroflow_sets))
    command = "python experiments/vs_gspmd.py" + "".join(
        f" {shlex.quote(a)}" for a in (argv or sys.argv[1:]) if a != "--resume")
    todo, rows, cpu = plan_rows(args), [], None
    done = _previous(args.out) if args.resume else {}
    if not args.no_cpu:
        cpu = done.get("cpu") or run_child({}, "cpu", args.timeout)
        print(f"8 emulated CPU devices: stage 3 / GSPMD {cpu.get('ratio', float('nan')):.2f}x, "
              f"losses within {cpu.get('max_loss_diff', float('nan')):.1e} {cpu.get('note', '')}")
    for i, row in enumerate(todo, 1):
        rows.append(done.get(_key(row)) or run_child(row, "row", args.timeout))
        print(_progress(i, len(todo), rows[-1]), flush=True)
        # the rows still to come that an earlier run has, so that stopping here loses none
        kept = [done[_key(r)] for r in todo[i:] if _key(r) in done]
        write_report(rows + kept, cpu, command, args.out)
    write_report(rows, cpu, command, args.out)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
