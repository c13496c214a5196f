"""AdamW with compact moments: blockwise 8-bit (2 bytes per parameter plus one fp32 scale per
block and moment) or bf16 (4 bytes per parameter), instead of optax's 8 bytes of fp32.

Each is an optax ``GradientTransformation``; the state's trees have the parameters' structure,
so ZeRO shards them like any optimizer state: the codes and the bf16 moments have each
parameter's shape and are split with it, the per-block scales are split along their own largest
dimension (``zeroflow.state.state_layouts``). The update dequantizes, runs Adam in fp32 and
quantizes the new moments again, one parameter at a time.
"""
from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from optax import tree_utils as otu

from zeroflow.optim import blockwise as q

ADAMW_CHOICES = ("adamw", "adamw_8bit", "adamw_bf16")
"AdamW by how its moments are stored: fp32 (``optax.adamw``), 8-bit blockwise, bf16."


class ScaleByAdam8bitState(NamedTuple):
    """``mu_*``: the first moment (signed map), ``nu_*``: the second (unsigned map); codes are
    uint8 of each parameter's shape, scales fp32 of ``blockwise.scales_shape``."""
    count: jax.Array
    mu_codes: optax.Updates
    mu_scales: optax.Updates
    nu_codes: optax.Updates
    nu_scales: optax.Updates


class ScaleByAdamBf16State(NamedTuple):
    count: jax.Array
    mu: optax.Updates
    nu: optax.Updates


def _adam_direction(g, mu, nu, count, b1, b2, eps):
    """One Adam step on fp32 arrays: the new moments and the bias-corrected direction."""
    g = g.astype(jnp.float32)
    mu = b1 * mu + (1 - b1) * g
    nu = b2 * nu + (1 - b2) * jnp.square(g)
    mu_hat = mu / (1 - b1 ** count)
    nu_hat = nu / (1 - b2 ** count)
    return mu, nu, mu_hat / (jnp.sqrt(nu_hat) + eps)


def _unzip(like, tree_of_tuples) -> tuple:
    """A tree (of ``like``'s structure) of equal-length tuples -> a tuple of trees."""
    treedef = jax.tree.structure(like)
    return tuple(treedef.unflatten(x) for x in zip(*treedef.flatten_up_to(tree_of_tuples)))


def _check(b1, b2, eps, block_size=1):
    if not (0 <= b1 < 1 and 0 <= b2 < 1):
        raise ValueError(f"b1 and b2 must be in [0, 1), got b1={b1}, b2={b2}")
    if eps < 0:
        raise ValueError(f"eps must be >= 0, got {eps}")
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size must be a positive integer, got {block_size!r}")


def scale_by_adam_8bit(b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8,
                       block_size: int = 256) -> optax.GradientTransformation:
    """Adam's scaling with both moments stored blockwise-quantized to 8 bits
    (``zeroflow.optim.blockwise``)."""
    _check(b1, b2, eps, block_size)
    m0, v0 = q.zero_code(signed=True), q.zero_code(signed=False)

    def init_fn(params):
        def codes(code):
            return lambda p: jnp.full(jnp.shape(p), code, jnp.uint8)

        def scales(p):
            return jnp.zeros(q.scales_shape(jnp.shape(p), block_size), jnp.float32)
        return ScaleByAdam8bitState(
            count=jnp.zeros([], jnp.int32), mu_codes=jax.tree.map(codes(m0), params),
            mu_scales=jax.tree.map(scales, params), nu_codes=jax.tree.map(codes(v0), params),
            nu_scales=jax.tree.map(scales, params))

    def update_fn(updates, state, params=None):
        del params
        count = optax.safe_increment(state.count)

        def one(g, mu_codes, mu_scales, nu_codes, nu_scales):
            mu = q.dequantize(mu_codes, mu_scales, block_size, signed=True)
            nu = q.dequantize(nu_codes, nu_scales, block_size, signed=False)
            mu, nu, direction = _adam_direction(g, mu, nu, count, b1, b2, eps)
            return (direction.astype(g.dtype), *q.quantize(mu, block_size, signed=True),
                    *q.quantize(nu, block_size, signed=False))

        direction, mu_codes, mu_scales, nu_codes, nu_scales = _unzip(
            updates, jax.tree.map(one, updates, state.mu_codes, state.mu_scales,
                                  state.nu_codes, state.nu_scales))
        return direction, ScaleByAdam8bitState(count, mu_codes, mu_scales, nu_codes, nu_scales)

    return optax.GradientTransformation(init_fn, update_fn)


def scale_by_adam_bf16(b1: float = 0.9, b2: float = 0.999,
                       eps: float = 1e-8) -> optax.GradientTransformation:
    """Adam's scaling with both moments stored in bf16 (rounded to nearest); the arithmetic runs
    in fp32."""
    _check(b1, b2, eps)

    def init_fn(params):
        return ScaleByAdamBf16State(count=jnp.zeros([], jnp.int32),
                                    mu=otu.tree_zeros_like(params, jnp.bfloat16),
                                    nu=otu.tree_zeros_like(params, jnp.bfloat16))

    def update_fn(updates, state, params=None):
        del params
        count = optax.safe_increment(state.count)

        def one(g, mu, nu):
            mu, nu, direction = _adam_direction(g, mu.astype(jnp.float32),
                                                nu.astype(jnp.float32), count, b1, b2, eps)
            return direction.astype(g.dtype), mu.astype(jnp.bfloat16), nu.astype(jnp.bfloat16)

        direction, mu, nu = _unzip(updates, jax.tree.map(one, updates, state.mu, state.nu))
        return direction, ScaleByAdamBf16State(count, mu, nu)

    return optax.GradientTransformation(init_fn, update_fn)


def _adamw(scaling: optax.GradientTransformation, learning_rate, weight_decay: float,
           mask: Any) -> optax.GradientTransformation:
    return optax.chain(scaling, optax.add_decayed_weights(weight_decay, mask),
                       optax.scale_by_learning_rate(learning_rate))


def adamw_8bit(learning_rate: optax.ScalarOrSchedule, b1: float = 0.9, b2: float = 0.999,
               eps: float = 1e-8, weight_decay: float = 0.0, block_size: int = 256,
               mask: Any = None) -> optax.GradientTransformation:
    """AdamW (as ``optax.adamw``) whose moments are stored blockwise-quantized to 8 bits:
    ``block_size`` entries along each parameter's last axis share one fp32 scale per moment.
    ``mask``: where weight decay applies (as in ``optax.adamw``)."""
    return _adamw(scale_by_adam_8bit(b1, b2, eps, block_size), learning_rate, weight_decay, mask)


def adamw_bf16(learning_rate: optax.ScalarOrSchedule, b1: float = 0.9, b2: float = 0.999,
               eps: float = 1e-8, weight_decay: float = 0.0,
               mask: Any = None) -> optax.GradientTransformation:
    """AdamW (as ``optax.adamw``) whose moments are stored in bf16."""
    return _adamw(scale_by_adam_bf16(b1, b2, eps), learning_rate, weight_decay, mask)
