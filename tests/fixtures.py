"""Tiny models shared by several test files."""
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax


# --- the engine tests' Flax MLP: a model zeroflow has never seen ---------------------------------

class MLP(nn.Module):
    hidden: int = 64

    @nn.compact
    def __call__(self, x):
        x = nn.gelu(nn.Dense(self.hidden)(x))
        x = nn.gelu(nn.Dense(self.hidden)(x))
        # 10 outputs: its bias (10,) does not divide by 8 devices (stored padded to 16) and must
        # still match plain optax.
        return nn.Dense(10)(x)


MODEL = MLP()


def make_batch(n=32, seed=0):
    rng = np.random.default_rng(seed)
    return {"x": rng.normal(size=(n, 24)).astype(np.float32),
            "y": rng.normal(size=(n, 10)).astype(np.float32)}


def init_params():
    return MODEL.init(jax.random.PRNGKey(0), jnp.zeros((1, 24)))["params"]


def loss_fn(params, batch):
    pred = MODEL.apply({"params": params}, batch["x"].astype(jax.tree.leaves(params)[0].dtype))
    loss = jnp.mean((pred.astype(jnp.float32) - batch["y"]) ** 2)
    return loss, {"pred_mean": jnp.mean(pred.astype(jnp.float32))}


def make_tx():
    return optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(3e-3, weight_decay=0.01))


BATCHES = [make_batch(seed=s) for s in range(4)]


# --- a loss with a known gradient, for loss-scaling bookkeeping ----------------------------------

def linear_loss(factor):
    """d(loss)/dw = factor for every element (x is all ones)."""
    def loss(params, batch):
        return factor * jnp.sum(params["w"].astype(jnp.float32) * batch["x"].astype(jnp.float32).mean(0))
    return loss


# --- the trainer shrunk to seconds (configs/tiny.yaml plus these overrides) ---------------------

TINY_TRAINER = ["model.num_layers=1", "model.embed_dim=32", "model.num_heads=2", "model.mlp_dim=64",
                "model.seq_len=32", "train.batch_size=8", "train.eval_batches=1", "train.log_every=1",
                "run.progress=false"]
"Overrides the trainer, launch and loss-scaling tests share; each adds its own on top."
