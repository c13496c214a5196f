"""Llama-3.1-8B full fine-tuning (AdamW) at long sequences on H100s that are not there: XLA:GPU's
peak per device, the host memory, the longest sequence that fits, and XLA's estimated speed.

    python experiments/long_context.py peaks     # the peak table at fixed lengths
    python experiments/long_context.py search    # the longest sequence, 1 and 8 x H100
    python experiments/long_context.py speed     # XLA's step estimate at 256K on 8 x H100
    python experiments/long_context.py chunked   # one H100, model.layer_chunk: peaks, longest row

The step is the trainer's (``configs/long-context-llama3-8b.yaml``: ZeRO stage 3, the fp32
master, Adam moments and bf16 weights in pinned host memory and streamed one layer at a time,
each layer's input kept on the host (``remat: offload_input``), the loss in 4096 x 16384 tiles,
the MLP in 8192-position chunks, cuDNN attention), compiled deviceless by XLA:GPU for
``zf.target_mesh("h100", ...)``. On 8 x H100 the sequence is split over ``parallel.context=8``
with the ring of key/value blocks and the Pallas flash kernel in each step (the overrides in
``EIGHT``); the optimizer update runs on the devices there (``update_on: device``), as XLA:GPU
does not compile the host update across 8 devices (see the results). Nothing runs: peaks are
XLA's memory analysis, times its latency-hiding scheduler's cost model. Prints markdown.
"""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # the CUDA plugin describes targets only then
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()  # CPU devices stand in for the GPUs while the offloaded step is planned

from zeroflow.cli.common import start_script  # noqa: E402

start_script()  # before jax: where the CUDA plugin has no driver, a CPU jax without its noise

from zeroflow.xla import schedule  # its logging must be on before jax starts

schedule.enable()

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

from zeroflow.backend import accelerators  # noqa: E402
from zeroflow.cli.max_seq import probe_config  # noqa: E402
from zeroflow.config.io import load_config  # noqa: E402
from zeroflow.memory.max_seq import longest_fitting  # noqa: E402
from zeroflow.trainer.planning import compile_config  # noqa: E402
from zeroflow.trainer.setup import run_model_config  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "configs/long-context-llama3-8b.yaml"
EIGHT = (
    "parallel.context=8",
    "model.attention=pallas",
    "model.context_attention=ring",
    "parallel.update_on=device",
)
"What the 8 x H100 runs change: the sequence split 8 ways, the ring with the flash kernel."
GB = 1e9


def config(overrides=()):
    cfg = load_config(CONFIG, list(overrides))
    return dataclasses.replace(cfg, model=run_model_config(cfg))  # config.json's architecture


def peak_row(name: str, overrides, seq: int) -> str:
    start = time.perf_counter()
    got = probe_config(config(overrides), devices=1, target="h100")(seq)
    gpus = 8 if overrides else 1
    if got.peak_bytes is None:
        return f"| {name} | {seq:,} | - | - | - | {got.note} |"
    host = got.host_bytes or 0
    return (
        f"| {name} | {seq:,} | {seq // gpus:,} | {got.peak_bytes / GB:.2f} | {host / GB:.1f} | "
        f"{host * gpus / GB:.1f} | {time.perf_counter() - start:.0f} |"
    )


def peaks() -> None:
    print(
        "| GPUs | sequence | tokens per GPU | device peak GB | host GB per GPU | "
        "host GB per node | compile s |\n|---|---:|---:|---:|---:|---:|---:|"
    )
    for seq in (131072, 262144, 524288):
        print(peak_row("1 x H100", (), seq), flush=True)
    for seq in (1048576, 2097152, 4194304):
        print(peak_row("8 x H100, context 8", EIGHT, seq), flush=True)


def search(device_memory: float, max_compiles: int) -> None:
    for name, overrides, start, step in (
        ("1 x H100", (), 524288, 16384),
        ("8 x H100, context 8", EIGHT, 4194304, 131072),
    ):
        print(f"{name}:", file=sys.stderr, flush=True)
        found = longest_fitting(
            probe_config(config(overrides), devices=1, target="h100"),
            device_memory,
            start=start,
            granule=step,
            limit=1 << 26,
            max_compiles=max_compiles,
            log=lambda p, left: print(f"  {p}", file=sys.stderr, flush=True),
        )
        best, over = found.best, found.first_too_long
        print(
            f"| {name} | {'-' if best is None else f'{best.seq:,}'} | "
            f"{'-' if best is None else f'{(best.peak_bytes or 0) / GB:.2f}'} | "
            f"{'-' if over is None else f'{over.seq:,} ({(over.peak_bytes or 0) / GB:.2f} GB)'} | "
            f"{len(found.probes)} |",
            flush=True,
        )


CHUNKED = {
    "fp8": ("model.remat_dtype=fp8",),
    "bf16": (),
}
"The layer inputs the chunked-layer runs keep on the host: e4m3 bytes, or the compute dtype."


def chunked(inputs: str, chunk: int, rows, device_memory: float, max_compiles: int) -> None:
    """One H100 with ``model.layer_chunk=chunk`` and the layer inputs ``inputs``: the peak at
    each of ``rows``, then (``max_compiles`` > 0) the longest row, bisected in 16,384-token
    steps from the last of ``rows``."""
    overrides = (*CHUNKED[inputs], f"model.layer_chunk={chunk}")
    probe = probe_config(config(overrides), devices=1, target="h100")
    print("| layer inputs | layer_chunk | sequence | device peak GB | host GB |")
    print("|---|---:|---:|---:|---:|")
    for seq in rows:
        got = probe(seq)
        peak = "-" if got.peak_bytes is None else f"{got.peak_bytes / GB:.2f}"
        print(f"| {inputs} | {chunk:,} | {seq:,} | {peak} | {(got.host_bytes or 0) / GB:.1f} |")
    if max_compiles:
        found = longest_fitting(
            probe,
            device_memory,
            start=rows[-1],
            granule=16384,
            limit=1 << 26,
            max_compiles=max_compiles,
            log=lambda p, left: print(f"  {p}", file=sys.stderr, flush=True),
        )
        best, over = found.best, found.first_too_long
        print(
            f"\nlongest row within {device_memory / GB:.0f} GB: "
            f"{'-' if best is None else f'{best.seq:,} ({(best.peak_bytes or 0) / GB:.2f} GB, '}"
            f"{'' if best is None else f'host {(best.host_bytes or 0) / GB:.1f} GB)'}; first too "
            f"long: {'-' if over is None else f'{over.seq:,} ({(over.peak_bytes or 0) / GB:.2f} GB)'}"
            f"; {len(found.probes)} compiles",
            flush=True,
        )


def speed(seq: int) -> None:
    cfg = config(EIGHT + (f"model.seq_len={seq}",))
    par = cfg.parallel
    (compiled, _), est = schedule.timed(
        lambda: compile_config(
            cfg,
            num_devices=1,
            stage=par.zero_stage,
            offload=par.offload,
            update_on=par.update_on,
            remat=cfg.model.remat,
            target="h100",
        ),
        text_of=lambda result: result[0].as_text(),
        peak_flops=accelerators.required("h100").bf16_flops,
    )
    by_flops = {c.name: c.costed_by for c in est.computations if c.costed_by != "xla"}
    print(
        f"8 x H100, context 8, {seq:,} tokens per step: XLA:GPU's estimated step "
        f"{est.step_ms / 1e3:.2f} s = {seq / (est.step_ms / 1e3) / 8:,.0f} tokens/s per GPU "
        f"(estimate, not a measurement); exposed collectives "
        f"{ {k: round(v / 1e3, 1) for k, v in est.exposed_by_kind().items()} } ms; loops "
        f"XLA printed nothing for, costed by their flops: {by_flops or 'none'}; "
        f"uncosted: {list(est.uncosted) or 'none'}"
    )


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("part", choices=("peaks", "search", "speed", "chunked"))
    parser.add_argument("--device-memory", type=float, default=80e9, help="bytes per GPU")
    parser.add_argument("--max-compiles", type=int, default=7)
    parser.add_argument("--speed-seq", type=int, default=262144)
    parser.add_argument(
        "--inputs",
        choices=tuple(CHUNKED),
        default="fp8",
        help="chunked: the layer inputs on the host, e4m3 or bf16",
    )
    parser.add_argument("--layer-chunk", type=int, default=8192, help="chunked: model.layer_chunk")
    parser.add_argument(
        "--rows",
        default="1212416",
        help="chunked: comma-separated row lengths to compile (the search starts from the last)",
    )
    args = parser.parse_args(argv)
    if args.part == "chunked":
        rows = [int(n) for n in args.rows.split(",")]
        chunked(args.inputs, args.layer_chunk, rows, args.device_memory, args.max_compiles)
        return
    if args.part == "peaks":
        peaks()
    elif args.part == "search":
        print(
            "| GPUs | longest sequence | its peak GB | first too long | compiles |\n"
            "|---|---:|---:|---|---:|"
        )
        search(args.device_memory, args.max_compiles)
    else:
        speed(args.speed_seq)


if __name__ == "__main__":
    main()
