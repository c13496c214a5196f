"""FuseMix's largest batch by XLA:GPU compile (experiments/fusemix_max_batch.py): the V100
target and what it needs (CUDA 12's ptxas), the bisection, and the paper-sized step compiled
for a GPU target with a peak that holds its state and its B x B similarity matrices."""
import importlib.util

import jax
import pytest
from helpers import REPO, require_cuda_plugin

pytestmark = pytest.mark.slow

require_cuda_plugin()

import zeroflow as zf  # noqa: E402
from zeroflow.backend import targets  # noqa: E402


def _script():
    path = REPO / "experiments" / "fusemix_max_batch.py"
    spec = importlib.util.spec_from_file_location("fusemix_max_batch", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_v100_needs_cuda12_ptxas(monkeypatch):
    """CUDA 13's ptxas cannot assemble sm_70: the target says so at once, not at compile time."""
    v100, h100 = targets.spec_text("v100"), targets.spec_text("h100")
    assert "major: 7 minor: 0" in v100
    monkeypatch.setattr(targets, "ptxas_path", lambda: "/opt/cuda/bin/ptxas")
    monkeypatch.setattr(targets, "ptxas_release", lambda path: (13, 0))
    with pytest.raises(targets.TargetUnavailable, match=r"CUDA 12's ptxas .*CUDA 13\.0's.*"
                                                        r"nvidia-cuda-nvcc-cu12.*CUDA_ROOT"):
        targets._check_ptxas("v100", v100)
    targets._check_ptxas("h100", h100)  # sm_90: any ptxas
    monkeypatch.setattr(targets, "ptxas_release", lambda path: (12, 9))
    targets._check_ptxas("v100", v100)


def test_bisection_finds_the_largest_fitting_multiple():
    largest = _script().largest
    for limit in (0, 255, 256, 4096, 4097, 20_000, 55_296, 100_000):
        seen = []
        got, calls = largest(lambda n: seen.append(n) or n <= limit, 256, 4096)
        assert got == limit // 256 * 256, limit
        assert calls == len(seen) and all(n % 256 == 0 for n in seen)


@pytest.mark.parametrize("gpu", ["h100", "v100"])
def test_paper_step_compiles_for_the_target(gpu):
    """At batch 2,048 the peak holds the adapters' state (fp32 master weights and AdamW's two
    moments: at least 12 bytes a parameter) and the two similarity matrices, and little else."""
    try:
        zf.target_mesh(gpu, data=1)
    except targets.TargetUnavailable as e:
        assert gpu == "v100" and "CUDA 12's ptxas" in str(e)
        pytest.skip(str(e))
    script = _script()
    script.SETUP = script.setup()
    n_params = sum(int(x.size) for x in jax.tree.leaves(script.SETUP[2]))
    assert 50e6 < n_params < 56e6  # 4 residual blocks of 1024 and of 768, widened 4x
    batch = 2048
    peak = script.peak(gpu, "fp32", batch)
    assert 12 * n_params + 2 * 4 * batch**2 < peak < 16 * n_params + 2e9, peak
