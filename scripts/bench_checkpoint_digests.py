"""Time the digests of a 1 GB checkpoint: ``python scripts/bench_checkpoint_digests.py [--gb 1]``.

Saves a state of ``--gb`` GB of fp32 arrays with ``zf.save_checkpoint`` (Orbax), then times
``checkpoint_digests.write_manifest`` and ``verify`` (the check every restore and export
runs), with the files in the page cache (hashing speed) and, where the process may drop the
cache, read from disk.
"""
from __future__ import annotations

import argparse
import subprocess
import tempfile
import time
from pathlib import Path

from zeroflow.cli.common import start_script

start_script()  # before jax: where the CUDA plugin has no driver, a CPU jax without its noise

import jax
import jax.numpy as jnp
import optax

import zeroflow as zf
from zeroflow.engine import checkpoint_digests


def _drop_page_cache() -> bool:
    try:
        subprocess.run(["sync"], check=True)
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gb", type=float, default=1.0)
    args = p.parse_args()
    n = int(args.gb * 1e9 / 4)  # fp32 master weights; Adam's zero moments compress to little
    # Random values: constant arrays would compress to nothing on disk.
    keys = jax.random.split(jax.random.key(0), 8)
    params = {f"w{i}": jax.random.normal(k, (n // 8,), jnp.float32) for i, k in enumerate(keys)}
    plan = zf.ZeroPlan(zf.make_mesh(data=1, model=1, devices=jax.devices()[:1]), stage=0)
    state = zf.init_train_state(params, optax.adam(1e-3), plan, zf.Precision(params="fp32"))
    with tempfile.TemporaryDirectory(dir=".") as tmp:
        path = zf.save_checkpoint(Path(tmp) / "ckpt", state)  # writes the manifest too
        size = sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
        t = time.perf_counter()
        checkpoint_digests.write_manifest(path)
        write_s = time.perf_counter() - t
        t = time.perf_counter()
        assert checkpoint_digests.verify(path)
        cached_s = time.perf_counter() - t
        print(f"checkpoint {size / 1e9:.2f} GB in {len(list(path.rglob('*')))} entries")
        print(f"write_manifest: {write_s:.2f} s ({size / write_s / 1e9:.2f} GB/s)")
        print(f"verify, files in the page cache: {cached_s:.2f} s ({size / cached_s / 1e9:.2f} GB/s)")
        if _drop_page_cache():
            t = time.perf_counter()
            assert checkpoint_digests.verify(path)
            cold_s = time.perf_counter() - t
            print(f"verify, read from disk: {cold_s:.2f} s ({size / cold_s / 1e9:.2f} GB/s)")
        else:
            print("verify, read from disk: not measured (cannot drop the page cache here)")


if __name__ == "__main__":
    main()
