"""The plain ``jax.jit`` GSPMD FSDP step for ``experiments/fp8.py``'s rows: bf16 as
``experiments/vs_gspmd.py``'s strongest baseline builds it (every activation constrained to
batch sharding, an XLA option set of ``experiments/xla_option_sets.py``), and the same step with
each of a layer's seven weight matmuls through Flax's FP8 dot
(``flax.linen.fp8_ops.fp8_scaled_dot_general``, what ``Fp8DirectDotGeneralOp`` calls: e4m3
operands, e5m2 output gradient, delayed scaling from a 1,024-step amax history).

Flax keeps each FP8 dot's scales and amax histories in the ``_overwrite_with_gradient``
collection: their "gradients" are their next values. Here they are a second tree beside the
parameters, stacked per layer like the weights, replicated, and replaced by their gradients
each step, as a Flax training loop does with that collection. The head stays bf16, as in
zeroflow's FP8 rows (``fp8_keep_scopes``).
"""
from __future__ import annotations

from zeroflow.cli.common import start_script

start_script()  # before jax: where the CUDA plugin has no driver, a CPU jax without its noise

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

MATMULS = ("wq", "wk", "wv", "wo", "w1", "w3", "w2")
HISTORY = 1024
"Flax's default amax history length (``Fp8DotGeneralBase.amax_history_length``)."


def fp8_meta(layers: int, history: int = HISTORY) -> dict:
    """Per weight matmul and layer: Flax's three scales (1,) and three amax histories."""
    def one():
        return {**{k: jax.ShapeDtypeStruct((layers, 1), jnp.float32)
                   for k in ("lhs_scale", "rhs_scale", "grad_scale")},
                **{k: jax.ShapeDtypeStruct((layers, history), jnp.float32)
                   for k in ("lhs_amax_history", "rhs_amax_history", "grad_amax_history")}}
    return {name: one() for name in MATMULS}


def flax_fp8_matmul(meta: dict):
    """``matmul(x, w, name)`` for ``llama_shapes._layer``: Flax's FP8 dot with one layer's
    ``meta``, output in ``x``'s dtype (as ``Fp8DirectDotGeneralOp`` asks)."""
    from flax.linen.fp8_ops import fp8_scaled_dot_general

    def matmul(x, w, name):
        dims = (((x.ndim - 1,), (0,)), ((), ()))
        return fp8_scaled_dot_general(x, w, dims, preferred_element_type=x.dtype,
                                      quantize_compute_type=x.dtype, **meta[name])
    return matmul


def fp8_loss(shape: dict, remat: str, constrain, attention: str):
    """``llama_shapes.make_loss``'s loss with Flax's FP8 dot in every layer matmul:
    ``loss(params, meta, batch)``."""
    from llama_shapes import POLICIES, _layer, _rms_norm

    def layer(x, xs):
        p, meta = xs
        return _layer(shape, jnp.bfloat16, x, p, constrain, attention, flax_fp8_matmul(meta))

    body = jax.checkpoint(layer, policy=POLICIES[remat])

    def loss(params, meta, batch):
        tokens = batch["tokens"]
        x = constrain(params["embed"].astype(jnp.bfloat16)[tokens[:, :-1]])
        x, _ = jax.lax.scan(body, x, (params["layers"], meta))
        x = constrain(_rms_norm(x, params["norm"].astype(jnp.bfloat16)))
        logits = constrain((x @ params["head"].astype(jnp.bfloat16)).astype(jnp.float32))
        return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()
    return loss


def compile_fp8_step(loss, params, meta, batch, tx, mesh, options: dict):
    """The plain jit step of ``fp8_loss``: parameters and optimizer state FSDP-sharded as
    ``vs_gspmd.compile_plain`` shards them, the FP8 meta replicated and overwritten by its
    gradient, everything donated."""
    from vs_gspmd import fsdp_spec

    devices = mesh.shape["data"]

    def shard(tree):
        return jax.tree.map(lambda x: NamedSharding(mesh, fsdp_spec(x.shape, devices, False)),
                            tree)

    def step(state, batch):
        p, m, opt = state
        value, (grads, new_meta) = jax.value_and_grad(loss, argnums=(0, 1))(p, m, batch)
        updates, opt = tx.update(grads, opt, p)
        return (optax.apply_updates(p, updates), new_meta, opt), value

    opt = jax.eval_shape(tx.init, params)
    replicated = jax.tree.map(lambda _: NamedSharding(mesh, P()), meta)
    shardings = (shard(params), replicated, shard(opt))
    jitted = jax.jit(step, in_shardings=(shardings, NamedSharding(mesh, P("data"))),
                     out_shardings=(shardings, NamedSharding(mesh, P())), donate_argnums=0)
    return jitted.lower((params, meta, opt), batch).compile(options or None)


def compile_gspmd(row: dict, shape: dict, params, batch, tx, mesh):
    """The row's GSPMD step (``row["variant"]``: "bf16" or "flax fp8"), compiled with the XLA
    option set ``row["options"]``."""
    from llama_shapes import batch_constraint, make_loss
    from vs_gspmd import compile_plain
    from xla_option_sets import option_set

    from zeroflow import backend

    options = option_set(row["options"], backend.of(mesh))
    constrain = batch_constraint(mesh)
    attention = row.get("attention", "xla")
    if row["variant"] == "bf16":
        loss = make_loss(shape, row["remat"], constrain=constrain, attention=attention)
        return compile_plain(loss, params, batch, tx, mesh, False, options)
    if row["variant"] != "flax fp8":
        raise ValueError(f"GSPMD variant {row['variant']!r}: accepted bf16, flax fp8")
    loss = fp8_loss(shape, row["remat"], constrain, attention)
    return compile_fp8_step(loss, params, fp8_meta(shape["layers"]), batch, tx, mesh, options)
