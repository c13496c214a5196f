"""The GPT at long sequences: the chunked cross-entropy (``model.loss_chunk``), the tiled MLP
(``model.mlp_chunk``) and each layer's input in host memory (``model.remat=offload_input``),
against optax on the whole logits, the MLP's formula and plain optax training; on abstract
H100s (XLA:GPU, compiled without a GPU), what they take off the device."""
import dataclasses
import re
import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import zeroflow as zf
from zeroflow.config.io import load_config
from zeroflow.config.schema import ModelConfig
from zeroflow.models import GPT, init_params, make_layerwise_loss_fn, make_loss_fn
from zeroflow.models.gpt import Mlp, offload_policy, tiled_mlp
from helpers import REPO, optax_losses, require_cuda_plugin, token_batches, train_losses, walk

pytestmark = pytest.mark.slow

CFG = ModelConfig(vocab_size=61, seq_len=24, num_layers=3, embed_dim=32, num_heads=4,
                  mlp_dim=64, remat="full")
LONG = dict(loss_chunk=7, loss_vocab_chunk=16, mlp_chunk=5, remat="offload_input")
"The three together, chunks that divide neither the 24 positions nor the 61 entries."


def quiet(fn, *args, **kwargs):
    """``fn(...)`` without the warning that XLA:CPU keeps the offloaded inputs on the device."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "model.remat='offload_input'")
        return fn(*args, **kwargs)


def reference_loss(cfg):
    """Next-token loss on the whole logits of the plain GPT (optax), with the accuracy and the
    mask of a packed batch: what the chunked loss must equal."""
    model = GPT(dataclasses.replace(cfg, loss_chunk=0, mlp_chunk=0, remat="full"))

    def loss(params, batch):
        tokens, targets = batch["tokens"], batch["targets"]
        logits = model.apply({"params": params}, tokens, segment_ids=batch["segment_ids"],
                             positions=batch["positions"])
        losses = optax.softmax_cross_entropy_with_integer_labels(logits, targets)
        mask = batch["loss_mask"].astype(jnp.float32)
        hits = (jnp.argmax(logits, -1) == targets) * mask
        return (losses * mask).sum() / mask.sum(), hits.sum() / mask.sum()
    return loss


def packed_batch(cfg, rows=2, seed=0):
    """Two examples per row (segments 1 and 2, positions restarting), a masked-out prompt."""
    rng = np.random.default_rng(seed)
    seq = cfg.seq_len
    tokens = rng.integers(0, cfg.vocab_size, (rows, seq)).astype(np.int32)
    cut = seq // 3
    segment_ids = np.where(np.arange(seq) < cut, 1, 2)[None].repeat(rows, 0).astype(np.int32)
    positions = np.where(np.arange(seq) < cut, np.arange(seq), np.arange(seq) - cut)
    return {"tokens": tokens, "targets": np.roll(tokens, -1, axis=1),
            "loss_mask": (np.arange(seq) % 4 != 0)[None].repeat(rows, 0),
            "segment_ids": segment_ids, "positions": positions[None].repeat(rows, 0)}


@pytest.mark.parametrize("tied", [True, False])
def test_the_gpt_chunked_loss_equals_optax_on_the_whole_logits(tied):
    cfg = dataclasses.replace(CFG, tie_embeddings=tied, loss_chunk=7, loss_vocab_chunk=16)
    params, _ = init_params(cfg, jax.random.key(0, impl="rbg"))
    batch = packed_batch(cfg)
    (loss, metrics), grads = jax.jit(jax.value_and_grad(make_loss_fn(cfg), has_aux=True))(
        params, batch)
    (want, accuracy), want_grads = jax.jit(jax.value_and_grad(reference_loss(cfg),
                                                              has_aux=True))(params, batch)
    np.testing.assert_allclose(loss, want, rtol=1e-5)
    np.testing.assert_allclose(metrics["accuracy"], accuracy, rtol=1e-6)
    assert ("lm_head" in params) != tied
    for got, ref in zip(jax.tree.leaves(grads), jax.tree.leaves(want_grads)):
        np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("chunk", [4, 7, 23])
def test_the_tiled_mlp_equals_the_mlp_formula(chunk):
    """SwiGLU ``(silu(x W_gate) * (x W_up)) W_down`` on [2, 23, 32], in values and gradients
    (of the input and the three weights)."""
    mlp = Mlp(CFG)
    x = jax.random.normal(jax.random.key(1), (2, 23, CFG.embed_dim))
    params = nn.unbox(mlp.init(jax.random.key(2), x)["params"])

    def formula(p, x):
        hidden = nn.silu(x @ p["gate"]["kernel"]) * (x @ p["up"]["kernel"])
        return hidden @ p["down"]["kernel"]

    def tiled(p, x):
        return mlp.apply({"params": p}, x, method=lambda m, x: tiled_mlp(m, x, chunk))

    cotangent = jax.random.normal(jax.random.key(3), x.shape)
    want, want_vjp = jax.vjp(formula, params, x)
    got, got_vjp = jax.vjp(jax.jit(tiled), params, x)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    for g, w in zip(jax.tree.leaves(got_vjp(cotangent)), jax.tree.leaves(want_vjp(cotangent))):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5)


def test_the_tiled_mlp_holds_one_chunk_of_intermediates_forward_and_backward():
    """No value of the loss and its gradient, loops' bodies included, holds the MLP
    intermediates ([.., mlp_dim] with the batch axis) of more than one chunk of positions."""
    batch = {"tokens": np.zeros((2, CFG.seq_len + 1), np.int32)}
    params, _ = init_params(CFG, jax.random.key(0, impl="rbg"))

    def largest_intermediate(cfg):
        jaxpr = jax.make_jaxpr(jax.grad(make_loss_fn(cfg), has_aux=True))(params, batch)
        return max(math_prod(v.aval.shape) for e in walk(jaxpr) for v in e.outvars
                   if getattr(v.aval, "shape", ())[-1:] == (CFG.mlp_dim,)
                   and 2 in v.aval.shape[:-1])

    whole = 2 * CFG.seq_len * CFG.mlp_dim
    assert largest_intermediate(CFG) >= whole  # the check sees the untiled MLP's
    assert largest_intermediate(dataclasses.replace(CFG, mlp_chunk=5)) == 2 * 5 * CFG.mlp_dim


def math_prod(shape):
    return int(np.prod(shape)) if shape else 1


def test_offload_input_on_the_cpu_keeps_the_inputs_on_the_device_and_says_so():
    with pytest.warns(UserWarning, match="cpu has no separate host memory") as caught:
        offload_policy(zf.backend.for_platform("cpu"), "offload_input")
    assert "layer inputs are kept in device memory" in str(caught[0].message)
    assert "\n" not in str(caught[0].message)
    params, _ = init_params(CFG, jax.random.key(0, impl="rbg"))
    batch = {"tokens": np.asarray(token_batches(1, rows=2, seq_len=CFG.seq_len,
                                                vocab=CFG.vocab_size)[0]["tokens"])}
    results = [quiet(jax.jit(jax.value_and_grad(make_loss_fn(dataclasses.replace(
        CFG, remat=remat)), has_aux=True)), params, batch) for remat in ("full", "offload_input")]
    for got, want in zip(jax.tree.leaves(results[1]), jax.tree.leaves(results[0])):
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("stage,per_layer", [(0, False), (3, True)])
def test_the_gpt_with_all_three_trains_like_plain_optax(stage, per_layer):
    """Chunked loss, tiled MLP and host-memory layer inputs (on XLA:CPU: device memory) in the
    ZeRO step on 2 devices, against the plain GPT (whole logits, optax's cross-entropy) under
    plain optax; at stage 3 each layer gathered as it runs (the trainer's way)."""
    cfg = dataclasses.replace(CFG, **LONG)
    params, _ = init_params(cfg, jax.random.key(0, impl="rbg"))
    batches = token_batches(3, rows=4, seq_len=cfg.seq_len, vocab=cfg.vocab_size)
    plain = GPT(dataclasses.replace(CFG, remat="full"))

    def reference(p, batch):
        inputs, targets = batch["tokens"][:, :-1], batch["tokens"][:, 1:]
        logits = plain.apply({"params": p}, inputs)
        return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()

    tx = optax.adam(3e-3)
    want, *_ = optax_losses(reference, tx, params, batches, jit=True)
    plan = zf.ZeroPlan(zf.make_mesh(devices=jax.devices()[:2]), stage=stage)
    prec = zf.Precision()
    loss = make_layerwise_loss_fn(cfg) if per_layer else make_loss_fn(cfg)
    step = quiet(zf.make_train_step, loss, tx, plan, prec,
                 gather_per_layer="layers" if per_layer else None)
    state = zf.init_train_state(params, tx, plan, prec)
    got, *_ = quiet(train_losses, step, state, batches)
    np.testing.assert_allclose(got, want, rtol=1e-5)


def test_bad_chunk_settings_are_one_line():
    with pytest.raises(ValueError, match="model.loss_chunk=-1") as caught:
        init_params(dataclasses.replace(CFG, loss_chunk=-1), jax.random.key(0))
    assert "\n" not in str(caught.value)


# ------------------------------------------------------------------ XLA:GPU, abstract H100s
HOST_ARRAY = re.compile(r"(bf16|f32)\[([0-9,]*)\]\{[0-9,]*:S\(5\)\}")
GPU_LAYERS, GPU_WIDTH, GPU_SEQ, GPU_BATCH = 4, 128, 256, 64
GPU_CFG = load_config(REPO / "configs" / "tiny.yaml",
                      ["precision.params=bf16", f"train.batch_size={GPU_BATCH}",
                       f"model.seq_len={GPU_SEQ}"])
GPU_CHOICE = dict(num_devices=8, stage=3, offload="none", update_on="device", target="h100")


@pytest.fixture(scope="module")
def offload_h100():
    """The trainer's step compiled for 8 abstract H100s with remat full and offload_input."""
    require_cuda_plugin()
    from zeroflow.trainer.planning import compile_config
    return {remat: compile_config(GPU_CFG, **GPU_CHOICE, remat=remat)
            for remat in ("full", "offload_input")}


def test_offload_input_moves_the_layer_inputs_to_the_host(offload_h100):
    from zeroflow.memory.measure import analysed, device_peak
    memory = {remat: analysed(compiled) for remat, (compiled, _) in offload_h100.items()}
    peak = {remat: device_peak(memory[remat], setup.state)
            for remat, (_, setup) in offload_h100.items()}
    host = memory["offload_input"].host_temp_bytes
    micro = GPU_BATCH // 8
    layer_inputs = GPU_LAYERS * micro * GPU_SEQ * GPU_WIDTH * 2  # bf16
    assert memory["full"].host_temp_bytes == 0 and host >= layer_inputs
    # The device no longer holds the inputs of all layers but the one being recomputed.
    assert peak["full"] - peak["offload_input"] >= 0.95 * layer_inputs * (GPU_LAYERS - 1) / GPU_LAYERS
    # In the HLO: the inputs of every layer, stacked over the layers by the scan, and nothing else.
    hlo = offload_h100["offload_input"][0].as_text()
    shapes = {(dtype, tuple(int(d) for d in dims.split(",")))
              for dtype, dims in HOST_ARRAY.findall(hlo)}
    assert shapes == {("bf16", (GPU_LAYERS, micro, GPU_SEQ, GPU_WIDTH))}
    # The formula knows what goes to the host.
    formula = zf.memory.offloaded_activations(GPU_CFG.model, micro_batch=micro,
                                              remat="offload_input")
    assert formula == layer_inputs and formula == pytest.approx(host, rel=0.1)


def test_activation_formula_knows_the_three():
    """docs/memory.md's formula: offload_input keeps one block on the device and every layer's
    input on the host; the tiled MLP holds one chunk's intermediates, the chunked loss one tile
    of logits and of their softmax, with the fp32 gradient of the output projection."""
    model, b = GPU_CFG.model, 4
    s, h, f, v = model.seq_len, model.embed_dim, model.mlp_dim, model.vocab_size
    acts = {r: zf.memory.activations(model, micro_batch=b, remat=r)
            for r in ("none", "full", "offload_input")}
    host = zf.memory.offloaded_activations(model, micro_batch=b, remat="offload_input")
    assert host == model.num_layers * 2 * b * s * h
    assert acts["offload_input"] + host == acts["full"]
    tiled = dataclasses.replace(model, mlp_chunk=32)
    saved = acts["none"] - zf.memory.activations(tiled, micro_batch=b, remat="none")
    assert saved == model.num_layers * 2 * b * (s - 32) * 3 * f  # up, gate, hidden (SwiGLU)
    chunked = dataclasses.replace(model, loss_chunk=64, loss_vocab_chunk=100)
    saved = acts["full"] - zf.memory.activations(chunked, micro_batch=b, remat="full")
    assert saved == 2 * 4 * b * s * v - (2 * 4 * b * 64 * 100 + 4 * v * h)


def test_the_chunked_loss_lowers_the_xla_gpu_peak_by_the_logits():
    """One abstract H100, 32 x 256 tokens, 8192 entries: the plain loss's fp32 logits are
    268 MB; the chunked loss's tiles 32 x 128 positions x 2048 entries, 34 MB each."""
    require_cuda_plugin()
    from zeroflow.memory.measure import analysed, device_peak
    from zeroflow.trainer.planning import compile_config
    seq, vocab, batch = 256, 8192, 32
    base = ["precision.params=bf16", f"train.batch_size={batch}", f"model.seq_len={seq}",
            f"model.vocab_size={vocab}", "model.num_layers=2"]
    peaks = {}
    for chunk in (0, 128):
        cfg = load_config(REPO / "configs" / "tiny.yaml",
                          base + [f"model.loss_chunk={chunk}", "model.loss_vocab_chunk=2048"])
        compiled, setup = compile_config(cfg, num_devices=1, stage=0, offload="none",
                                         update_on="device", remat="full", target="h100")
        peaks[chunk] = device_peak(analysed(compiled), setup.state)
    logits = batch * seq * vocab * 4
    assert peaks[128] < peaks[0] - logits, peaks
