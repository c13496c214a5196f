"""A jax whose Pallas has no Mosaic GPU backend (tests/without_mosaic_gpu.py hides the module):
``pallas_kernels`` still imports, each kernel asked for is one line naming what is missing and
the jax versions that have it (a ValueError), and ``zeroflow.train`` with ``model.attention=
pallas`` exits 2 with that line, naming the setting, and writes nothing."""
import subprocess
import sys

import pytest

from helpers import REPO, one_cpu_env

pytestmark = pytest.mark.slow

MISSING = "need jax.experimental.pallas.mosaic_gpu, which jax"
SUPPORTED = "supported: jax 0.10.2, 0.11.x, 0.12.x"


def _without_mosaic_gpu(*args):
    return subprocess.run([sys.executable, str(REPO / "tests" / "without_mosaic_gpu.py"), *args],
                          cwd=REPO, env=one_cpu_env(JAX_PLATFORMS="cpu"), capture_output=True,
                          text=True, timeout=600)


def test_each_kernel_says_mosaic_gpu_is_missing_in_one_line():
    proc = _without_mosaic_gpu("library")
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    assert [line.split(":")[0] for line in lines] == ["flash_attention", "block_sparse_matmul"]
    for line in lines:
        assert MISSING in line and line.endswith(SUPPORTED), line


def test_train_with_pallas_attention_exits_2_naming_the_setting_and_writes_nothing(tmp_path):
    proc = _without_mosaic_gpu("train", "--config", "configs/tiny.yaml", "model.attention=pallas",
                               f"run.dir={tmp_path}/run")
    errors = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(errors) == 1, proc.stderr[-3000:]
    assert errors[0].startswith("zeroflow.train: error: model.attention='pallas': Pallas Mosaic")
    assert MISSING in errors[0] and errors[0].endswith(SUPPORTED)
    assert list(tmp_path.iterdir()) == []
