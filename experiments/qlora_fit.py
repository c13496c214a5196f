"""Fit rows for QLoRA (NF4 frozen base, rank-r adapters trained with AdamW) on one abstract GPU,
from XLA:GPU deviceless compiles of the trainer's step: the peak at one sequence length, or the
longest sequence whose compiled peak fits a budget (bisected on compiled peaks).

    python experiments/qlora_fit.py --config configs/hf/llama-3.1-70b --target h100 --seq-len 2048
    python experiments/qlora_fit.py --config configs/hf/llama-3.1-70b --target h100 \
        --remat offload_input --mlp-chunk 8192 --longest 65536:131072
    python experiments/qlora_fit.py --config configs/hf/llama-3.1-8b --target rtx4070 \
        --remat offload_input --mlp-chunk 4096 --longest 8192:32768

``--config`` is a Hugging Face model folder (its config.json fixes the architecture; no
weights are read) or a zeroflow YAML. Every row is one compile of the trainer's step
(``zeroflow.trainer.planning.compile_config``) on ``zf.target_mesh(target, data=1)``: ZeRO
stage 0, batch 1, bf16 compute, the base stored in NF4 and the adapters on every attention and
MLP projection. Peak = ``memory_analysis()`` arguments + outputs + temporaries - aliased (the
device's; host = its pinned-host temporaries, the layer inputs of ``offload_input``). A length
fits when its peak is at most ``--fraction`` of the target's memory. ``--buffers N`` lists the
N largest arrays the compiled program makes (result shapes of its instructions, by op name),
which says what dominates the temporaries. Nothing runs.
"""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # the CUDA plugin describes targets only then

import argparse  # noqa: E402
import re  # noqa: E402
import time  # noqa: E402
from collections import Counter  # noqa: E402

from zeroflow.cli.common import start_script  # noqa: E402

start_script()  # before jax: where the CUDA plugin has no driver, a CPU jax without its noise

import jax  # noqa: E402
import numpy as np  # noqa: E402

import zeroflow as zf  # noqa: E402
from zeroflow import backend  # noqa: E402
from zeroflow.backend.targets import spec_field, spec_text  # noqa: E402
from zeroflow.config.io import load_config  # noqa: E402
from zeroflow.memory.measure import analysed, device_peak, state_bytes  # noqa: E402
from zeroflow.trainer.planning import compile_config  # noqa: E402
from zeroflow.util import compat  # noqa: E402

GB, GiB = 1e9, 2**30
BYTES = {"f32": 4, "bf16": 2, "f16": 2, "s32": 4, "u32": 4, "u8": 1, "s8": 1, "pred": 1}
RESULT = re.compile(r"^\s*(?:ROOT )?%?[\w.\-]+ = (\w+)\[([\d,]*)\]")
COMPUTATION = re.compile(r"^(?:ENTRY )?%?([\w.\-]+) .*\{\s*$")
OP_NAME = re.compile(r'op_name="([^"]+)"')


def overrides(args, seq_len: int) -> list[str]:
    folder = os.path.isdir(args.config)
    out = [f"model.init_from={args.config}"] if folder else []
    out += [
        f"model.seq_len={seq_len}",
        "train.batch_size=1",
        "parallel.grad_accum=1",
        "precision.params=bf16",
        f"model.attention={args.attention}",
        f"model.lora.rank={args.rank}",
        f"model.lora.alpha={2.0 * args.rank}",
        f"model.lora.quantize={args.quantize}",
        f"train.optimizer={args.optimizer}",
        f"model.loss_chunk={args.loss_chunk}",
        f"model.loss_vocab_chunk={args.vocab_chunk}",
        f"model.mlp_chunk={args.mlp_chunk}",
        "data.source=stdlib",
    ]
    return out + list(args.set)


def largest_buffers(hlo: str, count: int) -> list[tuple[int, str, int]]:
    """``(bytes, "dtype[shape] op_name", how many)`` of the ``count`` largest array results in
    an optimized HLO module's text (tuples and scalars left out)."""
    # Instructions inside fused computations make no buffer of their own: skip those bodies.
    fused = set(re.findall(r"fusion\(.*calls=%?([\w.\-]+)", hlo))
    seen: Counter = Counter()
    inside = None
    for line in hlo.splitlines():
        head = COMPUTATION.match(line)
        if head:
            inside = head[1]
            continue
        if inside in fused:
            continue
        found = RESULT.match(line)
        if not found or found[1] not in BYTES or not found[2]:
            continue
        dims = [int(d) for d in found[2].split(",")]
        size = int(np.prod(dims)) * BYTES[found[1]]
        name = OP_NAME.search(line)
        label = f"{found[1]}[{found[2]}] {name[1] if name else line.split('=')[1].split('(')[0]}"
        seen[(size, label)] += 1
    top = sorted(seen.items(), key=lambda kv: -kv[0][0])[:count]
    return [(size, label, n) for (size, label), n in top]


def compiled_row(args, seq_len: int) -> dict:
    cfg = load_config(None if os.path.isdir(args.config) else args.config, overrides(args, seq_len))
    mesh = zf.target_mesh(args.target, data=1)
    start = time.perf_counter()
    # The adapters' sites and the step are traced for the target GPU (cuDNN attention lowers
    # for the oldest cuDNN the CUDA plugin accepts when none is installed here).
    with backend.tracing_for(backend.of(mesh)), compat.cudnn_for_target():
        compiled, setup = compile_config(
            cfg,
            num_devices=1,
            stage=0,
            offload="none",
            update_on="device",
            remat=args.remat,
            target=args.target,
        )
    got = analysed(compiled)
    stored = state_bytes(setup.state)
    row = {
        "seq": seq_len,
        "peak": device_peak(got, setup.state),
        "xla_peak": got.peak_bytes,
        "args": got.argument_bytes,
        "temp": got.temp_bytes,
        "host": got.host_temp_bytes,
        "frozen": sum(
            int(np.prod(x.shape)) * x.dtype.itemsize for x in jax.tree.leaves(setup.state.frozen)
        ),
        "state": sum(stored.values()),
        "seconds": time.perf_counter() - start,
    }
    if args.buffers:
        row["buffers"] = largest_buffers(compiled.as_text(), args.buffers)
    return row


def print_row(row: dict, budget: float) -> None:
    fits = "yes" if row["peak"] <= budget else "no"
    print(
        f"| {row['seq']:,} | {row['peak'] / GB:.2f} | {row['peak'] / GiB:.2f} | "
        f"{row['frozen'] / GB:.2f} | {row['args'] / GB:.2f} | {row['temp'] / GB:.2f} | "
        f"{row['host'] / GB:.2f} | {fits} | {row['seconds']:.0f} |",
        flush=True,
    )
    for size, label, n in row.get("buffers", []):
        print(f"    {size / GB:8.3f} GB x{n}  {label}", flush=True)


def longest(args, low: int, high: int, budget: float) -> None:
    """Bisect on compiled peaks between ``low`` (expected to fit) and ``high`` (expected not
    to) in steps of ``--step`` tokens; both ends are compiled first."""
    rows = {}

    def fits(seq):
        rows[seq] = compiled_row(args, seq)
        print_row(rows[seq], budget)
        return rows[seq]["peak"] <= budget

    if not fits(low):
        print(f"{low:,} tokens do not fit: lower the start")
        return
    if fits(high):
        print(f"{high:,} tokens fit: raise the end")
        return
    while high - low > args.step:
        mid = (low + high) // 2 // args.step * args.step
        low, high = (mid, high) if fits(mid) else (low, mid)
    print(
        f"\nlongest fitting: {low:,} tokens (peak {rows[low]['peak'] / GB:.2f} GB, "
        f"host temporaries {rows[low]['host'] / GB:.2f} GB); {high:,} does not fit"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="configs/hf/llama-3.1-70b")
    parser.add_argument("--target", default="h100")
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--longest", default="", help="LOW:HIGH: bisect the longest that fits")
    parser.add_argument("--step", type=int, default=1024, help="bisection granularity, tokens")
    parser.add_argument(
        "--fraction",
        type=float,
        default=0.95,
        help="the share of the target's memory a fitting peak may use",
    )
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--quantize", default="nf4")
    parser.add_argument("--optimizer", default="adamw")
    parser.add_argument("--attention", default="cudnn")
    parser.add_argument("--remat", default="full")
    parser.add_argument("--loss-chunk", type=int, default=2048)
    parser.add_argument("--vocab-chunk", type=int, default=16384)
    parser.add_argument("--mlp-chunk", type=int, default=0)
    parser.add_argument("--buffers", type=int, default=0)
    parser.add_argument("--set", nargs="*", default=[], help="more config overrides")
    args = parser.parse_args()
    memory = int(spec_field(spec_text(args.target), "device_memory_size"))
    budget = args.fraction * memory
    print(
        f"{args.config}: QLoRA ({args.quantize} base, r={args.rank}, {args.optimizer}), "
        f"1 x {args.target} ({memory / GB:.1f} GB; fits at <= {budget / GB:.1f} GB), "
        f"remat {args.remat}, attention {args.attention}, loss chunk {args.loss_chunk} x "
        f"{args.vocab_chunk}, MLP chunk {args.mlp_chunk}; XLA:GPU deviceless compile, "
        f"jax {jax.__version__}\n"
    )
    print(
        "| tokens | peak GB | peak GiB | stored base GB | arguments GB | temporaries GB "
        "| host temporaries GB | fits | compile s |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|---|---:|")
    if args.longest:
        low, high = (int(x) for x in args.longest.split(":"))
        longest(args, low, high, budget)
    else:
        print_row(compiled_row(args, args.seq_len), budget)


if __name__ == "__main__":
    main()
