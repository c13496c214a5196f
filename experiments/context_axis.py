"""The context axis on GPUs that are not there: the peak per device as the sequence is split.

Compiles the trainer's GPT step (``build_run``: AdamW, bf16 weights, fp32 master and moments,
ZeRO stage 3, remat full, one layer gathered at a time) for 8 abstract H100s
(``zf.target_mesh("h100", data=8 // C, context=C)``) at one fixed long sequence, one row per
data group, for C = 1, 2, 4, 8 and each way attention crosses the split
(``model.context_attention``: allgather, ring). Reports XLA:GPU's peak per device
(``memory_analysis``), the tokens each device holds, and XLA:GPU's own estimate of the step's
time (its latency-hiding scheduler's model, ``zeroflow.xla.schedule``).

    python experiments/context_axis.py     # writes experiments/results/context_axis.md

Nothing runs and nothing is autotuned: memory is XLA:GPU's plan for the program, the time is
its cost model's.
"""
from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # the CUDA plugin describes targets only then

from zeroflow.cli.common import start_script  # noqa: E402

start_script()  # before jax: where the CUDA plugin has no driver, a CPU jax without its noise

from zeroflow.xla import schedule  # noqa: E402  (its logging must be on before jax starts)

schedule.enable()

import argparse  # noqa: E402
import datetime  # noqa: E402
import platform  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import jax  # noqa: E402

import zeroflow as zf  # noqa: E402
from zeroflow.config.io import load_config  # noqa: E402
from zeroflow.memory.measure import analysed, device_peak  # noqa: E402
from zeroflow.trainer.setup import abstract_batch, build_run  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
RESULTS = Path(__file__).parent / "results" / "context_axis.md"
MiB = 2 ** 20
DEVICES = 8
MODEL = ("model.num_layers=8", "model.embed_dim=1024", "model.num_heads=8", "model.mlp_dim=4096",
         "model.remat=full", "precision.params=bf16", "parallel.zero_stage=3",
         "parallel.grad_accum=1", "parallel.offload=none")
"A small rotary GPT (byte vocabulary): what grows with the sequence is its activations."


def compile_row(seq: int, context: int, strategy: str, attention: str) -> dict:
    data = DEVICES // context
    cfg = load_config(REPO / "configs/tiny.yaml", [
        *MODEL, f"model.seq_len={seq}", f"model.attention={attention}",
        f"model.context_attention={strategy}", f"parallel.context={context}",
        f"train.batch_size={data}"])
    start = time.perf_counter()
    run = build_run(cfg, with_data=False,
                    mesh=zf.target_mesh("h100", data=data, context=context))
    state = run.abstract_state()
    batch = abstract_batch(cfg, run.plan.batch_sharding)
    compiled, est = schedule.timed(lambda: run.make_step().lower(state, batch).compile())
    row = {"context": context, "data": data, "strategy": strategy if context > 1 else "-",
           "attention": attention, "seq": seq, "tokens": seq // context,
           "peak": device_peak(analysed(compiled), state),
           "step_ms": None if est is None else est.step_ms,
           "seconds": time.perf_counter() - start}
    print(_line(row), file=sys.stderr, flush=True)
    return row


def _line(r) -> str:
    step = "-" if r["step_ms"] is None else f"{r['step_ms']:,.0f}"
    return (f"| {r['context']} | {r['data']} | {r['strategy']} | {r['attention']} | "
            f"{r['seq']:,} | {r['data'] * r['seq']:,} | {r['tokens']:,} | {r['peak'] / MiB:,.0f} | "
            f"{step} |")


HEADER = ("| context | data | context attention | attention | sequence | tokens per step | "
          "tokens per device | peak MiB per device | XLA step estimate ms |\n"
          "|---|---|---|---|---|---|---|---|---|")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=65536, help="tokens per row")
    parser.add_argument("--contexts", default="1,2,4,8")
    parser.add_argument("--strategies", default="allgather,ring")
    parser.add_argument("--attention", default="pallas", help="xla, cudnn or pallas")
    parser.add_argument("--out", default=str(RESULTS))
    args = parser.parse_args(argv)
    rows = []
    for context in map(int, args.contexts.split(",")):
        for strategy in args.strategies.split(",") if context > 1 else ["allgather"]:
            rows.append(compile_row(args.seq, context, strategy, args.attention))
    command = "python experiments/context_axis.py " + " ".join(argv or sys.argv[1:])
    text = "\n".join([
        "# The context axis: peak per device as a fixed sequence is split (XLA:GPU, 8 x H100)",
        "",
        f"`{command.strip()}` on a {os.cpu_count()}-core CPU container without a GPU "
        f"({platform.machine()}), {datetime.date.today().isoformat()}, jax {jax.__version__} "
        "with jax-cuda12-plugin of the same version: each row is one XLA:GPU compile (nothing "
        "runs, nothing is autotuned) of the trainer's GPT step for 8 abstract H100s "
        "(`zf.target_mesh(\"h100\", data=8 // C, context=C)`): 8 layers, width 1024, 8 heads, "
        "MLP 4096, byte vocabulary, rotary positions, AdamW, bf16 weights, fp32 master and "
        "moments, ZeRO stage 3 over data x context, remat full, one row of the sequence per "
        "data group. Peak = `memory_analysis()` per device (arguments + outputs + temporaries "
        "- aliased). Step estimate = XLA:GPU's latency-hiding scheduler's model of the whole "
        "step (the batch holds one row per data group, so a step's tokens fall as C grows); "
        "it costs the Triton kernels and the conditionals of the context attention by its own "
        "model, which no GPU run has checked.",
        "",
        HEADER,
        *(_line(r) for r in rows),
        "",
    ])
    Path(args.out).write_text(text)
    print(text)


if __name__ == "__main__":
    main()
