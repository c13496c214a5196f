"""Compiles for a GPU target share XLA:GPU kernels within a process (zeroflow.backend.kernel_cache):
one kernel file per GPU model, reused by the next compile, and the compiled program's memory
is what XLA compiles without it."""
import os
import shutil

import jax
import jax.numpy as jnp
import optax
import pytest
from helpers import require_cuda_plugin

pytestmark = pytest.mark.slow

require_cuda_plugin()

import zeroflow as zf  # noqa: E402
from zeroflow.backend import kernel_cache  # noqa: E402

PARAMS = {"w": jax.ShapeDtypeStruct((256, 256), jnp.float32)}
BATCH = {"x": jax.ShapeDtypeStruct((16, 256), jnp.float32)}


def loss_fn(p, b):
    return jnp.mean(jnp.tanh(b["x"] @ p["w"]) ** 2)


def compile_for(gpu):
    plan = zf.ZeroPlan(zf.target_mesh(gpu, data=2), stage=3)
    compiled, _ = zf.memory.compile_step(loss_fn, PARAMS, BATCH, optax.adamw(1e-3), plan,
                                         zf.Precision(params="bf16"))
    return compiled


@pytest.fixture
def folders(monkeypatch):
    """The kernel folder of this process starts empty (no earlier test's kernels) and is
    removed after the test: {process id: folder}, filled by the first compile."""
    monkeypatch.delenv(kernel_cache.ENV, raising=False)
    made = {}
    monkeypatch.setattr(kernel_cache, "_folder", made)
    yield made
    for folder in made.values():
        shutil.rmtree(folder, ignore_errors=True)


def kernel_files(folders):
    """{file name: bytes} of this process's kernel files."""
    folder = folders.get(os.getpid())
    if folder is None:
        return {}
    return {name: os.path.getsize(os.path.join(folder, name)) for name in os.listdir(folder)}


def test_a_second_compile_reuses_the_first_ones_kernels(folders):
    first = compile_for("h100")
    after_first = kernel_files(folders)
    assert list(after_first) == ["NVIDIA-H100-80GB-HBM3.kernels"]
    second = compile_for("h100")
    grown = kernel_files(folders)["NVIDIA-H100-80GB-HBM3.kernels"] - after_first["NVIDIA-H100-80GB-HBM3.kernels"]
    # Generated again, every kernel would be appended again; reused, almost none is.
    assert grown < 0.25 * after_first["NVIDIA-H100-80GB-HBM3.kernels"], (grown, after_first)
    assert second.memory_analysis().temp_size_in_bytes == first.memory_analysis().temp_size_in_bytes
    # Another GPU gets a file of its own: XLA does not key a kernel by the GPU it was made for.
    compile_for("a100")
    assert set(kernel_files(folders)) == {"NVIDIA-H100-80GB-HBM3.kernels", "NVIDIA-A100-SXM4-80GB.kernels"}


def test_the_memory_analysis_is_xlas_own_without_the_cache(folders, monkeypatch):
    cached = compile_for("h100").memory_analysis()
    assert kernel_files(folders)
    without = {}
    monkeypatch.setattr(kernel_cache, "_folder", without)
    monkeypatch.setenv(kernel_cache.ENV, "0")
    plain = compile_for("h100").memory_analysis()
    assert without == {}  # no folder made, no kernel file
    for field in ("argument_size_in_bytes", "output_size_in_bytes", "temp_size_in_bytes",
                  "alias_size_in_bytes", "host_temp_size_in_bytes"):
        assert getattr(cached, field) == getattr(plain, field), field


def test_a_bad_setting_is_one_line(monkeypatch):
    monkeypatch.setenv(kernel_cache.ENV, "off")
    with pytest.raises(ValueError, match="ZEROFLOW_KERNEL_CACHE='off': set it to 0") as caught:
        zf.backend.compiler_options(zf.backend.of(zf.target_mesh("h100", data=2)))
    assert "\n" not in str(caught.value)


def test_only_target_compiles_use_it():
    target = zf.backend.of(zf.target_mesh("h100", data=2))
    assert target.compile_only and "xla_gpu_kernel_cache_file" in zf.backend.compiler_options(target)
    real_gpu = zf.backend.for_platform("gpu", target.device_kind)  # a real H100's traits
    assert not real_gpu.compile_only
    assert "xla_gpu_kernel_cache_file" not in zf.backend.compiler_options(real_gpu)
    assert not zf.backend.of(zf.make_mesh()).compile_only
