"""zeroflow.xla.collectives on HLO text in each form XLA:GPU prints it, reduced to a few lines
of real compiled programs: the stage-3 step of a scanned 16-layer model (512 x 512 bf16 weights,
512 biases, a 512 x 10 head, fp32 gradients) compiled for 8 abstract H100s by jax 0.10.2, 0.11.2
and 0.12.0.1. What each collective holds (an all-gather's gathered result, a reduce-scatter's
whole input, an all-reduce's buffer) must read the same on every form; the expected bytes are the
shapes multiplied out by hand."""

import importlib

import pytest

pytestmark = pytest.mark.fast

# the module, not the function zeroflow.memory re-exports under the same name
collectives = importlib.import_module("zeroflow.xla.collectives")
hlo = importlib.import_module("zeroflow.xla.hlo")

BF16, F32 = 2, 4
WEIGHT, BIAS, HEAD = 512 * 512, 512, 512 * 10  # elements of one layer's slice, and the head's
SLICE = 8  # devices: a shard is 1/8 of the gathered (or reduced) buffer
SYNC = '"collective_backend_config":{"is_sync":true}'
ASYNC = '"collective_backend_config":{"is_sync":false}'

# jax 0.10.2: a single-operand all-gather-start returns (operand, result), a combined one
# ((operands), (results)); the backward loop's reduce-scatter is an asynchronous pair.
JAX_0_10 = f"""HloModule m

ENTRY %main.18_spmd (p: bf16[64,512]) -> f32[2] {{
  %bitcast.2.0 = bf16[64,512]{{1,0}} bitcast(%loop_convert_fusion)
  %bitcast.3.0 = bf16[64]{{0}} bitcast(%loop_convert_fusion.1)
  %all-gather-start = ((bf16[64,512]{{1,0}}, bf16[64]{{0}}), (bf16[512,512]{{1,0}}, bf16[512]{{0}})) all-gather-start(%bitcast.2.0, %bitcast.3.0), channel_id=9, replica_groups={{{{0,1,2,3,4,5,6,7}}}}, dimensions={{0}}, use_global_device_ids=true, backend_config={{{ASYNC}}}
  %bitcast.8.0 = bf16[64,512]{{1,0}} bitcast(%loop_convert_fusion.2)
  %all-gather-start.1 = (bf16[64,512]{{1,0}}, bf16[512,512]{{1,0}}) all-gather-start(%bitcast.8.0), channel_id=12, replica_groups={{{{0,1,2,3,4,5,6,7}}}}, dimensions={{0}}, use_global_device_ids=true, backend_config={{{ASYNC}}}
  %loop_reduce_fusion = f32[512]{{0}} fusion(%loop_select_fusion), kind=kLoop, calls=%fused_reduce
  %wrapped_convert.1 = f32[512,512]{{1,0}} fusion(%gemm_fusion_transpose.9), kind=kLoop, calls=%wrapped_convert_computation.1
  %reduce-scatter-start = ((f32[512]{{0}}, f32[512,512]{{1,0}}), (f32[64]{{0}}, f32[64,512]{{1,0}})) reduce-scatter-start(%loop_reduce_fusion, %wrapped_convert.1), channel_id=13, replica_groups={{{{0,1,2,3,4,5,6,7}}}}, use_global_device_ids=true, dimensions={{0}}, to_apply=%region_7.7.clone, backend_config={{{ASYNC}}}
  %gemm_fusion = bf16[16,512]{{1,0}} fusion(%p, %p), kind=kCustom, calls=%gemm
  %all-gather-done = (bf16[512,512]{{1,0}}, bf16[512]{{0}}) all-gather-done(%all-gather-start)
  %all-gather-done.1 = bf16[512,512]{{1,0}} all-gather-done(%all-gather-start.1)
  %reduce-scatter-done = (f32[64]{{0}}, f32[64,512]{{1,0}}) reduce-scatter-done(%reduce-scatter-start)
  %all-reduce-start = f32[2]{{0}} all-reduce-start(%wrapped_concatenate), channel_id=6, replica_groups=mesh['axis_0'=1,'axis_1'=8] {{'axis_1'}}, use_global_device_ids=true, to_apply=%region_13.15.clone, backend_config={{{SYNC}}}
  ROOT %all-reduce-done = f32[2]{{0}} all-reduce-done(%all-reduce-start)
}}
"""

# jax 0.11.2 (and 0.12.0.1, which prints the same): a single operand of an all-gather-start is
# printed as a one-element tuple, ((operand), result); the backward loop's reduce-scatter runs in
# line (no pair), its result the output slices and its operands named without their types.
JAX_0_11 = f"""HloModule m

ENTRY %main.18_spmd (p: bf16[64,512]) -> f32[2] {{
  %bitcast.2.0 = bf16[64,512]{{1,0}} bitcast(%loop_convert_fusion)
  %bitcast.3.0 = bf16[64]{{0}} bitcast(%loop_convert_fusion.1)
  %all-gather-start = ((bf16[64,512]{{1,0}}, bf16[64]{{0}}), (bf16[512,512]{{1,0}}, bf16[512]{{0}})) all-gather-start(%bitcast.2.0, %bitcast.3.0), channel_id=5, replica_groups=mesh['data'=8,'model'=1] {{'data'}}, dimensions={{0}}, use_global_device_ids=true, backend_config={{{ASYNC}}}
  %loop_reduce_fusion = f32[512]{{0}} fusion(%loop_select_fusion), kind=kLoop, calls=%fused_reduce
  %wrapped_convert.1 = f32[512,512]{{1,0}} fusion(%gemm_fusion_transpose.8), kind=kLoop, calls=%wrapped_convert_computation.1
  %reduce-scatter.4 = (f32[64]{{0}}, f32[64,512]{{1,0}}) reduce-scatter(%loop_reduce_fusion, %wrapped_convert.1), channel_id=9, replica_groups=mesh['data'=8,'model'=1] {{'data'}}, use_global_device_ids=true, dimensions={{0}}, to_apply=%region_7.7.clone
  %bitcast.8.0 = bf16[64,512]{{1,0}} bitcast(%loop_convert_fusion.2)
  %all-gather-start.1 = ((bf16[64,512]{{1,0}}), bf16[512,512]{{1,0}}) all-gather-start(%bitcast.8.0), channel_id=8, replica_groups=mesh['data'=8,'model'=1] {{'data'}}, dimensions={{0}}, use_global_device_ids=true, backend_config={{{ASYNC}}}
  %gemm_fusion = bf16[16,512]{{1,0}} fusion(%p, %p), kind=kCustom, calls=%gemm
  %all-gather-done = (bf16[512,512]{{1,0}}, bf16[512]{{0}}) all-gather-done(%all-gather-start)
  %all-gather-done.1 = bf16[512,512]{{1,0}} all-gather-done(%all-gather-start.1)
  ROOT %all-reduce.8 = f32[2]{{0}} all-reduce(%wrapped_concatenate), channel_id=2, replica_groups=mesh['data'=8,'model'=1] {{'data'}}, use_global_device_ids=true, to_apply=%region_13.15.clone
}}
"""

# jax 0.12.0.1: the last, combined reduce-scatter (a layer's weight and bias and the head) in line.
JAX_0_12_COMBINED = """HloModule m

ENTRY %main.18_spmd (p: f32[2]) -> f32[2] {
  %wrapped_convert.2 = f32[512,512]{1,0} fusion(%gemm_fusion_transpose.2), kind=kLoop, calls=%wrapped_convert_computation.2
  %loop_reduce_fusion.1 = f32[512]{0} fusion(%loop_select_fusion.1), kind=kLoop, calls=%fused_reduce.1
  %wrapped_convert.3 = f32[512,10]{1,0} fusion(%gemm_fusion_transpose.3), kind=kLoop, calls=%wrapped_convert_computation.3
  ROOT %reduce-scatter.5 = (f32[64,512]{1,0}, f32[64]{0}, f32[64,10]{1,0}) reduce-scatter(%wrapped_convert.2, %loop_reduce_fusion.1, %wrapped_convert.3), channel_id=12, replica_groups=mesh['data'=8,'model'=1] {'data'}, use_global_device_ids=true, dimensions={0}, to_apply=%region_8.8
}
"""

# jax 0.10.2's form of the same: an asynchronous start whose operands are its first part.
JAX_0_10_COMBINED = """HloModule m

ENTRY %main.18_spmd (p: f32[2]) -> f32[2] {
  %reduce-scatter-start.1 = ((f32[512,512]{1,0}, f32[512]{0}, f32[512,10]{1,0}), (f32[64,512]{1,0}, f32[64]{0}, f32[64,10]{1,0})) reduce-scatter-start(%wrapped_convert.2, %loop_reduce_fusion.1, %wrapped_convert.3), channel_id=16, replica_groups={{0,1,2,3,4,5,6,7}}, use_global_device_ids=true, dimensions={0}, to_apply=%region_8.8
  ROOT %reduce-scatter-done.1 = (f32[64,512]{1,0}, f32[64]{0}, f32[64,10]{1,0}) reduce-scatter-done(%reduce-scatter-start.1)
}
"""

# Every form: the forward gather of a layer's weight and bias, the backward gather of its
# weight, the reduce-scatter of its two gradients, the loss's two-float all-reduce.
EXPECTED = {
    "all-gather-start": ("all-gather", (WEIGHT + BIAS) * BF16),
    "all-gather-start.1": ("all-gather", WEIGHT * BF16),
    "reduce-scatter": ("reduce-scatter", (WEIGHT + BIAS) * F32),
    "all-reduce": ("all-reduce", 2 * F32),
}


def _by_role(colls):
    """Name each collective by its role, whatever the jax version called it."""
    out = {}
    for c in colls:
        role = c.name if c.kind == "all-gather" else c.kind
        out[role] = (c.kind, c.bytes)
    return out


@pytest.mark.parametrize("text", [JAX_0_10, JAX_0_11], ids=["jax-0.10", "jax-0.11-and-0.12"])
def test_each_collective_reads_the_same_bytes_on_every_jax(text):
    assert _by_role(collectives.collectives(text)) == EXPECTED


@pytest.mark.parametrize("text", [JAX_0_10_COMBINED, JAX_0_12_COMBINED],
                         ids=["jax-0.10-async", "jax-0.12-in-line"])
def test_a_combined_reduce_scatter_reads_its_whole_inputs(text):
    (rs,) = collectives.collectives(text)
    assert rs.kind == "reduce-scatter"
    assert rs.bytes == (WEIGHT + BIAS + HEAD) * F32


def test_gathers_overlap_the_gemm_between_start_and_done_in_either_form():
    for text in (JAX_0_10, JAX_0_11):
        gathers = [c for c in collectives.collectives(text) if c.kind == "all-gather"]
        assert [c.overlapped for c in gathers] == [True, True]


@pytest.mark.parametrize("text", [JAX_0_10, JAX_0_11], ids=["jax-0.10", "jax-0.11-and-0.12"])
def test_host_traffic_counts_the_slices_each_peer_needs(text):
    """Two hosts of four devices: a device sends each of its 3 host peers and 4 remote peers the
    slice that peer owns (1/8 of a gathered weight; a reduce-scatter's output slice)."""
    hosts = (0, 0, 0, 0, 1, 1, 1, 1)
    got = {(c.kind, c.bytes): (c.within_host, c.cross_host)
           for c in collectives.collectives(text, hosts=hosts)}
    piece = WEIGHT * BF16 // SLICE
    assert got[("all-gather", WEIGHT * BF16)] == (3 * piece, 4 * piece)
    piece = (WEIGHT + BIAS) * F32 // SLICE
    assert got[("reduce-scatter", (WEIGHT + BIAS) * F32)] == (3 * piece, 4 * piece)


@pytest.mark.parametrize("type_text, size", [
    ("bf16[512,512]{1,0}", 512 * 512 * 2),
    ("((bf16[64,512]{1,0}), bf16[512,512]{1,0})", (64 + 512) * 512 * 2),
    ("(f32[2]{0}, f32[3]{0}, f32[4]{0}, f32[5]{0}, f32[6]{0}, /*index=5*/f32[7]{0})", 27 * 4),
    ("(s4[64]{0:E(4)}, f8e4m3fn[8,8]{1,0:T(8,128)}, pred[], token[])", 32 + 64 + 1),
])
def test_type_sizes(type_text, size):
    assert hlo.size(hlo.type_tree(type_text)) == size
