"""XLA:GPU peak per device of the trainer's GPT step at a long sequence: the plain loss on the
whole logits against the chunked cross-entropy (``model.loss_chunk``), then with the tiled MLP
(``model.mlp_chunk``) and each layer's input kept in host memory (``model.remat=offload_input``).

    python experiments/long_sequence_loss.py [--seq 65536] [--layers 16]

Compiled for one abstract H100 (``zf.target_mesh("h100", data=1)``, deviceless: nothing runs,
the CUDA plugin must be installed); the model is Llama-3.2-1B's shape (width 2048, 32 query and
8 key/value heads, MLP 8192, vocabulary 128256, tied embeddings), bf16 weights, AdamW, ZeRO
stage 0, batch 1, cuDNN attention. Peak = XLA's ``memory_analysis`` of the whole train step
(arguments + outputs + temporaries - aliased); host = its pinned-host temporaries. Prints one
markdown table.
"""

import argparse
import os
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

args_parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
args_parser.add_argument("--seq", type=int, default=65536)
args_parser.add_argument("--layers", type=int, default=16)
args_parser.add_argument("--loss-chunk", type=int, default=4096)
args_parser.add_argument("--vocab-chunk", type=int, default=16384)
args_parser.add_argument("--mlp-chunk", type=int, default=8192)
args = args_parser.parse_args()

from zeroflow.cli.common import start_script  # noqa: E402

start_script()  # before jax: where the CUDA plugin has no driver, a CPU jax without its noise

import jax  # noqa: E402

from zeroflow.config.io import load_config  # noqa: E402
from zeroflow.memory.measure import analysed, device_peak  # noqa: E402
from zeroflow.trainer.planning import compile_config  # noqa: E402

MODEL = [
    "model.vocab_size=128256",
    "model.embed_dim=2048",
    "model.num_heads=32",
    "model.num_kv_heads=8",
    "model.mlp_dim=8192",
    "model.rope_base=500000",
    "model.norm_eps=1e-5",
    "model.attention=cudnn",
    "model.tie_embeddings=true",
    f"model.num_layers={args.layers}",
    f"model.seq_len={args.seq}",
    "precision.params=bf16",
    "train.batch_size=1",
]
CHUNKED = [f"model.loss_chunk={args.loss_chunk}", f"model.loss_vocab_chunk={args.vocab_chunk}"]
TILED = [f"model.mlp_chunk={args.mlp_chunk}"]
VARIANTS = [
    ("plain loss", "full", []),
    ("chunked loss", "full", CHUNKED),
    ("chunked loss + tiled MLP", "full", CHUNKED + TILED),
    ("chunked loss + tiled MLP", "offload_input", CHUNKED + TILED),
]

print(
    f"jax {jax.__version__}, one abstract H100, seq {args.seq}, {args.layers} layers, "
    f"loss chunk {args.loss_chunk} x {args.vocab_chunk}, MLP chunk {args.mlp_chunk}\n"
)
print("| variant | remat | device peak (GB) | host temporaries (GB) | compile (s) |")
print("|---|---|---:|---:|---:|")
for name, remat, overrides in VARIANTS:
    cfg = load_config(None, MODEL + overrides)
    start = time.perf_counter()
    compiled, setup = compile_config(
        cfg,
        num_devices=1,
        stage=0,
        offload="none",
        update_on="device",
        remat=remat,
        target="h100",
    )
    memory = analysed(compiled)
    peak = device_peak(memory, setup.state)
    seconds = time.perf_counter() - start
    print(
        f"| {name} | {remat} | {peak / 1e9:.2f} | {memory.host_temp_bytes / 1e9:.2f} "
        f"| {seconds:.0f} |",
        flush=True,
    )
