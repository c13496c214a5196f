"""The instant estimate's walk where XLA's buffers and schedule differ from the jaxpr's order: a
scan's stacked outputs are allocated whole before the loop, a reduce-scatter runs where its
operand is made, not where JAX's transpose emits it, elementwise work feeding a reduction is
fused into it, and a transpose that only moves axes of length 1 is a bitcast. Reference: bytes written out by hand (XLA:CPU compiles the first two programs at
these same figures on jax 0.10.2: outputs plus temporaries)."""
import jax
import jax.numpy as jnp
import pytest
from jax.sharding import PartitionSpec as P

from zeroflow.memory.traced import walk

pytestmark = pytest.mark.fast

MB = 1024 * 1024  # one (1024, 256) float32 matrix
ROWS = jax.ShapeDtypeStruct((1024, 256), jnp.float32)
STEPS = 4


def _stacking(x, ws):
    def body(carry, w):
        t = jnp.sin(carry @ w)
        return carry, t @ w

    _, ys = jax.lax.scan(body, x, ws)
    return ys


def test_a_scans_stacked_outputs_are_live_while_its_body_runs():
    """At the body's second matmul: all 4 steps' outputs (4 MB, the stacked buffer), ``t`` and
    this step's output (1 MB each), and this step's slice of ``ws`` copied out for the matmul
    (0.25 MB). Counting only the step's own slice, the walk said 4 MB."""
    ws = jax.ShapeDtypeStruct((STEPS, 256, 256), jnp.float32)
    jaxpr = jax.make_jaxpr(_stacking)(ROWS, ws).jaxpr
    assert walk(jaxpr, [1.0, 1.0]).peak == STEPS * MB + 2 * MB + MB / 4


def test_a_reduce_scatter_frees_its_operand_where_it_is_made():
    """``g`` (0.25 MB) is scattered to its 1/8 before ``h`` (4 MB) and ``k`` (1 MB) are made, as
    a scheduler keeping memory low runs it, though the program asks for it last: 4 + 1 + 1/32
    MB. Holding ``g`` whole until its scatter, the walk said 5.25 MB."""
    mesh = jax.make_mesh((8,), ("d",), devices=jax.devices()[:8])

    def layer(x, dy, w):
        g = x.T @ dy
        h = jnp.sin(dy @ w)
        k = h @ w.T
        return jax.lax.psum_scatter(g, "d", tiled=True), k

    program = jax.shard_map(
        layer, mesh=mesh, in_specs=(P(), P(), P()), out_specs=(P("d"), P()), check_vma=False
    )
    wide = jax.ShapeDtypeStruct((256, 1024), jnp.float32)
    jaxpr = jax.make_jaxpr(program)(ROWS, ROWS, wide).jaxpr
    assert walk(jaxpr, [1.0, 1.0, 1.0]).peak == 4 * MB + MB + MB / 32


def test_elementwise_work_read_by_reductions_is_fused_into_them():
    """A layer norm in fp32 on bf16 input: the fp32 copy and the centred values are read only by
    reductions and elementwise operations, so XLA computes them inside those fusions and never
    writes them out. What is kept: the normalised bf16 input of the matmul and its product, 0.5
    MB each. Holding the fp32 copy (1 MB) and the centred values, the walk said 2 MB."""

    def norm_then_matmul(x, w):
        x32 = x.astype(jnp.float32)
        centred = x32 - jnp.mean(x32, axis=-1, keepdims=True)
        scale = jax.lax.rsqrt(jnp.mean(centred * centred, axis=-1, keepdims=True) + 1e-6)
        return (centred * scale).astype(jnp.bfloat16) @ w

    x = jax.ShapeDtypeStruct((1024, 256), jnp.bfloat16)
    w = jax.ShapeDtypeStruct((256, 256), jnp.bfloat16)
    jaxpr = jax.make_jaxpr(norm_then_matmul)(x, w).jaxpr
    assert walk(jaxpr, [1.0, 1.0]).peak == MB / 2 + MB / 2


def test_a_transpose_moving_only_unit_axes_is_a_view():
    """``[1, chunks, rows, width]`` turned ``[chunks, 1, rows, width]`` (how a sequence split
    into chunks is handed to the loop over them) keeps every byte where it was: XLA makes it a
    bitcast. What is kept is the matmul's product alone, 1 MB; copying the input for the
    transpose, the walk said 2 MB."""

    def chunked_matmul(x, w):
        chunks = jnp.transpose(x, (1, 0, 2, 3))
        return chunks.reshape(1024, 256) @ w

    x = jax.ShapeDtypeStruct((1, 4, 256, 256), jnp.float32)
    w = jax.ShapeDtypeStruct((256, 256), jnp.float32)
    jaxpr = jax.make_jaxpr(chunked_matmul)(x, w).jaxpr
    assert walk(jaxpr, [1.0, 1.0]).peak == MB


def test_on_gpus_a_reduce_scatter_starts_in_the_loop_and_an_all_reduce_after_it():
    """XLA:GPU starts a reduce-scatter of a loop's result inside the loop's last step, so its
    result (1/8 MB) is live at the body's fullest (2 MB of matmul outputs and the step's 0.25 MB
    slice of ``ws``); it does not pipeline all-reduces (its compiled schedule starts the
    gradients' all-reduce after the backward loop), so the all-reduce's 1 MB is not."""
    mesh = jax.make_mesh((8,), ("d",), devices=jax.devices()[:8])

    def layers(x, ws):
        out, _ = jax.lax.scan(lambda c, w: (c + jnp.sin(c @ w) @ w, None), x, ws)
        return jax.lax.psum(out, "d"), jax.lax.psum_scatter(out, "d", tiled=True)

    program = jax.shard_map(
        layers, mesh=mesh, in_specs=(P(), P()), out_specs=(P(), P("d")), check_vma=False
    )
    ws = jax.ShapeDtypeStruct((STEPS, 256, 256), jnp.float32)
    jaxpr = jax.make_jaxpr(program)(ROWS, ws).jaxpr
    assert walk(jaxpr, [1.0, 1.0], overlap=True).peak == 2 * MB + MB / 4 + MB / 8
