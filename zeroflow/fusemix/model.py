"""FuseMix (Vouitsis et al., CVPR 2024): two MLP adapters map frozen image and text latents
into one shared space, trained with a symmetric InfoNCE loss on latents mixed in pairs.

Mixup happens in latent space: row ``i`` of a batch becomes ``lam_i * x_i + (1 - lam_i) *
x_perm(i)``, with ``lam_i ~ Beta(alpha, alpha)`` and the same ``lam_i`` and partner
``perm(i)`` for the image and the text of the pair, so the mixed image and the mixed text are
still each other's positive.
"""

from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

IMAGE, TEXT = "image", "text"
"Batch keys: float32 latents [batch, dim] of each modality."


class Adapter(nn.Module):
    """``layers`` Dense layers (GELU between them), the last one into the shared space."""

    hidden: int
    layers: int
    out: int

    @nn.compact
    def __call__(self, x):
        for i in range(self.layers - 1):
            x = nn.gelu(nn.Dense(self.hidden, name=f"dense{i}")(x))
        return nn.Dense(self.out, name=f"dense{self.layers - 1}")(x)


PAPER_NORM_EPS = 1e-5
"The released code's LayerNorm epsilon (PyTorch's default); its GELU is the exact (erf) one."


class ResidualBlock(nn.Module):
    """Pre-norm inverted bottleneck at the input's width: ``x + W2 gelu(W1 LayerNorm(x))``,
    ``W1`` widening by ``expansion``."""

    expansion: int

    @nn.compact
    def __call__(self, x):
        width = x.shape[-1]
        h = nn.LayerNorm(epsilon=PAPER_NORM_EPS, name="norm")(x)
        h = nn.gelu(nn.Dense(self.expansion * width, name="up")(h), approximate=False)
        return x + nn.Dense(width, name="down")(h)


class ResidualAdapter(nn.Module):
    """The FuseMix paper's adapter (its released code's ``MLPContrastiveFusion``): ``blocks``
    residual blocks at the latent's own width, a LayerNorm, a Dense into the shared space."""

    blocks: int
    expansion: int
    out: int

    @nn.compact
    def __call__(self, x):
        for i in range(self.blocks):
            x = ResidualBlock(self.expansion, name=f"block{i}")(x)
        return nn.Dense(self.out, name="project")(
            nn.LayerNorm(epsilon=PAPER_NORM_EPS, name="norm")(x)
        )


ADAPTERS = ("mlp", "residual")
"mlp: ``Adapter`` (layers Dense of hidden); residual: ``ResidualAdapter`` (hidden unused)."


class FuseMix(nn.Module):
    hidden: int
    layers: int
    shared_dim: int
    adapter: str = "mlp"
    expansion: int = 4

    def _adapter(self, name: str) -> nn.Module:
        if self.adapter == "residual":
            return ResidualAdapter(self.layers, self.expansion, self.shared_dim, name=name)
        if self.adapter == "mlp":
            return Adapter(self.hidden, self.layers, self.shared_dim, name=name)
        raise ValueError(f"unknown adapter {self.adapter!r}; choose one of {', '.join(ADAPTERS)}")

    @nn.compact
    def __call__(self, image, text):
        """Unit-norm fp32 embeddings ``(image [B, shared], text [B, shared])``."""
        za = self._adapter("image_adapter")(image)
        zb = self._adapter("text_adapter")(text)
        return _unit(za), _unit(zb)


def _unit(z):
    z = z.astype(jnp.float32)
    return z * jax.lax.rsqrt(jnp.maximum(jnp.sum(z * z, -1, keepdims=True), 1e-12))


def info_nce(za, zb, temperature: float):
    """Symmetric InfoNCE of paired unit vectors: row i's positive is row i of the other side,
    every other row a negative; the mean of both directions' cross-entropy."""
    logits = (za @ zb.T) / temperature
    labels = jnp.arange(za.shape[0])
    forward = optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
    backward = optax.softmax_cross_entropy_with_integer_labels(logits.T, labels).mean()
    return 0.5 * (forward + backward)


def mix_pairs(batch, lam, perm):
    """Each modality's rows mixed with the rows ``perm`` points at, by the same ``lam``."""
    lam = lam[:, None]
    return {k: lam * v + (1.0 - lam) * v[perm] for k, v in batch.items()}


def draw_mixup(rng, batch_size: int, alpha: float):
    """``(lam [B], perm [B])`` for one batch: ``lam ~ Beta(alpha, alpha)``, a random partner."""
    k_lam, k_perm = jax.random.split(rng)
    return (
        jax.random.beta(k_lam, alpha, alpha, (batch_size,)),
        jax.random.permutation(k_perm, batch_size),
    )


def fusemix_loss(
    params, batch, *, rng=None, module: FuseMix, temperature: float, mixup_alpha: float
):
    """The engine's ``loss_fn``: mixup (when ``mixup_alpha > 0`` and a key is given), the
    adapters, symmetric InfoNCE. Negatives are the other rows of the batch this device sees."""
    batch = {k: batch[k].astype(jnp.float32) for k in (IMAGE, TEXT)}
    aux = {}
    if mixup_alpha > 0 and rng is not None:
        lam, perm = draw_mixup(rng, batch[IMAGE].shape[0], mixup_alpha)
        batch = mix_pairs(batch, lam, perm)
        aux["mix_lambda"] = lam.mean()
    za, zb = module.apply({"params": params}, batch[IMAGE], batch[TEXT])
    return info_nce(za, zb, temperature), aux


def make_loss(
    hidden: int,
    layers: int,
    shared_dim: int,
    temperature: float,
    mixup_alpha: float,
    adapter: str = "mlp",
    expansion: int = 4,
):
    """``(module, loss_fn)``: the adapters (``ADAPTERS``) and the engine's loss bound to them."""
    if adapter not in ADAPTERS:
        raise ValueError(f"unknown adapter {adapter!r}; choose one of {', '.join(ADAPTERS)}")
    module = FuseMix(hidden, layers, shared_dim, adapter, expansion)
    return module, functools.partial(
        fusemix_loss, module=module, temperature=temperature, mixup_alpha=mixup_alpha
    )
