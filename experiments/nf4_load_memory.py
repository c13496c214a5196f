"""Peak host memory while reading a Hugging Face Llama checkpoint straight into NF4
(``hf.from_pretrained(..., quantize="nf4")``), against reading it in bf16.

    python experiments/nf4_load_memory.py --layers 8 --hidden 2048 --mlp 8192

Writes a random bf16 Llama checkpoint of that shape to a temporary folder, one safetensors file
per layer (so writing it never holds the whole model either), then loads it in a fresh process
per mode and prints that process's resident-memory high-water mark (``VmHWM``) and the largest
anonymous resident memory seen (``RssAnon``, sampled every 10 ms: the heap, without the
checkpoint's memory-mapped file pages, which the kernel may drop at will). On a CPU-only
machine the loaded arrays themselves live in host memory, so both figures include the
result: 0.52 bytes a weight in NF4, 2 in bf16.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from zeroflow.cli.common import start_script

start_script()  # before jax: where the CUDA plugin has no driver, a CPU jax without its noise

import numpy as np

GIB = 1 << 30


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


def write_checkpoint(out: Path, layers: int, hidden: int, mlp: int, vocab: int) -> int:
    """A random bf16 ``LlamaForCausalLM`` folder; returns its parameter count."""
    import ml_dtypes
    from safetensors.numpy import save_file

    rng = np.random.default_rng(0)
    heads = hidden // 128

    def weight(*shape):
        return (rng.standard_normal(shape, np.float32) * 0.02).astype(ml_dtypes.bfloat16)

    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": vocab,
        "hidden_size": hidden, "intermediate_size": mlp, "num_hidden_layers": layers,
        "num_attention_heads": heads, "num_key_value_heads": heads,
        "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
        "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    }
    (out / "config.json").write_text(json.dumps(config))
    weight_map, count = {}, 0

    def save(name: str, tensors: dict) -> None:
        nonlocal count
        save_file(tensors, str(out / name))
        weight_map.update({k: name for k in tensors})
        count += sum(t.size for t in tensors.values())

    save("embed.safetensors", {"model.embed_tokens.weight": weight(vocab, hidden),
                               "lm_head.weight": weight(vocab, hidden),
                               "model.norm.weight": np.ones(hidden, ml_dtypes.bfloat16)})
    for i in range(layers):
        p = f"model.layers.{i}."
        save(f"layer{i}.safetensors", {
            **{p + f"self_attn.{n}_proj.weight": weight(hidden, hidden) for n in "qkvo"},
            p + "mlp.gate_proj.weight": weight(mlp, hidden),
            p + "mlp.up_proj.weight": weight(mlp, hidden),
            p + "mlp.down_proj.weight": weight(hidden, mlp),
            p + "input_layernorm.weight": np.ones(hidden, ml_dtypes.bfloat16),
            p + "post_attention_layernorm.weight": np.ones(hidden, ml_dtypes.bfloat16),
        })
    (out / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return count


def load_and_report(folder: str, mode: str) -> None:
    """In this (fresh) process: load ``folder`` as ``mode`` and print the memory figures."""
    import jax

    from zeroflow import hf

    peak_anon, done = [_status_kib("RssAnon")], threading.Event()

    def sample():
        while not done.is_set():
            peak_anon.append(_status_kib("RssAnon"))
            time.sleep(0.01)

    before = _status_kib("VmRSS")
    watcher = threading.Thread(target=sample, daemon=True)
    watcher.start()
    start = time.perf_counter()
    if mode == "nf4":
        _, params, _ = hf.from_pretrained(folder, quantize="nf4")
    else:
        _, params, _ = hf.from_pretrained(folder, dtype="bf16")
    jax.block_until_ready(params)
    seconds = time.perf_counter() - start
    done.set()
    watcher.join()
    held = sum(x.nbytes for x in jax.tree.leaves(params))
    print(json.dumps({
        "mode": mode, "seconds": round(seconds, 1), "params_bytes_gib": held / GIB,
        "rss_before_gib": before / (1 << 20), "vmhwm_gib": _status_kib("VmHWM") / (1 << 20),
        "peak_rss_anon_gib": max(peak_anon) / (1 << 20),
    }))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--mlp", type=int, default=8192)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--load", nargs=2, metavar=("FOLDER", "MODE"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.load:
        load_and_report(*args.load)
        return
    with tempfile.TemporaryDirectory() as tmp:
        n = write_checkpoint(Path(tmp), args.layers, args.hidden, args.mlp, args.vocab)
        print(f"checkpoint: {n / 1e9:.3f}B parameters, {2 * n / GIB:.2f} GiB in bf16")
        env = {**os.environ, "JAX_PLATFORMS": "cpu"}
        for mode in ("nf4", "bf16"):
            subprocess.run([sys.executable, __file__, "--load", tmp, mode], check=True, env=env)


if __name__ == "__main__":
    main()
