"""Kernels and the GPT step compiled for H100s (sm_90) that are not there.

``zeroflow.backend.target_mesh`` gives abstract "NVIDIA H100 80GB HBM3" devices from the CUDA
plugin; arguments sharded over such a mesh make ``jax.jit(...).trace(...).lower().compile()`` a
real XLA:GPU compile on a CPU-only machine. Pallas kernels then appear in the optimized HLO as
custom calls of Mosaic GPU (flash attention and the block-sparse matmul), compiled for sm_90
while lowering: a lowering error or a tile over the GPU's shared memory fails here. Autotuning,
numerics and speed are left to a real GPU (the interpret-mode tests check the numerics).

Shapes are small and the cases cover each property once (dtype, head size, GQA/MQA, causal,
window, segments) rather than their product: each kernel compile takes seconds.
"""
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from helpers import require_cuda_plugin

pytestmark = pytest.mark.slow

require_cuda_plugin()

from pallas_kernels import (  # noqa: E402
    TuningConfig,
    block_sparse_matmul,
    flash_attention,
    random_layout,
)
from pallas_kernels._backend import compiling_for  # noqa: E402
from pallas_kernels._mosaic import kernel_names  # noqa: E402
from zeroflow.backend import target_mesh  # noqa: E402
from zeroflow.config.io import load_config  # noqa: E402
from zeroflow.memory.measure import from_memory_analysis  # noqa: E402
from zeroflow.trainer.setup import build_run  # noqa: E402

from helpers import REPO  # noqa: E402

MOSAIC_CALL = 'custom_call_target="mosaic_gpu'
_TRITON_KERNEL = re.compile(r'custom_call_target="__gpu\$xla\.gpu\.triton".*?\bname = "([^"]+)"')


def mosaic_calls(compiled) -> int:
    """How many Mosaic GPU kernel calls the optimized HLO makes (flash attention: the forward,
    then dQ and dK/dV)."""
    return compiled.as_text().count(MOSAIC_CALL)


def mosaic_kernels(compiled) -> list[str]:
    """Sorted names of the Mosaic GPU kernels the optimized HLO calls (one per call site)."""
    return kernel_names(compiled.as_text())


def compile_for_gpu(fn, *args):
    """XLA:GPU compile of ``jax.jit(fn)`` for the abstract ``args``, kernels traced as for a GPU
    (outside a train step nothing else says so). From jax 0.11 Pallas' Triton lowering reads
    the GPU from the abstract mesh in context (inside ``shard_map`` the mesh's own), so the
    target mesh of the arguments is put in context here."""
    mesh = next(a.sharding.mesh for a in args if hasattr(a, "sharding"))
    with compiling_for("gpu"), jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
        compiled = jax.jit(fn).trace(*args).lower().compile()
    assert compiled.memory_analysis() is not None  # XLA:GPU's buffer assignment, per device
    return compiled


@functools.cache
def one_gpu(gpu: str):
    return target_mesh(gpu, data=1)


def on_one_gpu(shape, dtype, gpu: str = "h100"):
    return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(one_gpu(gpu), P()))




def fwd_and_grads(fn):
    """The output of ``fn`` and the gradients of its sum: its forward and backward kernels."""
    def both(*args):
        out, vjp = jax.vjp(fn, *args)
        return out, vjp(jnp.ones_like(out))
    return both


# (gpu, dtype, batch, seq, heads, kv_heads, head_dim, causal, window, segments)
FLASH_CASES = [
    pytest.param("h100", jnp.bfloat16, 2, 256, 4, 2, 64, True, None, False,
                 id="h100-bf16-gqa-causal-d64"),
    pytest.param("h200", jnp.float16, 1, 512, 4, 1, 128, False, None, True,
                 id="h200-fp16-mqa-d128-segments"),
    pytest.param("h100", jnp.bfloat16, 1, 300, 4, 1, 80, True, (96, 0), True,
                 id="h100-bf16-mqa-causal-window-d80-padded-segments"),
    pytest.param("h200", jnp.float16, 2, 256, 6, 2, 64, False, 48, False,
                 id="h200-fp16-gqa-symmetric-window"),
]


@pytest.mark.parametrize("gpu,dtype,batch,seq,heads,kv_heads,head_dim,causal,window,segments",
                         FLASH_CASES)
def test_flash_attention_compiles_for_hopper(gpu, dtype, batch, seq, heads, kv_heads, head_dim,
                                             causal, window, segments):
    """Forward alone, then forward with dq/dk/dv: every kernel is a compiled Mosaic GPU call.
    The default tiles are the ones a GPU run uses; head_dim 80 is padded to 128 inside, a
    sequence of 300 to whole tiles."""
    q = on_one_gpu((batch, seq, heads, head_dim), dtype, gpu)
    kv = on_one_gpu((batch, seq, kv_heads, head_dim), dtype, gpu)
    ids = on_one_gpu((batch, seq), jnp.int32, gpu)

    def attention(q, k, v, ids):
        return flash_attention(q, k, v, causal=causal, window=window,
                               segment_ids=ids if segments else None)

    assert mosaic_calls(compile_for_gpu(attention, q, kv, kv, ids)) == 1
    both = compile_for_gpu(lambda q, k, v, ids: fwd_and_grads(
        lambda q, k, v: attention(q, k, v, ids))(q, k, v), q, kv, kv, ids)
    assert mosaic_calls(both) == 3


def test_flash_attention_inside_shard_map_over_eight_h100s_needs_no_context():
    """Inside shard_map the mesh says the kernels are for a GPU (no ``compiling_for``), as in a
    data-parallel step; dQ tiles that differ from the forward ones."""
    mesh = target_mesh("h100", data=8)
    q = jax.ShapeDtypeStruct((8, 256, 4, 64), jnp.bfloat16, sharding=NamedSharding(mesh, P("data")))
    tuning = TuningConfig(block_k=128, block_k_dq=64)
    attention = functools.partial(flash_attention, causal=True, tuning=tuning)
    per_device = jax.shard_map(fwd_and_grads(attention), mesh=mesh,
                               in_specs=P("data"), out_specs=P("data"))
    compiled = jax.jit(per_device).trace(q, q, q).lower().compile()
    assert compiled.memory_analysis() is not None
    assert mosaic_calls(compiled) == 3


BLOCK_SPARSE_KERNELS = ["block_sparse_dblocks", "block_sparse_dx", "block_sparse_matmul"]


@pytest.mark.parametrize("gpu,dtype,block_size", [
    ("h100", jnp.bfloat16, 64), ("h100", jnp.float16, 32), ("h200", jnp.bfloat16, 128),
    ("h100", jnp.float32, 32)])
def test_block_sparse_matmul_compiles_for_hopper(gpu, dtype, block_size):
    """Mosaic GPU kernels (sm_90), forward alone, then forward with dx and dblocks. A layout
    with an empty block row and column, and 300 rows (not a multiple of the row tile); fp32
    multiplies as TF32, its right operand stored transposed."""
    layout = random_layout(5, 6, 0.5, seed=3)
    layout[2, :] = False
    layout[:, 4] = False
    mesh = target_mesh(gpu, data=1)
    on_gpu = lambda shape: jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, P()))
    x = on_gpu((300, layout.shape[0] * block_size))
    blocks = on_gpu((int(layout.sum()), block_size, block_size))
    matmul = functools.partial(block_sparse_matmul, layout=layout, block_size=block_size)

    assert mosaic_kernels(compile_for_gpu(matmul, x, blocks)) == ["block_sparse_matmul"]
    both = compile_for_gpu(fwd_and_grads(matmul), x, blocks)
    assert mosaic_kernels(both) == BLOCK_SPARSE_KERNELS


def test_block_sparse_inside_shard_map_over_eight_h100s():
    """As in a data-parallel step: rows sharded, blocks replicated (check_vma), so the kernels'
    outputs must vary over "data" and the blocks' gradient comes back summed over it."""
    mesh = target_mesh("h100", data=8)
    layout = random_layout(4, 4, 0.5, seed=1)
    x = jax.ShapeDtypeStruct((8 * 64, 4 * 64), jnp.bfloat16, sharding=NamedSharding(mesh, P("data")))
    blocks = jax.ShapeDtypeStruct((int(layout.sum()), 64, 64), jnp.bfloat16,
                                  sharding=NamedSharding(mesh, P()))
    matmul = functools.partial(block_sparse_matmul, layout=layout, block_size=64)
    per_device = jax.shard_map(fwd_and_grads(matmul), mesh=mesh, in_specs=(P("data"), P()),
                               out_specs=(P("data"), (P("data"), P())))
    compiled = jax.jit(per_device).trace(x, blocks).lower().compile()
    assert mosaic_kernels(compiled) == BLOCK_SPARSE_KERNELS
    assert "all-reduce" in compiled.as_text()  # the replicated blocks' gradient, summed


# ----------------------------------------------------------------- the trainer's GPT step

# The first cuDNN jax-cuda12-plugin 0.10.2 accepts (it requires nvidia-cudnn-cu12>=9.8).
TARGET_CUDNN_VERSION = 90800


def compile_gpt_step(attention: str, data: int, seq_len: int = 128, gpu: str = "h100",
                     context: int = 1, extra: tuple = ()):
    """The trainer's step (``build_run``, as ``zeroflow.memory.measure`` builds it) of a
    shrunk ``configs/tiny.yaml`` (head dim 32), ZeRO-3 with bf16 params, compiled for
    ``data x context`` GPUs."""
    cfg = load_config(REPO / "configs" / "tiny.yaml", [
        f"model.attention={attention}", "model.num_layers=1", f"model.seq_len={seq_len}",
        "model.embed_dim=64", "model.num_heads=2", "model.mlp_dim=128",
        f"train.batch_size={data}", "parallel.zero_stage=3", "precision.params=bf16",
        f"parallel.context={context}", *extra])
    run = build_run(cfg, with_data=False, mesh=target_mesh(gpu, data=data, context=context))
    rows, sharding = cfg.train.batch_size, run.plan.batch_sharding()
    batch = {"tokens": jax.ShapeDtypeStruct((rows, cfg.model.seq_len + 1), np.int32,
                                            sharding=sharding)}
    if context > 1:  # the step takes the split fields (``zeroflow.models.context_batch``)
        fields = ("tokens", "targets", "loss_mask", "segment_ids", "positions")
        batch = {name: jax.ShapeDtypeStruct((rows, cfg.model.seq_len), np.int32,
                                            sharding=sharding) for name in fields}
    compiled = run.make_step().lower(run.abstract_state(), batch).compile()
    assert compiled.memory_analysis() is not None
    return compiled


def test_gpt_step_with_pallas_attention_compiles_for_eight_h100s():
    """The step traces its kernels for the mesh's GPUs: Mosaic GPU calls, no interpreter (and
    no dense stand-in): the forward, and the forward again (rematerialised) with dQ and dK/dV."""
    compiled = compile_gpt_step("pallas", data=8)
    assert mosaic_calls(compiled) >= 3
    assert "io_callback" not in compiled.as_text() and "xla_python_cpu_callback" not in (
        compiled.as_text())


def test_gpt_step_with_the_context_ring_on_pallas_compiles_for_two_h100s():
    """The ring merges the Mosaic kernels' log-sum-exp: forward blocks, then backward blocks
    given the whole attention's lse, all compiled Mosaic GPU calls."""
    compiled = compile_gpt_step("pallas", data=1, context=2,
                                extra=("model.context_attention=ring",))
    assert mosaic_calls(compiled) >= 3
    assert "xla_python_cpu_callback" not in compiled.as_text()


def test_gpt_step_peak_at_8k_tokens_with_pallas_attention_is_at_most_xla_attentions():
    """8,192 tokens in one row: XLA's attention holds [heads, S, S] scores (and their
    gradient), the kernels O(S) statistics. XLA's own peak of each compiled step, one H100."""
    peaks = {impl: from_memory_analysis(compile_gpt_step(impl, data=1, seq_len=8192)
                                        .memory_analysis()) for impl in ("pallas", "xla")}
    assert peaks["pallas"].total_bytes <= peaks["xla"].total_bytes
    assert peaks["pallas"].peak_bytes <= peaks["xla"].peak_bytes


def test_kernels_in_a_shard_map_over_a100s_are_refused_in_one_line():
    """Called directly inside ``shard_map`` over a target mesh of A100s (sm_80: no wgmma), each
    kernel reads the mesh's device and refuses before tracing a kernel, as a ValueError."""
    mesh = target_mesh("a100", data=1)
    spec = NamedSharding(mesh, P())
    q = jax.ShapeDtypeStruct((1, 128, 2, 64), jnp.bfloat16, sharding=spec)
    x = jax.ShapeDtypeStruct((64, 64), jnp.bfloat16, sharding=spec)
    blocks = jax.ShapeDtypeStruct((2, 32, 32), jnp.bfloat16, sharding=spec)
    layout = np.array([[True, False], [False, True]])
    calls = [(lambda q: flash_attention(q, q, q, causal=True), q),
             (lambda x, b: block_sparse_matmul(x, b, layout, 32), x, blocks)]
    for fn, *args in calls:
        on_mesh = jax.shard_map(fn, mesh=mesh, in_specs=(P(),) * len(args), out_specs=P())
        with pytest.raises(ValueError, match=r"sm_90 GPUs \(H100, H200\), not for "
                                             r"'NVIDIA A100") as err:
            jax.jit(on_mesh).trace(*args).lower()
        assert "\n" not in str(err.value)


def test_gpt_step_with_pallas_attention_for_an_a100_is_refused_in_one_line():
    """The kernels use Hopper's wgmma: on an A100 target the step says so before compiling."""
    with pytest.raises(ValueError, match=r"sm_90 GPUs \(H100, H200\).*A100") as err:
        compile_gpt_step("pallas", data=1, gpu="a100")
    assert "\n" not in str(err.value)


@pytest.fixture
def target_cudnn(monkeypatch):
    """jax.nn.dot_product_attention(implementation='cudnn') asks this machine's cuDNN library
    for its version, to choose what to lower; without a GPU install there is none ("cuDNN not
    found."). The version that matters is the target's, so say it. (XLA's compile does not
    need one: the target spec's dnn_version_info changes nothing.)"""
    from jax._src.cudnn import fused_attention_stablehlo  # private: where jax asks
    monkeypatch.setattr(fused_attention_stablehlo, "check_cudnn_version",
                        lambda: TARGET_CUDNN_VERSION)


@pytest.mark.parametrize("data", [1, 8], ids=["one-h100", "eight-h100s"])
def test_gpt_step_with_cudnn_attention_compiles_for_h100s(target_cudnn, data):
    """On 8 devices this needs the step's shard_map manual over every mesh axis: with "model"
    left automatic, cuDNN attention's custom partitioner fails on the manual operands."""
    compiled = compile_gpt_step("cudnn", data=data)
    hlo = compiled.as_text()
    assert 'custom_call_target="__cudnn$fmhaSoftmax"' in hlo
    assert 'custom_call_target="__cudnn$fmhaSoftmaxBackward"' in hlo
