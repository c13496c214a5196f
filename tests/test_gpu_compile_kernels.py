"""Kernels and the GPT step compiled for H100s (sm_90) that are not there.

``zeroflow.backend.target_mesh`` gives abstract "NVIDIA H100 80GB HBM3" devices from the CUDA
plugin; arguments sharded over such a mesh make ``jax.jit(...).trace(...).lower().compile()`` a
real XLA:GPU compile on a CPU-only machine. Pallas kernels then appear in the optimized HLO as
Triton custom calls (flash attention), which XLA compiles with the rest of the program, or as
Mosaic GPU custom calls (block-sparse matmul), compiled for sm_90 while lowering: a lowering
error or a tile over the H100's shared memory fails here. Autotuning, numerics and speed are left
to a real GPU (the interpret-mode tests check the numerics).

Shapes are small and the cases cover each property once (dtype, head size, GQA/MQA, causal,
window) rather than their product: each Triton compile takes seconds.
"""
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from helpers import require_cuda_plugin

require_cuda_plugin()

from pallas_kernels import (  # noqa: E402
    BlockSizes,
    block_sparse_matmul,
    flash_attention,
    random_layout,
)
from pallas_kernels._backend import compiling_for  # noqa: E402
from pallas_kernels._mosaic import kernel_names  # noqa: E402
from zeroflow.backend import target_mesh  # noqa: E402
from zeroflow.config.io import load_config  # noqa: E402
from zeroflow.trainer.setup import build_run  # noqa: E402

from helpers import REPO  # noqa: E402

TRITON_CALL = "__gpu$xla.gpu.triton"
FLASH_FWD = ["flash_attention_fwd"]
FLASH_FWD_BWD = ["flash_attention_dkv", "flash_attention_dq", "flash_attention_fwd"]
_TRITON_KERNEL = re.compile(r'custom_call_target="__gpu\$xla\.gpu\.triton".*?\bname = "([^"]+)"')


def triton_kernels(compiled) -> list[str]:
    """Sorted names of the Triton kernels the optimized HLO calls (one per call site)."""
    hlo = compiled.as_text()
    names = sorted(m.group(1) for line in hlo.splitlines() if (m := _TRITON_KERNEL.search(line)))
    assert len(names) == hlo.count(f'custom_call_target="{TRITON_CALL}"'), "unnamed Triton call"
    return names


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
def one_h100():
    return target_mesh("h100", data=1)


def on_one_h100(shape, dtype):
    return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(one_h100(), P()))


def fwd_and_grads(fn):
    """The output of ``fn`` and the gradients of its sum: its forward and backward kernels."""
    def both(*args):
        out, vjp = jax.vjp(fn, *args)
        return out, vjp(jnp.ones_like(out))
    return both


# (dtype, batch, seq, heads, kv_heads, head_dim, causal, window)
FLASH_CASES = [
    pytest.param(jnp.bfloat16, 2, 256, 4, 2, 64, True, None, id="bf16-gqa-causal-d64"),
    pytest.param(jnp.float16, 1, 512, 4, 1, 128, False, None, id="fp16-mqa-d128"),
    pytest.param(jnp.bfloat16, 1, 300, 4, 1, 80, True, (96, 0),
                 id="bf16-mqa-causal-window-d80-padded"),
    pytest.param(jnp.float16, 2, 256, 6, 2, 64, False, 48, id="fp16-gqa-symmetric-window"),
]


@pytest.mark.parametrize("dtype,batch,seq,heads,kv_heads,head_dim,causal,window", FLASH_CASES)
def test_flash_attention_compiles_for_h100(dtype, batch, seq, heads, kv_heads, head_dim, causal,
                                           window):
    """Forward alone, then forward with dq/dk/dv: every kernel is a compiled Triton call. The
    default tiles are the ones a GPU run uses; head_dim 80 is padded to 128 inside, a sequence
    of 300 to whole tiles."""
    q = on_one_h100((batch, seq, heads, head_dim), dtype)
    kv = on_one_h100((batch, seq, kv_heads, head_dim), dtype)
    attention = functools.partial(flash_attention, causal=causal, window=window)

    assert triton_kernels(compile_for_gpu(attention, q, kv, kv)) == FLASH_FWD
    both = compile_for_gpu(fwd_and_grads(attention), q, kv, kv)
    assert triton_kernels(both) == FLASH_FWD_BWD


def test_flash_attention_inside_shard_map_over_eight_h100s_needs_no_context():
    """Inside shard_map the mesh says the kernels are for a GPU (no ``compiling_for``), as in a
    data-parallel step; small backward tiles that differ from the forward ones."""
    mesh = target_mesh("h100", data=8)
    q = jax.ShapeDtypeStruct((8, 256, 4, 64), jnp.bfloat16, sharding=NamedSharding(mesh, P("data")))
    blocks = BlockSizes(block_q=64, block_k=32, block_q_bwd=32, block_k_bwd=32)
    attention = functools.partial(flash_attention, causal=True, block_sizes=blocks)
    per_device = jax.shard_map(fwd_and_grads(attention), mesh=mesh,
                               in_specs=P("data"), out_specs=P("data"))
    compiled = jax.jit(per_device).trace(q, q, q).lower().compile()
    assert compiled.memory_analysis() is not None
    assert triton_kernels(compiled) == FLASH_FWD_BWD


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


def compile_gpt_step(attention: str, data: int):
    """The trainer's step (``build_run``, as ``zeroflow.memory.measure`` builds it) of a
    shrunk ``configs/tiny.yaml``, ZeRO-3 with bf16 params, compiled for ``data`` H100s."""
    cfg = load_config(REPO / "configs" / "tiny.yaml", [
        f"model.attention={attention}", "model.num_layers=1", "model.seq_len=128",
        "model.embed_dim=64", "model.num_heads=2", "model.mlp_dim=128",
        f"train.batch_size={data}", "parallel.zero_stage=3", "precision.params=bf16"])
    run = build_run(cfg, with_data=False, mesh=target_mesh("h100", data=data))
    batch = {"tokens": jax.ShapeDtypeStruct((cfg.train.batch_size, cfg.model.seq_len + 1),
                                            np.int32, sharding=run.plan.batch_sharding())}
    compiled = run.make_step().lower(run.abstract_state(), batch).compile()
    assert compiled.memory_analysis() is not None
    return compiled


def test_gpt_step_with_pallas_attention_compiles_for_eight_h100s():
    """The step traces its kernels for the mesh's GPUs: Triton calls, no interpreter."""
    compiled = compile_gpt_step("pallas", data=8)
    assert sorted(set(triton_kernels(compiled))) == FLASH_FWD_BWD


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
