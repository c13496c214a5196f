"""How far from fp32 does training under ``zf.autocast(..., dtype="bf16")`` end? Three small Flax
models written with no thought of precision (an MLP, a transformer language model, a CNN) are
each trained the same number of steps from the same initialisation on the same batches, once in
fp32 and once with the loss wrapped in ``zf.autocast``: plain ``jax.value_and_grad`` + optax
Adam, no zeroflow engine. Prints, per model, the final loss of both runs (the mean training loss
over the last tenth of the steps) and their relative gap ``|bf16 - fp32| / fp32``, with the gap
of the last step's loss and of the final parameters' fp32 loss on a held-out batch. A control
row per model says how far apart two fp32 runs end when the second starts from the initial
weights rounded to bf16 once: a perturbation of the size bf16 rounding makes, so a bf16 gap of
the same order is the training's own sensitivity, not autocast's error.

    python experiments/autocast_loss_gap.py                 # 200 steps per run; ~1-2 min on 2 CPU cores
    python experiments/autocast_loss_gap.py --steps 400 --seed 1
"""
from __future__ import annotations

import argparse
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

from zeroflow.cli.common import start_script  # noqa: E402

start_script()  # before jax: where the CUDA plugin has no driver, a CPU jax without its noise

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import zeroflow as zf  # noqa: E402


# --- models: plain flax.linen, no dtype argument anywhere ----------------------------------------

class MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.gelu(nn.Dense(256)(x))
        x = nn.gelu(nn.Dense(256)(x))
        return nn.Dense(10)(x)


class Block(nn.Module):
    heads: int

    @nn.compact
    def __call__(self, x):
        h = nn.LayerNorm()(x)
        mask = nn.make_causal_mask(jnp.ones(x.shape[:2]))
        x = x + nn.MultiHeadDotProductAttention(num_heads=self.heads)(h, h, mask=mask)
        h = nn.Dense(4 * x.shape[-1])(nn.LayerNorm()(x))
        return x + nn.Dense(x.shape[-1])(nn.gelu(h))


class TinyLM(nn.Module):
    vocab: int = 32
    seq: int = 32
    width: int = 64
    layers: int = 2

    @nn.compact
    def __call__(self, tokens):
        x = nn.Embed(self.vocab, self.width)(tokens)
        x = x + self.param("pos", nn.initializers.normal(0.02), (self.seq, self.width))
        for _ in range(self.layers):
            x = Block(heads=4)(x)
        return nn.Dense(self.vocab)(nn.LayerNorm()(x))


class CNN(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Conv(16, (3, 3))(x))
        x = nn.relu(nn.Conv(32, (3, 3), strides=(2, 2))(x))
        x = nn.relu(nn.Conv(32, (3, 3), strides=(2, 2))(x))
        return nn.Dense(10)(x.mean(axis=(1, 2)))


# --- data: learnable synthetic tasks with a fixed seed --------------------------------------------

def teacher_labels(rng, x, classes=10):
    """Labels from a fixed random two-layer teacher: learnable, not trivially separable."""
    x = x.reshape(len(x), -1)
    w1 = rng.normal(size=(x.shape[-1], 64)) / np.sqrt(x.shape[-1])
    w2 = rng.normal(size=(64, classes)) / 8.0
    return np.argmax(np.tanh(x @ w1) @ w2, -1).astype(np.int32)


def mlp_batches(rng, steps, batch=128):
    x = rng.normal(size=(steps, batch, 32)).astype(np.float32)
    y = teacher_labels(rng, x.reshape(-1, 32)).reshape(steps, batch)
    return [{"x": a, "y": b} for a, b in zip(x, y)]


def cnn_batches(rng, steps, batch=64, classes=10):
    """16x16x3 images: noise over a stripe pattern whose orientation and colour give the class."""
    i, j = np.meshgrid(np.arange(16), np.arange(16), indexing="ij")
    angle = np.pi * np.arange(classes) / classes
    colour = rng.normal(size=(classes, 3))
    y = rng.integers(0, classes, (steps, batch))
    phase = rng.uniform(0, 2 * np.pi, (steps, batch, 1, 1))
    a = angle[y][..., None, None]
    stripes = np.sin(1.2 * (i * np.cos(a) + j * np.sin(a)) + phase)
    noise = rng.normal(size=(steps, batch, 16, 16, 3))
    x = stripes[..., None] * colour[y][:, :, None, None, :] + 2.5 * noise
    return [{"x": a.astype(np.float32), "y": b.astype(np.int32)} for a, b in zip(x, y)]


def markov_batches(rng, steps, batch=32, vocab=32, seq=32):
    """Sequences from a fixed, peaked bigram chain."""
    logits = rng.normal(size=(vocab, vocab)) * 3.0
    cum = (np.exp(logits) / np.exp(logits).sum(1, keepdims=True)).cumsum(1)
    out = np.zeros((steps, batch, seq + 1), np.int32)
    out[:, :, 0] = rng.integers(0, vocab, (steps, batch))
    for t in range(seq):
        u = rng.random((steps, batch, 1))
        out[:, :, t + 1] = (u > cum[out[:, :, t]]).sum(-1).clip(max=vocab - 1)
    return [{"tokens": b} for b in out]


# --- losses -----------------------------------------------------------------------------------

def classifier_loss(model):
    def loss(params, batch):
        logits = model.apply({"params": params}, batch["x"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()
    return loss


def lm_loss(model):
    def loss(params, batch):
        logits = model.apply({"params": params}, batch["tokens"][:, :-1])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["tokens"][:, 1:]).mean()
    return loss


def tasks(seed: int, steps: int):
    """``{name: (model, loss_fn, batches, an input to initialise the model with)}``."""
    rng = np.random.default_rng(seed)
    mlp, lm, cnn = MLP(), TinyLM(), CNN()
    mlp_data, lm_data, cnn_data = mlp_batches(rng, steps), markov_batches(rng, steps), cnn_batches(rng, steps)
    return {
        "MLP (2 x 256, GELU; teacher labels)": (mlp, classifier_loss(mlp), mlp_data, mlp_data[0]["x"][:1]),
        "transformer LM (2 blocks, width 64; bigram chain)":
            (lm, lm_loss(lm), lm_data, lm_data[0]["tokens"][:1, :-1]),
        "CNN (3 conv, 16x16x3; striped images)": (cnn, classifier_loss(cnn), cnn_data, cnn_data[0]["x"][:1]),
    }


# --- training ---------------------------------------------------------------------------------

def train(loss_fn, params, batches, lr: float):
    """Plain jit(value_and_grad) + optax Adam, one batch per step: the loss of every step and
    the final parameters."""
    tx = optax.adam(lr)

    @jax.jit
    def step(params, opt_state, batch):
        loss, grads = jax.value_and_grad(loss_fn)(params, batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    opt_state, losses = tx.init(params), []
    for batch in batches:
        params, opt_state, loss = step(params, opt_state, batch)
        losses.append(float(loss))
    return np.array(losses), params


def final_loss(losses: np.ndarray) -> float:
    """Mean training loss over the last tenth of the steps (one step's loss is noisy)."""
    return float(losses[-max(1, len(losses) // 10):].mean())


def gap(got: float, ref: float) -> float:
    return abs(got - ref) / ref


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=200, help="training steps per run")
    parser.add_argument("--seed", type=int, default=0, help="seed of the data and the initialisation")
    parser.add_argument("--lr", type=float, default=3e-3, help="Adam learning rate")
    args = parser.parse_args(argv)
    print(f"jax {jax.__version__}, backend {jax.default_backend()}, {args.steps} steps, seed {args.seed}, "
          f"Adam lr {args.lr}")
    print("final = mean training loss over the last tenth of the steps; held-out = the final "
          "parameters' fp32 loss on a batch never trained on; gap = |bf16 - fp32| / fp32")
    print(f"{'model':<50} {'fp32 first':>10} {'fp32 final':>10} {'bf16 final':>10} {'gap':>7} "
          f"{'gap last step':>13} {'gap held-out':>12} {'control gap':>11}")
    gaps, controls = [], []
    for name, (model, loss_fn, batches, example) in tasks(args.seed, args.steps + 1).items():
        train_batches, held_out = batches[:-1], batches[-1]
        params = model.init(jax.random.key(args.seed), example)["params"]
        fp32, fp32_params = train(loss_fn, params, train_batches, args.lr)
        bf16, bf16_params = train(zf.autocast(loss_fn, dtype="bf16"), params, train_batches, args.lr)
        rounded = jax.tree.map(lambda x: x.astype(jnp.bfloat16).astype(jnp.float32), params)
        control, _ = train(loss_fn, rounded, train_batches, args.lr)
        evaluate = jax.jit(loss_fn)
        held = gap(float(evaluate(bf16_params, held_out)), float(evaluate(fp32_params, held_out)))
        gaps.append(gap(final_loss(bf16), final_loss(fp32)))
        controls.append(gap(final_loss(control), final_loss(fp32)))
        print(f"{name:<50} {fp32[0]:10.4f} {final_loss(fp32):10.4f} {final_loss(bf16):10.4f} "
              f"{100 * gaps[-1]:6.2f}% {100 * gap(bf16[-1], fp32[-1]):12.2f}% {100 * held:11.2f}% "
              f"{100 * controls[-1]:10.2f}%")
    print(f"final-loss gap, bf16 autocast vs fp32: {100 * min(gaps):.2f}% to {100 * max(gaps):.2f}% "
          f"over {len(gaps)} models (control: {100 * min(controls):.2f}% to {100 * max(controls):.2f}%)")

if __name__ == "__main__":
    main()
