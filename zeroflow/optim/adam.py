"""AdamW with compact moments: blockwise 8-bit (2 bytes per parameter plus one fp32 scale per
block and moment) or bf16 (4 bytes per parameter), instead of optax's 8 bytes of fp32.

Each is an optax ``GradientTransformation``; the state's trees have the parameters' structure,
so ZeRO shards them like any optimizer state: the codes and the bf16 moments have each
parameter's shape and are split with it, the per-block scales are split along their own largest
dimension (``zeroflow.engine.state.state_layouts``). The update dequantizes, runs Adam in fp32 and
quantizes the new moments again, one parameter at a time.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from optax import tree_utils as otu

from zeroflow.optim import blockwise as q
from zeroflow.util.settings import ADAMW_CHOICES as ADAMW_CHOICES  # re-exported

# ADAMW_CHOICES: AdamW by how its moments are stored: fp32 (``optax.adamw``), 8-bit blockwise, bf16.
BLOCK_SIZE = 256
"``adamw_8bit``'s default: entries of a parameter's last axis that share one scale."
MIN_8BIT_SIZE = 4096
"``adamw_8bit``'s default: parameters with fewer entries keep fp32 moments (bitsandbytes')."


# ``count`` is optax's name for the step count in its own states; as a NamedTuple field it
# shadows tuple.count, which nothing here calls.
class ScaleByAdam8bitState(NamedTuple):
    """``mu_*``: the first moment (signed map), ``nu_*``: the square root of the second moment
    (unsigned map); codes are uint8 of each parameter's shape, scales fp32 of
    ``blockwise.scales_shape``. A parameter of fewer than ``min_8bit_size`` entries keeps its
    moments in fp32 instead: its ``*_codes`` leaf holds the fp32 moment itself (the second moment,
    not its root), its ``*_scales`` leaf an unused fp32 scalar."""

    count: jax.Array  # type: ignore[assignment]
    mu_codes: optax.Updates
    mu_scales: optax.Updates
    nu_codes: optax.Updates
    nu_scales: optax.Updates


class ScaleByAdamBf16State(NamedTuple):
    count: jax.Array  # type: ignore[assignment]
    mu: optax.Updates
    nu: optax.Updates


def _adam_direction(g, mu, nu, count, b1, b2, eps):
    """One Adam step on fp32 arrays: the new moments and the bias-corrected direction."""
    g = g.astype(jnp.float32)
    mu = b1 * mu + (1 - b1) * g
    nu = b2 * nu + (1 - b2) * jnp.square(g)
    mu_hat = mu / (1 - b1**count)
    nu_hat = nu / (1 - b2**count)
    return mu, nu, mu_hat / (jnp.sqrt(nu_hat) + eps)


def _unzip(like, tree_of_tuples, n: int) -> tuple:
    """A tree (of ``like``'s structure) of ``n``-tuples -> ``n`` trees (``n`` empty trees when
    ``like`` has no leaves)."""
    treedef = jax.tree.structure(like)
    # jaxlib ships no stub for its compiled PyTreeDef, so mypy cannot see its methods
    pairs = treedef.flatten_up_to(tree_of_tuples)  # type: ignore[attr-defined]
    columns = list(zip(*pairs)) or [()] * n
    return tuple(jax.tree.unflatten(treedef, x) for x in columns)


def _check(b1, b2, eps, block_size=1):
    if not (0 <= b1 < 1 and 0 <= b2 < 1):
        raise ValueError(f"b1 and b2 must be in [0, 1), got b1={b1}, b2={b2}")
    if eps < 0:
        raise ValueError(f"eps must be >= 0, got {eps}")
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size must be a positive integer, got {block_size!r}")


def keeps_fp32(shape: tuple[int, ...], min_8bit_size: int) -> bool:
    """Whether a parameter of ``shape`` keeps fp32 moments: small tensors (norm scales, biases)
    cost little memory and their moments are the least compressible (bitsandbytes'
    ``min_8bit_size``)."""
    return math.prod(shape) < min_8bit_size


def by_slices(shape: tuple[int, ...]) -> bool:
    """Whether the 8-bit update of a parameter of ``shape`` runs one leading-axis slice at a
    time (a ``lax.map``): a stack of layers (three or more dimensions, its first not the
    largest, so not the one ZeRO splits). Blocks run along the last axis, so every slice is
    quantized exactly as the whole; done whole, the dequantized fp32 moments, their gather
    indices and the requantized ones are temporaries the size of the whole stack (four bytes
    per entry each), where one slice is 1/layers of that."""
    return len(shape) >= 3 and shape[0] < max(shape[1:])


def moment_bytes(
    optimizer: str,
    shape: tuple[int, ...],
    block_size: int = BLOCK_SIZE,
    min_8bit_size: int = MIN_8BIT_SIZE,
) -> int:
    """Bytes of both moments of one parameter of ``shape`` under ``optimizer`` (an
    ``ADAMW_CHOICES`` name), as ``tx.init`` stores them: fp32 8 per entry, bf16 4; 8-bit one
    code per entry and one fp32 scale per block, twice (fp32 below ``min_8bit_size``; the
    small tensors' unused scalar scales and the step counter are not counted)."""
    size = math.prod(shape)
    if optimizer == "adamw" or (optimizer == "adamw_8bit" and keeps_fp32(shape, min_8bit_size)):
        return 8 * size
    if optimizer == "adamw_bf16":
        return 4 * size
    if optimizer == "adamw_8bit":
        return 2 * (size + 4 * math.prod(q.scales_shape(tuple(shape), block_size)))
    raise ValueError(f"unknown optimizer {optimizer!r}; choose one of {list(ADAMW_CHOICES)}")


def _slice_by_slice(step, arrays: tuple) -> tuple:
    """``step`` on each leading-axis slice of ``arrays``, its results written over the slice it
    read: ``step`` returns, for every input, an array of the input's slice shape and dtype.
    The loop's buffers are the inputs' own, so where an input is not read afterwards (the
    gradient, whose buffer takes the update direction) XLA updates it in place; a
    ``lax.map`` would allocate fresh zero-filled outputs, which XLA:GPU may create early,
    merged with other parameters' (whole stacks of fp32 alive before their update starts)."""

    def body(i, arrays):
        sliced = [jax.lax.dynamic_index_in_dim(x, i, keepdims=False) for x in arrays]
        return tuple(
            jax.lax.dynamic_update_index_in_dim(x, new, i, 0)
            for x, new in zip(arrays, step(*sliced))
        )

    return jax.lax.fori_loop(0, jnp.shape(arrays[0])[0], body, tuple(arrays))


def _store_moments(mu, nu, block_size, small):
    """(mu codes, mu scales, nu codes, nu scales) of fp32 moments. The second moment is quantized
    as its square root: sqrt(nu) is on |g|'s scale like mu, so the map's seven decades reach
    fourteen of nu, and the denominator of the update, sqrt(nu), gets the map's relative
    precision directly; quantizing nu itself rounds every nu below ~1e-7 of its block's
    largest to 0 or to the coarse bottom decades, and mu / sqrt(nu) blows up there."""
    if small:
        return mu, jnp.zeros([], jnp.float32), nu, jnp.zeros([], jnp.float32)
    return (
        *q.quantize(mu, block_size, signed=True),
        *q.quantize(jnp.sqrt(nu), block_size, signed=False),
    )


def _load_moments(mu_codes, mu_scales, nu_codes, nu_scales, block_size, small):
    if small:
        return mu_codes, nu_codes
    mu = q.dequantize(mu_codes, mu_scales, block_size, signed=True)
    return mu, jnp.square(q.dequantize(nu_codes, nu_scales, block_size, signed=False))


def scale_by_adam_8bit(
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    block_size: int = BLOCK_SIZE,
    min_8bit_size: int = MIN_8BIT_SIZE,
) -> optax.GradientTransformation:
    """Adam's scaling with both moments stored blockwise-quantized to 8 bits
    (``zeroflow.optim.blockwise``); parameters of fewer than ``min_8bit_size`` entries keep fp32
    moments."""
    _check(b1, b2, eps, block_size)
    if isinstance(min_8bit_size, bool) or not isinstance(min_8bit_size, int) or min_8bit_size < 0:
        raise ValueError(f"min_8bit_size must be an integer >= 0, got {min_8bit_size!r}")

    def init_fn(params):
        def zeros(p):
            shape = jnp.shape(p)
            small = keeps_fp32(shape, min_8bit_size)
            zero = jnp.zeros(shape, jnp.float32)
            if small:
                return _store_moments(zero, zero, block_size, True)
            # Fresh moments are exactly zero: the code of 0 and zero scales, without quantizing.
            scales = q.scales_shape(shape, block_size)
            return (
                jnp.full(shape, q.zero_code(signed=True), jnp.uint8),
                jnp.zeros(scales, jnp.float32),
                jnp.full(shape, q.zero_code(signed=False), jnp.uint8),
                jnp.zeros(scales, jnp.float32),
            )

        mu_codes, mu_scales, nu_codes, nu_scales = _unzip(params, jax.tree.map(zeros, params), 4)
        return ScaleByAdam8bitState(
            jnp.zeros([], jnp.int32), mu_codes, mu_scales, nu_codes, nu_scales
        )

    def update_fn(updates, state, params=None):
        del params
        count = optax.safe_increment(state.count)

        def one(g, mu_codes, mu_scales, nu_codes, nu_scales):
            small = keeps_fp32(jnp.shape(g), min_8bit_size)

            def step(g, mu_codes, mu_scales, nu_codes, nu_scales):
                mu, nu = _load_moments(mu_codes, mu_scales, nu_codes, nu_scales, block_size, small)
                mu, nu, direction = _adam_direction(g, mu, nu, count, b1, b2, eps)
                return (direction.astype(g.dtype), *_store_moments(mu, nu, block_size, small))

            state = (g, mu_codes, mu_scales, nu_codes, nu_scales)
            if not small and by_slices(jnp.shape(g)):
                return _slice_by_slice(step, state)
            return step(*state)

        direction, mu_codes, mu_scales, nu_codes, nu_scales = _unzip(
            updates,
            jax.tree.map(
                one, updates, state.mu_codes, state.mu_scales, state.nu_codes, state.nu_scales
            ),
            5,
        )
        return direction, ScaleByAdam8bitState(count, mu_codes, mu_scales, nu_codes, nu_scales)

    return optax.GradientTransformation(init_fn, update_fn)


def scale_by_adam_bf16(
    b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8
) -> optax.GradientTransformation:
    """Adam's scaling with both moments stored in bf16 (rounded to nearest); the arithmetic runs
    in fp32."""
    _check(b1, b2, eps)

    def init_fn(params):
        return ScaleByAdamBf16State(
            count=jnp.zeros([], jnp.int32),
            mu=otu.tree_zeros_like(params, jnp.bfloat16),
            nu=otu.tree_zeros_like(params, jnp.bfloat16),
        )

    def update_fn(updates, state, params=None):
        del params
        count = optax.safe_increment(state.count)

        def one(g, mu, nu):
            mu, nu, direction = _adam_direction(
                g, mu.astype(jnp.float32), nu.astype(jnp.float32), count, b1, b2, eps
            )
            return direction.astype(g.dtype), mu.astype(jnp.bfloat16), nu.astype(jnp.bfloat16)

        direction, mu, nu = _unzip(updates, jax.tree.map(one, updates, state.mu, state.nu), 3)
        return direction, ScaleByAdamBf16State(count, mu, nu)

    return optax.GradientTransformation(init_fn, update_fn)


def _adamw(
    scaling: optax.GradientTransformation, learning_rate, weight_decay: float, mask: Any
) -> optax.GradientTransformation:
    return optax.chain(
        scaling,
        optax.add_decayed_weights(weight_decay, mask),
        optax.scale_by_learning_rate(learning_rate),
    )


def adamw_8bit(
    learning_rate: optax.ScalarOrSchedule,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    block_size: int = BLOCK_SIZE,
    mask: Any = None,
    min_8bit_size: int = MIN_8BIT_SIZE,
) -> optax.GradientTransformation:
    """AdamW (as ``optax.adamw``) whose moments are stored blockwise-quantized to 8 bits:
    ``block_size`` entries along each parameter's last axis share one fp32 scale per moment.
    The second moment is stored as its square root. Parameters of fewer than ``min_8bit_size``
    entries keep fp32 moments (0: quantize all). ``mask``: where weight decay applies (as in
    ``optax.adamw``)."""
    return _adamw(
        scale_by_adam_8bit(b1, b2, eps, block_size, min_8bit_size),
        learning_rate,
        weight_decay,
        mask,
    )


def adamw_bf16(
    learning_rate: optax.ScalarOrSchedule,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    mask: Any = None,
) -> optax.GradientTransformation:
    """AdamW (as ``optax.adamw``) whose moments are stored in bf16."""
    return _adamw(scale_by_adam_bf16(b1, b2, eps), learning_rate, weight_decay, mask)
