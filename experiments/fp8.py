"""bf16 against FP8 for a Llama-shaped step at ZeRO stage 3, compiled for 8 x H100 by XLA:GPU
on a machine without them (``zf.target_mesh``).

The loss is ``experiments/llama_shapes.py``'s plain-JAX Llama (bf16 compute written into the
model, layers scanned under remat), the same as ``experiments/vs_gspmd.py``'s zeroflow rows.
Rows: bf16 (``Precision(params="bf16")``), FP8 matmuls (``autocast="fp8"``: the roofline of
``zeroflow.autocast.cost`` picks the matmuls), and FP8 matmuls with FP8 weight gathers
(``ZeroPlan(quantize_weights="fp8")``); the "fp8 delayed" variants scale from amax histories
in the train state (``Precision(fp8_scaling="delayed")``) instead. Per row: XLA:GPU's peak per
device, its *estimated* step (the latency-hiding scheduler's cost model,
``zeroflow.xla.schedule``; not a measurement), the GEMMs whose operands are float8 and the
flops and bytes of the GEMMs by kind (``zeroflow.autocast.fp8_hlo``; XLA's ``cost_analysis``
gives nothing for these deviceless compiles); each row's printed JSON also holds the GEMMs per
step, XLA's estimate per scheduled computation (the scanned layers' forward and backward
bodies) and the max-reductions per step. Then the tiny trainer config trained 300 steps in bf16
and in FP8 (every eligible matmul), the final losses side by side.

    python experiments/fp8.py                       # 8B shape, writes experiments/results/fp8.md
    python experiments/fp8.py --layers 4 --skip-train --remat full   # 4 8B-shaped layers
    python experiments/fp8.py --skip-train --remat dots,fp8_dots --tokens-per-device 8192 \
        --attention cudnn --state fp32,8bit --gspmd --out /tmp/fp8_8k.md
                 # 1 x 8192 tokens per device, cuDNN attention, 8-bit AdamW state too, and the
                 # plain-jit GSPMD baselines (bf16, and Flax's FP8 dot: experiments/gspmd_fp8.py)

Each compile runs in its own process, started with the scheduler's logging on.
"""
from __future__ import annotations

import argparse
import datetime
import json
import platform
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from child_rows import child_env, run_row
from zeroflow.cli.common import start_script

start_script()  # before jax: where the CUDA plugin has no driver, a CPU jax without its noise

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results" / "fp8.md"
SEQ = 2048
PER_DEVICE = {"1b": 2, "8b": 1}
VARIANTS = {
    "bf16": dict(autocast="none", quantize_weights=None),
    "bf16 autocast": dict(autocast="bf16", quantize_weights=None),
    "fp8": dict(autocast="fp8", quantize_weights=None),
    "fp8 + fp8 gathers": dict(autocast="fp8", quantize_weights="fp8"),
    "fp8 delayed": dict(autocast="fp8", quantize_weights=None, fp8_scaling="delayed"),
    "fp8 delayed + fp8 gathers": dict(autocast="fp8", quantize_weights="fp8",
                                      fp8_scaling="delayed"),
}
# The "delayed" variants scale each FP8 cast from the amax history the train state carries
# (zf.Precision(fp8_scaling="delayed"), as the train run "fp8 delayed"), not from the amax of
# the tensor being cast (current scaling, the other FP8 variants).


def compile_row(row: dict) -> dict:
    """One row, in this process (started with the logging on): compile and read."""
    import jax
    import jax.numpy as jnp
    import optax
    from gemm_steps import step_gemms
    from llama_shapes import SHAPES, abstract_params, num_params

    import zeroflow as zf
    from zeroflow.autocast.fp8_hlo import count_gemms
    from zeroflow.backend import accelerators
    from zeroflow.memory.measure import analysed
    from zeroflow.xla import schedule

    shape = dict(SHAPES[row["shape"]], layers=row["layers"])
    mesh = zf.target_mesh("h100", data=row["devices"])
    params = abstract_params(shape)
    sequences = row["devices"] * PER_DEVICE[row["shape"]]
    batch = {"tokens": jax.ShapeDtypeStruct((sequences, row.get("seq", SEQ) + 1), jnp.int32)}
    attention = row.get("attention", "xla")
    tx = zf.optim.adamw_8bit(1e-4) if row.get("state") == "8bit" else optax.adamw(1e-4)
    if row.get("system", "stage3") != "stage3":
        from gspmd_fp8 import compile_gspmd

        def compile_it():
            return compile_gspmd(row, shape, params, batch, tx, mesh)
    else:
        loss = row_loss(shape, row["remat"], head_scope=row.get("head", "bf16") == "bf16",
                        attention=attention)
        variant = VARIANTS[row["variant"]]
        plan = zf.ZeroPlan(mesh, stage=3, quantize_weights=variant["quantize_weights"])
        prec = zf.Precision(params="bf16", autocast=variant["autocast"],
                            reduce=row.get("reduce", "fp32"),
                            fp8_scaling=variant.get("fp8_scaling", "tensor"))

        extra = {}
        if row.get("zf_options"):  # an option set over zeroflow's own (xla_option_sets.py)
            from xla_option_sets import option_set

            extra = {"compiler_options": option_set(row["zf_options"])}

        def compile_it():
            return zf.memory.compile_step(loss, params, batch, tx, plan, prec, **extra)[0]
    start = time.time()
    with _attention_lowering(attention):
        peak = accelerators.required("h100").bf16_flops
        compiled, est = schedule.timed(compile_it, peak_flops=peak)
    text = compiled.as_text()
    gemms = count_gemms(text)
    return {**row, "compile_s": round(time.time() - start, 1), "params": num_params(shape),
            "peak_bytes": analysed(compiled).total_bytes, "step_ms": est.step_ms,
            "fp8_gemms": gemms.fp8, "other_gemms": gemms.other,
            "fp8_flops": gemms.fp8_flops, "other_flops": gemms.other_flops,
            "fp8_bytes": gemms.fp8_bytes, "other_bytes": gemms.other_bytes,
            "exposed_ms": {k: v / 1e3 for k, v in est.exposed_by_kind().items()},
            "gather_types": _gather_types(text), "step_gemms": step_gemms(text),
            "max_reduces": max_reduces_per_step(text),
            "computations": [{"name": c.name, "trips": c.trips, "us": round(c.total_us, 1),
                              "exposed_us": {k: round(v, 1) for k, v in c.wasted_us.items()}}
                             for c in est.computations]}


def max_reduces_per_step(text: str) -> float:
    """Max-reductions (``reduce`` with a ``maximum`` combiner: the amaxes of FP8 scaling, and
    any other max) the compiled program runs per step, each counted as often as the
    computation holding it runs (a scanned layer's once per layer)."""
    from gemm_steps import runs_per_step

    from zeroflow.autocast.fp8_hlo import _computations

    bodies = _computations(text)
    combiners = {name for name, lines in bodies.items()
                 if sum(" = " in ln for ln in lines) == 3
                 and any(" maximum(" in ln for ln in lines)}
    runs = runs_per_step(text)
    total = 0.0
    for name, lines in bodies.items():
        for line in lines:
            combiner = re.search(r" reduce\(.*\bto_apply=%?([\w.\-]+)", line)
            if combiner and combiner[1] in combiners:
                total += runs.get(name, 0.0)
    return total


def _attention_lowering(attention: str):
    """cuDNN attention lowers for the abstract H100 without a local cuDNN inside this block."""
    import contextlib

    from zeroflow.util.compat import cudnn_for_target

    return cudnn_for_target() if attention == "cudnn" else contextlib.nullcontext()


def row_loss(shape: dict, remat: str, head_scope: bool = True, attention: str = "xla"):
    """``llama_shapes.make_loss``'s loss, with the head's matmul in the name scope ``lm_head``
    (``head_scope``: as zeroflow's GPT names it, so autocast's FP8 keeps it in bf16 by default,
    ``AutocastPolicy.fp8_keep_scopes``) and remat "fp8_dots": "dots" keeping its matmul outputs
    in FP8 (each layer under ``zeroflow.autocast.fp8_saved.checkpoint_fp8_dots``: e4m3 bytes
    and a per-tensor scale saved instead of the bf16 outputs). ``attention``:
    ``jax.nn.dot_product_attention``'s implementation ("xla" or "cudnn")."""
    import jax
    import jax.numpy as jnp
    import optax
    from llama_shapes import POLICIES, _layer, _rms_norm

    from zeroflow.autocast.fp8_saved import checkpoint_fp8_dots

    def layer(x, p):
        return _layer(shape, jnp.bfloat16, x, p, attention=attention)

    if remat == "fp8_dots":
        body = checkpoint_fp8_dots(layer)
    else:
        body = jax.checkpoint(layer, policy=POLICIES[remat])

    def loss(params, batch):
        tokens = batch["tokens"]
        x = params["embed"].astype(jnp.bfloat16)[tokens[:, :-1]]
        x, _ = jax.lax.scan(body, x, params["layers"])
        x = _rms_norm(x, params["norm"].astype(jnp.bfloat16))
        with jax.named_scope("lm_head" if head_scope else "head"):
            logits = (x @ params["head"].astype(jnp.bfloat16)).astype(jnp.float32)
        return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()
    return loss


def _gather_types(text: str) -> list[str]:
    """Element types the compiled program's all-gathers return (the token ids included)."""
    found = set()
    for line in text.splitlines():
        op = re.search(r"=\s*(.*?)\s+all-gather(?:-done)?\(", line)
        if op:
            found.update(re.findall(r"(\w+)\[", op[1]))
    return sorted(found)


def run_child(payload: dict, timeout: float) -> dict:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--row", json.dumps(payload)]
    env = {**child_env(), "JAX_ENABLE_COMPILATION_CACHE": "false"}
    return run_row(cmd, env, payload, timeout, note_width=200)


TRAIN_RUNS = {
    "bf16": ["precision.autocast=bf16"],
    "fp8": ["precision.autocast=fp8", "precision.fp8_select=all"],
    "fp8 delayed": ["precision.autocast=fp8", "precision.fp8_select=all",
                    "precision.fp8_scaling=delayed"],
    "bf16 + fp8 saved activations": ["precision.autocast=bf16", "model.remat=save_dots",
                                    "model.remat_dtype=fp8"],
}
"The tiny config's runs: bf16 autocast, every eligible matmul in FP8, and bf16 matmuls whose"
" saved matmul outputs (remat save_dots) are kept in FP8."


def train_tiny(steps: int, runs: list[str]) -> dict:
    """The tiny config ``steps`` steps for each of ``runs`` (``TRAIN_RUNS``): the mean
    training loss over the last 20 logged steps and the last held-out loss of each."""
    out = {}
    for name in runs:
        # A fresh folder per run: the trainer resumes a run folder it finds, so a fixed one
        # would report an earlier invocation's (finished) run instead of training this one.
        run_dir = Path(tempfile.mkdtemp(prefix="zeroflow-fp8-tiny-" + re.sub(r"\W+", "-", name)
                                        + "-"))
        cmd = [sys.executable, "-m", "zeroflow.train", "--config", "configs/tiny.yaml",
               *TRAIN_RUNS[name], f"train.steps={steps}", "train.log_every=1",
               f"run.dir={run_dir}", "run.tensorboard=false"]
        start = time.time()
        try:
            subprocess.run(cmd, cwd=HERE.parent, check=True, capture_output=True)
            metrics = (run_dir / "metrics.jsonl").read_text()
        finally:
            shutil.rmtree(run_dir, ignore_errors=True)
        rows = [json.loads(line) for line in metrics.splitlines()]
        train = [r["loss"] for r in rows if "loss" in r]
        evals = [r["eval_loss"] for r in rows if "eval_loss" in r]
        out[name] = {"final": sum(train[-20:]) / len(train[-20:]),
                     "last": train[-1], "val": evals[-1] if evals else None,
                     "wall_s": round(time.time() - start)}
    return out


def long_rows(seqs: list[int], search: bool) -> None:
    """Llama-3.1-8B on one H100 (``experiments/long_context.py``'s config: stage 3, state and
    layer inputs offloaded, remat offload_input) with the layer inputs in bf16 and in FP8
    (``model.remat_dtype``): device peak and host memory per row length; ``search``: the
    longest row within 80 GB with FP8 layer inputs, bisected as ``long_context.py search``."""
    import long_context as lc

    def probe(dtype):
        return lc.probe_config(lc.config([f"model.remat_dtype={dtype}"]), devices=1,
                               target="h100")

    print("| layer inputs | sequence | device peak GB | host GB |\n|---|---:|---:|---:|")
    for seq in seqs:
        for dtype in ("compute", "fp8"):
            got = probe(dtype)(seq)
            print(f"| {'bf16' if dtype == 'compute' else 'fp8'} | {seq:,} | "
                  f"{(got.peak_bytes or 0) / 1e9:.2f} | {(got.host_bytes or 0) / 1e9:.1f} |",
                  flush=True)
    if search:
        found = lc.longest_fitting(probe("fp8"), 80e9, start=524288, granule=16384,
                                   limit=1 << 26, max_compiles=9)
        best, over = found.best, found.first_too_long
        print(f"longest with FP8 layer inputs: {best.seq:,} ({best.peak_bytes / 1e9:.2f} GB); "
              f"{over.seq:,} needs {over.peak_bytes / 1e9:.2f} GB; {len(found.probes)} compiles")


def _variant(row: dict) -> str:
    if row.get("system", "stage3") != "stage3":
        return f"GSPMD FSDP annotated ({row['options']}), {row['variant']}"
    head = row.get("head", "fp8")  # rows from before the choice had the head in FP8
    fp8 = VARIANTS[row["variant"]]["autocast"] == "fp8"
    state = ", 8-bit AdamW state" if row.get("state") == "8bit" else ""
    reduce = ", bf16 reduction" if row.get("reduce") == "bf16" else ""
    options = f", XLA options +{row['zf_options']}" if row.get("zf_options") else ""
    return row["variant"] + (f", head {head}" if fp8 else "") + state + reduce + options


def _shape(row: dict) -> str:
    """The shape, with the tokens per device and the attention where not the defaults."""
    seq, attention = row.get("seq", SEQ), row.get("attention", "xla")
    if seq == SEQ and attention == "xla":
        return row["shape"]
    return f"{row['shape']}, {PER_DEVICE[row['shape']]} x {seq} tokens, {attention} attention"


def _exposed(row: dict) -> str:
    return ", ".join(f"{k} {v:.1f} ms" for k, v in row["exposed_ms"].items()) or "none"


def write_report(rows: list[dict], tiny: dict | None, command: str, out: Path = RESULTS) -> None:
    lines = ["# FP8 against bf16: Llama-shaped step at ZeRO stage 3 on 8 x H100 (XLA:GPU, compiled "
             "without the GPUs)", "",
             f"Machine: {platform.node() or 'development container'} ({platform.machine()}), "
             f"CPU-only, compiling for abstract H100s; date {datetime.date.today()}; "
             f"command: `{command}`.", "",
             "| shape | layers | remat | variant | peak / device | est. step | exposed collectives "
             "| FP8 GEMMs (flops, bytes) | other GEMMs (flops, bytes) | all-gathered types "
             "| compile |",
             "|---|---:|---|---|---:|---:|---|---|---|---|---:|"]
    for r in rows:
        if "note" in r:
            lines.append(f"| {_shape(r)} | {r['layers']} | {r['remat']} | {_variant(r)} | "
                         f"{r['note']} | | | | | | | |")
            continue
        lines.append(
            f"| {_shape(r)} | {r['layers']} | {r['remat']} | {_variant(r)} | "
            f"{r['peak_bytes'] / 1e9:.2f} GB | {r['step_ms']:.1f} ms | {_exposed(r)} | "
            f"{r['fp8_gemms']} ({r['fp8_flops'] / 1e12:.2f} TF, {r['fp8_bytes'] / 1e9:.2f} GB) | "
            f"{r['other_gemms']} ({r['other_flops'] / 1e12:.2f} TF, "
            f"{r['other_bytes'] / 1e9:.2f} GB) | {', '.join(r['gather_types'])} | "
            f"{r['compile_s']:.0f} s |")
    if tiny:
        lines += ["", "## Tiny config trained in bf16 and FP8", "",
                  "| run | mean loss, last 20 logged steps | last step | held-out | wall |",
                  "|---|---:|---:|---:|---:|"]
        for name, t in tiny.items():
            val = "-" if t["val"] is None else f"{t['val']:.4f}"
            lines.append(f"| {name} | {t['final']:.4f} | {t['last']:.4f} | {val} | "
                         f"{t['wall_s']} s |")
        if "bf16" in tiny:
            base = tiny["bf16"]["final"]
            lines.append("")
            lines += [f"{name}: final loss {abs(t['final'] - base) / base:.2%} from bf16's."
                      for name, t in tiny.items() if name != "bf16"]
    out.parent.mkdir(exist_ok=True)
    out.write_text("\n".join(lines) + "\n")


def _bad_input(args) -> str | None:
    """One line naming a setting the compile rows cannot take, or None."""
    for name, given, allowed in (("--remat", args.remat, ("full", "dots", "fp8_dots")),
                                 ("--variants", args.variants, tuple(VARIANTS)),
                                 ("--state", args.state, ("fp32", "8bit"))):
        unknown = [x for x in given.split(",") if x not in allowed]
        if unknown:
            return f"{name}: unknown {', '.join(unknown)}; accepted: {', '.join(allowed)}"
    tokens = args.tokens_per_device.split(",")
    if not all(t.isdigit() and int(t) % PER_DEVICE[args.shape] == 0 and int(t) > 0
               for t in tokens):
        return (f"--tokens-per-device: {args.tokens_per_device!r}; accepted: positive whole "
                f"numbers divisible by {PER_DEVICE[args.shape]} (sequences per device)")
    return None


def planned_rows(args, layers: int) -> list[dict]:
    """The compile rows the arguments ask for: per tokens per device, remat, variant and
    optimizer state, zeroflow stage 3; with ``--gspmd`` the plain-jit GSPMD FSDP rows too
    (activations annotated, bf16 and Flax's FP8 dot; remat full and dots only)."""
    rows = []
    for tokens in (int(t) for t in args.tokens_per_device.split(",")):
        seq = tokens // PER_DEVICE[args.shape]
        base = dict(shape=args.shape, layers=layers, devices=8, seq=seq,
                    attention=args.attention)
        for remat in args.remat.split(","):
            extra = {"zf_options": args.zf_options} if args.zf_options else {}
            rows += [{**base, "remat": remat, "variant": variant, "state": state,
                      "reduce": args.reduce, "head": "fp8" if args.head_fp8 else "bf16", **extra}
                     for variant in args.variants.split(",") for state in args.state.split(",")]
            if args.gspmd and remat in ("full", "dots"):
                rows += [{**base, "remat": remat, "system": system, "variant": variant,
                          "options": args.gspmd_options}
                         for system, variant in (("gspmd", "bf16"), ("gspmd", "flax fp8"))]
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--row", help=argparse.SUPPRESS)
    parser.add_argument("--shape", default="8b", choices=sorted(PER_DEVICE))
    parser.add_argument("--layers", type=int, default=0, help="layers (0: the shape's own)")
    parser.add_argument("--remat", default="full,dots,fp8_dots",
                        help="comma-separated: full, dots, fp8_dots (dots kept in FP8)")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--timeout", type=float, default=3600)
    parser.add_argument("--head-fp8", action="store_true",
                        help="the head's matmul in FP8 too (no lm_head scope)")
    parser.add_argument("--tokens-per-device", default=str(SEQ),
                        help="comma-separated tokens per device and step (the 8B shape: one "
                             "sequence of this length per device; default %(default)s)")
    parser.add_argument("--attention", default="xla", choices=("xla", "cudnn"),
                        help="jax.nn.dot_product_attention's implementation")
    parser.add_argument("--state", default="fp32",
                        help="comma-separated optimizer states: fp32 (optax.adamw), 8bit "
                             "(zf.optim.adamw_8bit: blockwise 8-bit moments)")
    parser.add_argument("--reduce", default="fp32", choices=("fp32", "bf16"),
                        help="what zeroflow's rows sum gradients over devices in "
                             "(zf.Precision.reduce; the GSPMD rows sum in bf16 as written)")
    parser.add_argument("--gspmd", action="store_true",
                        help="also the plain-jit GSPMD FSDP step, activations annotated, in "
                             "bf16 and with Flax's FP8 dot (remat full and dots)")
    parser.add_argument("--gspmd-options", default="recipe-triton+2",
                        help="the XLA option set of the GSPMD rows "
                             "(experiments/xla_option_sets.py; default %(default)s)")
    parser.add_argument("--zf-options", default="",
                        help="an XLA option set of experiments/xla_option_sets.py given to "
                             "zeroflow's rows over zeroflow's own options (e.g. rs: "
                             "reduce-scatters pipelined across loop iterations)")
    parser.add_argument("--skip-train", action="store_true")
    parser.add_argument("--skip-compile", action="store_true", help="only the tiny runs")
    parser.add_argument("--long-rows", default="",
                        help="comma-separated row lengths: Llama-3.1-8B on one H100 with bf16 "
                             "and FP8 layer inputs (nothing else runs)")
    parser.add_argument("--long-search", action="store_true",
                        help="with --long-rows: the longest row with FP8 layer inputs")
    parser.add_argument("--out", type=Path, default=RESULTS, help="the report (default: %(default)s)")
    parser.add_argument("--train-steps", type=int, default=300)
    parser.add_argument("--train-runs", default=",".join(TRAIN_RUNS),
                        help="comma-separated, of: " + ", ".join(TRAIN_RUNS))
    args = parser.parse_args(argv)
    if args.row:
        print(json.dumps(compile_row(json.loads(args.row))))
        return 0
    problem = _bad_input(args)
    if problem:
        print(problem, file=sys.stderr)
        return 2
    if args.long_rows:
        long_rows([int(n) for n in args.long_rows.split(",")], args.long_search)
        return 0
    from llama_shapes import SHAPES

    layers = args.layers or SHAPES[args.shape]["layers"]
    rows = []
    for payload in [] if args.skip_compile else planned_rows(args, layers):
        rows.append(run_child(payload, args.timeout))
        print(json.dumps(rows[-1]), flush=True)
    tiny = None if args.skip_train else train_tiny(args.train_steps, args.train_runs.split(","))
    write_report(rows, tiny, "python experiments/fp8.py " + shlex.join(argv or sys.argv[1:]),
                 args.out)
    print(args.out.read_text())
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(HERE))
    sys.exit(main())
