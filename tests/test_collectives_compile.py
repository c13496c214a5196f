"""zeroflow.xla.collectives on a real XLA:GPU program: the stage-3 step of a scanned model
compiled for 8 abstract H100s. Whichever jax compiles it (0.10.2 schedules the backward loop's
reduce-scatter as an asynchronous pair and prints a single gathered operand alone, 0.11 and 0.12
run it in line and print the operand as a tuple), each collective's bytes are those of whole
parameter slices, computed here from the parameter shapes: a layer's bf16 weights gathered, its
fp32 gradients reduce-scattered, never the 1/8 shards."""

import itertools

import jax
import jax.numpy as jnp
import optax
import pytest
from helpers import require_cuda_plugin

pytestmark = pytest.mark.slow

require_cuda_plugin()

import zeroflow as zf  # noqa: E402

D, LAYERS, CLASSES, N = 512, 16, 10, 8


def scan_loss(p, b):
    def body(x, wb):
        w, bias = wb
        return jax.nn.relu(x @ w.astype(x.dtype) + bias.astype(x.dtype)), None
    x, _ = jax.lax.scan(body, b["x"].astype(p["w"].dtype), (p["w"], p["b"]))
    return optax.softmax_cross_entropy_with_integer_labels(
        (x @ p["head"]).astype(jnp.float32), b["y"]).mean()


def _sums(sizes):
    """Bytes of every non-empty combination of the given buffers (XLA may combine them)."""
    return {sum(c) for k in range(1, len(sizes) + 1) for c in itertools.combinations(sizes, k)}


def test_stage3_collectives_move_whole_parameter_slices_on_any_jax():
    params = jax.eval_shape(lambda: {"w": jnp.zeros((LAYERS, D, D)), "b": jnp.zeros((LAYERS, D)),
                                     "head": jnp.zeros((D, CLASSES))})
    batch = {"x": jax.ShapeDtypeStruct((16, D), jnp.float32),
             "y": jax.ShapeDtypeStruct((16,), jnp.int32)}
    plan = zf.ZeroPlan(zf.target_mesh("h100", data=N), stage=3)
    compiled, _ = zf.memory.compile_step(scan_loss, params, batch, optax.adamw(1e-3), plan,
                                         zf.Precision(params="bf16"))
    colls = zf.memory.collectives(compiled)
    # one iteration's slice of each stacked parameter; the head whole
    elements = [p.size // LAYERS for p in (params["w"], params["b"])] + [params["head"].size]
    gathered = [c.bytes for c in colls if c.kind == "all-gather"]
    reduced = [c.bytes for c in colls if c.kind == "reduce-scatter"]
    assert gathered and reduced
    assert set(gathered) <= _sums([2 * e for e in elements]), gathered  # bf16 weights
    assert set(reduced) <= _sums([4 * e for e in elements]), reduced  # fp32 gradients
    # the forward loop gathers a layer's weight and bias together, the backward loop the weight
    assert max(gathered) == 2 * (D * D + D)
    assert 2 * D * D in gathered
    # the backward loop reduce-scatters a layer's two gradients every iteration
    assert any(c.in_loop and c.bytes == 4 * (D * D + D) for c in colls
               if c.kind == "reduce-scatter"), [(c.bytes, c.runs) for c in colls]
