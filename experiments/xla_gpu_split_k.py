"""XLA:GPU's split-K rewrite: the chunks it chooses, and the memory their partial sums take.

XLA:GPU (the ``splitk-rewriter`` pass) cuts the contraction of a small matmul with a long
contracted dimension into ``s`` chunks, computes them as one batched matmul into an
``s x M x N`` fp32 buffer and sums that buffer. A weight gradient of a small layer (``M x N``
weights, contracted over the step's tokens) therefore holds ``s`` copies of itself for a
while. Two parts, both compiled for an abstract H100 (``zf.target_mesh``, no GPU needed, a
CUDA plugin at jaxlib's version installed):

1. **The choice of s** for one ``[K, M]^T @ [K, N]`` fp32 matmul over a grid of shapes: the
   leading dimension of the 3-D matmul fusion XLA emits (1: not split), the temporaries it
   allocates, and where it differs, the ``s`` of ``zeroflow.memory.split_k.chunks`` (the
   estimator's fit).
2. **The corpus's NNX step** (``tests/model_corpus.py``, the step of
   ``experiments/estimator_corpus.py``, stage 1, 8 abstract H100s): the buffers live at the
   compiled step's peak (XLA's ``*live-range.txt`` dump), with the split matmuls' partial sums
   picked out (fusions whose result a ``*.reduce_sub_computation`` sums).

    python experiments/xla_gpu_split_k.py   # writes experiments/results/xla_gpu_split_k.md
"""
from __future__ import annotations

import datetime
import os
import re
import sys
import tempfile
from pathlib import Path

DUMP = tempfile.mkdtemp(prefix="zeroflow-split-k-")
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                           " --xla_force_host_platform_device_count=8"
                           f" --xla_dump_to={DUMP} --xla_dump_hlo_as_text"
                           " --xla_dump_hlo_module_re=.*_traced_for.*")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

import zeroflow as zf  # noqa: E402
from zeroflow.memory import split_k  # noqa: E402
from zeroflow.util.compat import cuda_plugin_module  # noqa: E402
from helpers import split_k_chunks  # noqa: E402
from model_corpus import CORPUS, LARGER, engine_loss  # noqa: E402

RESULTS = HERE / "results" / "xla_gpu_split_k.md"
SIDES = (16, 64, 128, 256, 512, 1024, 2048)
CONTRACTIONS = (128, 512, 2048, 8192, 32768, 131072)


def split_of(k: int, m: int, n: int) -> tuple[int, int]:
    """XLA:GPU's split for ``[k, m]^T @ [k, n]`` (fp32) and the temporaries it allocates."""
    replicated = NamedSharding(zf.target_mesh("h100", data=1), P())
    lhs = jax.ShapeDtypeStruct((k, m), jnp.float32, sharding=replicated)
    rhs = jax.ShapeDtypeStruct((k, n), jnp.float32, sharding=replicated)
    matmul = jax.jit(lambda a, b: jax.lax.dot_general(a, b, (((0,), (0,)), ((), ()))))
    compiled = matmul.trace(lhs, rhs).lower().compile()
    return split_k_chunks(compiled.as_text()), compiled.memory_analysis().temp_size_in_bytes


def grid_lines() -> list[str]:
    matched = [0, 0]
    lines = ["| M x N | " + " | ".join(f"K={k}" for k in CONTRACTIONS) + " |",
             "|---|" + "---|" * len(CONTRACTIONS)]
    for i, m in enumerate(SIDES):
        for n in SIDES[i:]:
            cells = []
            for k in CONTRACTIONS:
                s, temp = split_of(k, m, n)
                fit = split_k.chunks(m, n, k)
                cells.append((f"{s} ({temp / 2**20:.2f} MiB)" if s > 1 else "1")
                             + (f" [fit: {fit}]" if fit != s else ""))
                matched[0] += fit == s
                matched[1] += 1
            lines.append(f"| {m} x {n} | " + " | ".join(cells) + " |")
            print(lines[-1], flush=True)
    agreed, shapes = matched
    return lines + ["", f"`split_k.chunks` gives XLA's choice on {agreed} of {shapes} shapes."]


def _peak_buffers(live_range: str) -> list[tuple[str, int]]:
    """The (buffer, bytes) lines under "Live ranges at N (peak)" of a live-range dump."""
    text = Path(live_range).read_text()
    block = text.split("(peak):", 1)[1].split("Stack trace", 1)[0]
    return [(name, int(size)) for name, size in
            re.findall(r"^\s+(\S+?)\{[\d,]*\}: (\d+) bytes", block, re.M)]


def nnx_step_lines() -> list[str]:
    corpus = CORPUS["nnx_net"](0, LARGER)
    loss = engine_loss(corpus.forward, stateful=True)
    plan, prec = zf.ZeroPlan(zf.target_mesh("h100", data=8), stage=1), zf.Precision()
    _, peak = zf.memory.measure_step(loss, corpus.params, corpus.batches(1, 64)[0],
                                     optax.adamw(1e-3), plan, prec,
                                     model_state=corpus.model_state, rng=jax.random.key(0))
    dumps = sorted(Path(DUMP).glob("*_traced_for*gpu_after_optimizations-live-range.txt"))
    hlo = Path(str(dumps[-1]).replace("-live-range.txt", ".txt")).read_text()
    summed = set(re.findall(r"to_apply=%dot\.(\d+)\.reduce_sub_computation", hlo))
    buffers = _peak_buffers(str(dumps[-1]))
    partial = [(name, size) for name, size in buffers
               if (m := re.fullmatch(r"gemm_fusion_dot\.(\d+)", name)) and m.group(1) in summed]
    shown = ", ".join(f"`{name}` {size / 2**20:.2f} MiB" for name, size in partial) or "none"
    return [f"XLA:GPU peak per device: {peak / 1e6:.2f} MB. Live at that peak: "
            f"{len(buffers)} buffers, {sum(s for _, s in buffers) / 1e6:.2f} MB; of them split "
            f"matmuls' partial sums: {shown} "
            f"({sum(s for _, s in partial) / 1e6:.2f} MB)."]


def main() -> None:
    if cuda_plugin_module() is None:
        raise SystemExit("this experiment compiles for XLA:GPU: install jax-cuda12-plugin "
                         "at jaxlib's version (no GPU needed)")
    lines = ["# XLA:GPU's split-K partial sums\n",
             f"{datetime.date.today()}, {os.cpu_count()} CPU cores, no GPU, jax {jax.__version__}"
             ", compiled for abstract H100s (`zf.target_mesh`). Command: "
             "`python experiments/xla_gpu_split_k.py`.\n",
             "## The split XLA:GPU chooses for `[K, M]^T @ [K, N]` (fp32)\n",
             "Each cell: the number of chunks (1: not split), the temporaries allocated "
             "(the `s x M x N` fp32 partial sums), and in brackets the estimator's fit "
             "(`zeroflow.memory.split_k.chunks`) where it differs.\n"]
    lines += grid_lines()
    lines += ["", "## The corpus NNX step, stage 1, 8 x H100\n"] + nnx_step_lines()
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text("\n".join(lines) + "\n")
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
