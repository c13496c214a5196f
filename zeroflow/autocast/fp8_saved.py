"""Saved activations in FP8: the values a remat policy keeps for the backward pass stored as
``float8_e4m3fn`` with one scale per tensor, dequantized where the backward pass reads them.

``saved_in_fp8(x)`` rounds ``x`` through e4m3: it returns ``dequantize(quantize(x))`` in ``x``'s
dtype and names the e4m3 bytes and their scale (``FP8_BYTES``, ``FP8_SCALE``), which
``policy()`` saves and nothing else. Under ``jax.checkpoint(fn, policy=policy())`` the backward
pass then recomputes every other value of ``fn`` from those bytes, so the matmul that produced
``x`` is not run again and what stays in memory between the passes is one byte per element.
The gradient passes straight through the rounding (a ``custom_jvp`` whose tangent is ``x``'s),
and the forward pass uses the rounded values too, so the backward pass differentiates exactly
the function the forward pass computed: the approximation is the rounding itself (at most
``2^-4`` of an element's magnitude, or half an e4m3 subnormal step times the scale).

``checkpoint_fp8_dots(fn)`` does this to an unmodified function: every ``dot_general`` without
batch dimensions (what ``jax.checkpoint_policies.dots_with_no_batch_dims_saveable`` would save
in the compute dtype) has its output rounded through e4m3, and ``fn`` runs under
``jax.checkpoint`` with ``policy()``. zeroflow's GPT calls ``saved_in_fp8`` at its named
matmul outputs itself (``model.remat_dtype: fp8``).

The bytes are saved as ``uint8`` (see ``fp8._as_bytes``: a float8 residual would pass through
``reduce_precision`` with IEEE e4m3's smaller range). A non-finite element makes the scale
non-finite and the rounded tensor NaN, so loss scaling still sees an overflowing step.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.ad_checkpoint import checkpoint_name
from jax.extend import core as jcore

from zeroflow.autocast.fp8 import E4M3, quantize, scale_of
from zeroflow.util import jaxprs

FP8_BYTES = "fp8_saved"
"Name (``checkpoint_name``) of every e4m3 tensor ``saved_in_fp8`` keeps, as bytes."
FP8_SCALE = "fp8_saved_scale"
"Name of the fp32 scale beside it."
FP8_NAMES = (FP8_BYTES, FP8_SCALE)


@jax.custom_jvp
def _dequantized(x, q, scale):
    """``q`` (e4m3 bytes) times ``scale`` in ``x``'s dtype; ``x`` is there for its tangent."""
    return _dequantize(q, scale, x.dtype)


def _dequantized_jvp(primals, tangents):
    # The primal result reads only the bytes and the scale: a backward pass that needs it
    # recomputes it from them, never from x (whose producer would have to run again).
    x, q, scale = primals
    return _dequantize(q, scale, x.dtype), tangents[0]


_dequantized.defjvp(_dequantized_jvp)


def _dequantize(q, scale, dtype):
    return (lax.bitcast_convert_type(q, E4M3).astype(jnp.float32) * scale).astype(dtype)


def saved_in_fp8(x: jax.Array) -> jax.Array:
    """``x`` rounded through e4m3 with a per-tensor scale, its bytes and scale named
    ``FP8_BYTES`` / ``FP8_SCALE`` for ``policy()``; gradient: the identity."""
    return _dequantized(x, *fp8_parts(x))


def fp8_parts(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The e4m3 bytes (``uint8``, ``x``'s shape) and the fp32 scale ``saved_in_fp8`` rounds
    ``x`` through, named ``FP8_BYTES`` / ``FP8_SCALE``: a caller that reads ``x`` in pieces
    slices the bytes and calls ``dequantized`` on each piece with the whole tensor's scale."""
    frozen = lax.stop_gradient(x)
    scale = checkpoint_name(scale_of(frozen, E4M3), FP8_SCALE)
    q = lax.bitcast_convert_type(quantize(frozen, scale, E4M3), jnp.uint8)
    return checkpoint_name(q, FP8_BYTES), scale


def dequantized(q: jax.Array, scale: jax.Array, dtype) -> jax.Array:
    """The value of the bytes ``q`` (``fp8_parts``) with ``scale``, in ``dtype``."""
    return _dequantize(q, scale, dtype)


def policy(offload: bool = False):
    """A ``jax.checkpoint`` policy saving only what ``saved_in_fp8`` named; ``offload``: in
    pinned host memory instead of device memory."""
    if not offload:
        return jax.checkpoint_policies.save_only_these_names(*FP8_NAMES)
    return jax.checkpoint_policies.save_and_offload_only_these_names(
        names_which_can_be_saved=[],
        names_which_can_be_offloaded=list(FP8_NAMES),
        offload_src="device",
        offload_dst="pinned_host",
    )


def is_saved_dot(eqn) -> bool:
    """A ``dot_general`` without batch dimensions: what ``dots_with_no_batch_dims_saveable``
    saves (a weight matmul, not attention's batched products)."""
    if eqn.primitive.name != "dot_general":
        return False
    (_, _), (lhs_batch, _) = eqn.params["dimension_numbers"]
    return not lhs_batch and jnp.issubdtype(eqn.outvars[0].aval.dtype, jnp.floating)


def _replay(jaxpr, consts, args):
    env = dict(zip(jaxpr.constvars, consts))
    env.update(zip(jaxpr.invars, args))

    def read(atom):
        return atom.val if isinstance(atom, jcore.Literal) else env[atom]

    for eqn in jaxpr.eqns:
        values = [read(a) for a in eqn.invars]
        body = jaxprs.call_body(eqn)
        with jaxprs.source_context(eqn):
            if body is not None:
                outs = _replay(*jaxprs.open_jaxpr(body), values)
            else:
                outs = jaxprs.bind(eqn, values)
        if is_saved_dot(eqn):
            outs = [saved_in_fp8(outs[0])]
        env.update(zip(eqn.outvars, outs))
    return [read(a) for a in jaxpr.outvars]


def checkpoint_fp8_dots(fn, prevent_cse: bool = True, offload: bool = False):
    """``fn`` under ``jax.checkpoint`` keeping its weight-matmul outputs in FP8 (module
    docstring). Calls inside ``fn`` (``jit``) are inlined; loops and other higher-order
    operations inside it run as they are (their dots are not rounded)."""

    @functools.wraps(fn)
    def rounded(*args):
        leaves, tree = jax.tree.flatten(args)
        closed, out_shape = jax.make_jaxpr(
            lambda *flat: fn(*jax.tree.unflatten(tree, flat)), return_shape=True
        )(*leaves)
        outs = _replay(closed.jaxpr, closed.consts, leaves)
        return jax.tree.unflatten(jax.tree.structure(out_shape), outs)

    return jax.checkpoint(rounded, prevent_cse=prevent_cse, policy=policy(offload))
