"""GPT model: shapes, logical axes, causality, precision, remat, training signal, sampling."""
import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from zeroflow.config.schema import ModelConfig
from zeroflow.models import (
    GPT,
    abstract_params,
    count_params,
    cross_entropy_loss,
    decay_mask,
    flops_per_token,
    generate,
    init_params,
    make_loss_fn,
)
from zeroflow.models.axes import is_axis_names

pytestmark = pytest.mark.fast

TINY = ModelConfig(vocab_size=64, seq_len=16, num_layers=2, embed_dim=32, num_heads=4,
                   mlp_dim=64)


def tiny(**overrides) -> ModelConfig:
    return dataclasses.replace(TINY, **overrides)


def random_tokens(cfg, batch=2, extra=0, seed=1):
    return jax.random.randint(jax.random.key(seed), (batch, cfg.seq_len + extra), 0,
                              cfg.vocab_size, jnp.int32)


def numpy_params(cfg, seed=0):
    """Random params from the abstract shapes: skips compiling the (slow on CPU) init RNG."""
    rng = np.random.default_rng(seed)
    shapes, _ = abstract_params(cfg)

    def fill(path, s):
        if path[-1].key in ("scale", "bias"):
            return jnp.full(s.shape, path[-1].key == "scale", s.dtype)
        return jnp.asarray(0.02 * rng.standard_normal(s.shape), s.dtype)
    return jax.tree_util.tree_map_with_path(fill, shapes)


@pytest.fixture(scope="module")
def tiny_params():
    # An rbg key compiles much faster on CPU than the default threefry; init is key-agnostic.
    return init_params(TINY, jax.random.key(0, impl="rbg"))


@functools.cache
def jitted_apply(cfg_fields: tuple):
    model = GPT(ModelConfig(*cfg_fields))
    return jax.jit(lambda params, tokens: model.apply({"params": params}, tokens))


def forward(cfg, params, tokens):
    return jitted_apply(dataclasses.astuple(cfg))(params, tokens)


@functools.cache
def jitted_value_and_grad(cfg_fields: tuple):
    return jax.jit(jax.value_and_grad(make_loss_fn(ModelConfig(*cfg_fields)), has_aux=True))


def loss_and_grads(cfg, params, batch):
    """((loss, metrics), grads); compiled once per config and shared by the tests."""
    return jitted_value_and_grad(dataclasses.astuple(cfg))(params, batch)


def test_logits_shape_dtype_and_initial_loss(tiny_params):
    params, _ = tiny_params
    tokens = random_tokens(TINY)
    logits = forward(TINY, params, tokens)
    assert logits.shape == (2, TINY.seq_len, TINY.vocab_size) and logits.dtype == jnp.float32
    (loss, metrics), _ = loss_and_grads(TINY, params, {"tokens": random_tokens(TINY, extra=1)})
    assert np.isfinite(loss) and abs(float(loss) - math.log(TINY.vocab_size)) < 0.1
    assert 0.0 <= float(metrics["accuracy"]) <= 1.0


def test_params_are_plain_fp32_and_stacked_per_layer(tiny_params):
    params, _ = tiny_params
    leaves = jax.tree.leaves(params)
    assert all(isinstance(x, jax.Array) and x.dtype == jnp.float32 for x in leaves)
    for leaf in jax.tree.leaves(params["layers"]):
        assert leaf.shape[0] == TINY.num_layers
    assert params["layers"]["attn"]["query"]["kernel"].shape == (2, 32, 4, 8)


def test_logical_axes_parallel_params(tiny_params):
    params, axes = tiny_params
    assert jax.tree.structure(params) == jax.tree.structure(axes, is_leaf=is_axis_names)
    jax.tree.map(lambda p, names: assert_names(p, names), params, axes)
    assert axes["embedding"] == ("vocab", "embed")
    assert axes["layers"]["attn"]["out"]["kernel"] == ("layers", "heads", "head_dim", "embed")
    assert axes["layers"]["mlp"]["down"]["kernel"] == ("layers", "mlp", "embed")


def assert_names(param, names):
    assert len(names) == param.ndim and all(isinstance(n, str) for n in names), names


def test_causal(tiny_params):
    params, _ = tiny_params
    tokens = random_tokens(TINY)
    changed = tokens.at[:, 10].set((tokens[:, 10] + 1) % TINY.vocab_size)
    before, after = forward(TINY, params, tokens), forward(TINY, params, changed)
    np.testing.assert_array_equal(before[:, :10], after[:, :10])
    assert not np.allclose(before[:, 10:], after[:, 10:])


def test_grouped_query_attention():
    cfg = tiny(num_kv_heads=2, head_dim=16)
    params, axes = numpy_params(cfg), abstract_params(cfg)[1]
    assert params["layers"]["attn"]["key"]["kernel"].shape == (2, 32, 2, 16)
    assert axes["layers"]["attn"]["key"]["kernel"] == ("layers", "embed", "kv_heads", "head_dim")
    logits = forward(cfg, params, random_tokens(cfg))
    assert logits.shape == (2, 16, 64) and np.isfinite(logits).all()


def test_tied_untied_and_norm_activation_variants():
    tied, _ = abstract_params(tiny())
    untied, axes = abstract_params(tiny(tie_embeddings=False, norm="layernorm",
                                        mlp_activation="gelu"))
    assert "lm_head" not in tied and untied["lm_head"].shape == (32, 64)
    assert axes["lm_head"] == ("embed", "vocab")
    assert "bias" in untied["final_norm"] and "gate" not in untied["layers"]["mlp"]
    assert count_params(untied) - count_params(tied) == 32 * 64 + 32 * 5 - 2 * 32 * 64
    mask = decay_mask(untied)
    assert mask["lm_head"] and mask["layers"]["mlp"]["up"]["kernel"]
    assert not mask["final_norm"]["bias"] and not mask["layers"]["attn_norm"]["scale"]


def test_hugging_face_options_shapes_axes_and_decay():
    """Biases, learned positions: the parameters the Hugging Face architectures add, with
    logical axes the tensor-parallel rules understand and no weight decay on biases."""
    cfg = tiny(attn_bias="all", mlp_bias=True, positions="learned", max_positions=24,
               norm="layernorm", mlp_activation="gelu_exact", num_kv_heads=2)
    params, axes = numpy_params(cfg), abstract_params(cfg)[1]
    attn = params["layers"]["attn"]
    assert attn["query"]["bias"].shape == (2, 4, 8) and attn["key"]["bias"].shape == (2, 2, 8)
    assert axes["layers"]["attn"]["key"]["bias"] == ("layers", "kv_heads", "head_dim")
    assert attn["out"]["bias"].shape == (2, 32)
    assert params["layers"]["mlp"]["up"]["bias"].shape == (2, 64)
    assert params["position_embedding"].shape == (24, 32)
    assert axes["position_embedding"] == ("positions", "embed")
    assert not decay_mask(params)["layers"]["attn"]["query"]["bias"]
    assert "bias" not in abstract_params(tiny(attn_bias="qkv"))[0]["layers"]["attn"]["out"]


def test_learned_positions_move_the_output_and_have_a_length_limit():
    cfg = tiny(positions="learned", max_positions=16)
    params = numpy_params(cfg)
    tokens = random_tokens(cfg)
    shifted = dict(params, position_embedding=params["position_embedding"] + 0.5)
    assert not np.allclose(forward(cfg, params, tokens), forward(cfg, shifted, tokens))
    with pytest.raises(ValueError, match="sequence of 17 tokens is longer than the 16 learned"):
        GPT(cfg).apply({"params": params}, random_tokens(cfg, extra=1))


def test_sliding_window_only_sees_recent_tokens(tiny_params):
    params, _ = tiny_params
    cfg = tiny(sliding_window=4)
    tokens = random_tokens(cfg)
    changed = tokens.at[:, 2].set((tokens[:, 2] + 1) % cfg.vocab_size)
    before, after = forward(cfg, params, tokens), forward(cfg, params, changed)
    # Two layers of a 4-token window: position 2 reaches at most 2 * 3 positions ahead.
    np.testing.assert_array_equal(before[:, 9:], after[:, 9:])
    assert not np.allclose(before[:, 2:9], after[:, 2:9])
    # The Pallas kernels take the same window (their band): same logits as the xla path.
    pallas = forward(tiny(sliding_window=4, attention="pallas"), params, tokens)
    np.testing.assert_allclose(pallas, before, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("remat", ["full", "save_dots"])
def test_remat_matches_no_remat(tiny_params, remat):
    params, _ = tiny_params
    batch = {"tokens": random_tokens(TINY, extra=1)}
    (loss, _), grads = loss_and_grads(TINY, params, batch)
    (loss_r, _), grads_r = loss_and_grads(tiny(remat=remat), params, batch)
    np.testing.assert_allclose(loss, loss_r, rtol=1e-6)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7),
                 grads, grads_r)


def dot_general_input_dtypes(jaxpr) -> list:
    dtypes = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "dot_general":
            dtypes.append(tuple(v.aval.dtype for v in eqn.invars))
        for value in eqn.params.values():
            for sub in value if isinstance(value, (tuple, list)) else [value]:
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    dtypes += dot_general_input_dtypes(inner)
    return dtypes


def test_bf16_params_compute_in_bf16(tiny_params):
    params, _ = tiny_params
    bf16 = jax.tree.map(lambda x: x.astype(jnp.bfloat16), params)
    tokens = random_tokens(TINY)
    apply = lambda p, t: GPT(TINY).apply({"params": p}, t)
    dtypes = dot_general_input_dtypes(jax.make_jaxpr(apply)(bf16, tokens).jaxpr)
    # 7 projections + 2 attention einsums per layer (inside the scan body) + the logits.
    assert len(dtypes) == 10
    assert all(d == (jnp.bfloat16, jnp.bfloat16) for d in dtypes), dtypes
    logits = forward(TINY, bf16, tokens)
    assert logits.dtype == jnp.float32
    np.testing.assert_allclose(logits, forward(TINY, params, tokens), atol=0.05)


def test_cudnn_attention_needs_gpu(tiny_params):
    from zeroflow import backend
    # traced for CPU devices, whatever this machine has
    with backend.tracing_for(backend.for_platform("cpu")):
        with pytest.raises(ValueError, match="cudnn.*needs a GPU"):
            GPT(tiny(attention="cudnn")).apply({"params": tiny_params[0]}, random_tokens(TINY))


def test_bad_config_names_valid_choices():
    with pytest.raises(ValueError, match="expected one of"):
        abstract_params(tiny(norm="batchnorm"))


def test_dropout_uses_the_rng(tiny_params):
    params, _ = tiny_params
    batch = {"tokens": random_tokens(TINY, extra=1)}
    loss_fn = jax.jit(make_loss_fn(tiny(dropout=0.5)))
    train_a, _ = loss_fn(params, batch, jax.random.key(1))
    train_b, _ = loss_fn(params, batch, jax.random.key(2))
    assert float(train_a) != float(train_b)


def test_adam_reduces_loss_on_repeated_batch(tiny_params):
    params, _ = tiny_params
    batch = {"tokens": random_tokens(TINY, extra=1)}
    tx = optax.adamw(1e-2, weight_decay=0.1, mask=decay_mask(params))

    @jax.jit
    def apply_adam(grads, opt_state, params):
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    opt_state = tx.init(params)
    losses = []
    for _ in range(10):
        (loss, _), grads = loss_and_grads(TINY, params, batch)  # reuses the compiled grad
        params, opt_state = apply_adam(grads, opt_state, params)
        losses.append(float(loss))
    assert losses[-1] < losses[0] - 0.5, losses


def test_cross_entropy_mask():
    logits = jnp.log(jnp.array([[[0.5, 0.5], [0.9, 0.1]]]))
    targets = jnp.array([[0, 0]])
    np.testing.assert_allclose(cross_entropy_loss(logits, targets, jnp.array([[0, 1]])),
                               -math.log(0.9), rtol=1e-6)
    np.testing.assert_allclose(cross_entropy_loss(logits, targets),
                               -(math.log(0.5) + math.log(0.9)) / 2, rtol=1e-6)


def test_generate_greedy_and_sampled(tiny_params):
    params, _ = tiny_params
    prompt = list(range(12))  # 12 + 10 tokens > seq_len 16: the window slides
    greedy = [generate(params, TINY, prompt, max_new_tokens=10, temperature=0.0, top_k=5,
                       rng=jax.random.key(seed)) for seed in (0, 1)]
    assert greedy[0] == greedy[1] and len(greedy[0]) == 10
    sampled = generate(params, TINY, prompt, max_new_tokens=10, top_k=5, rng=jax.random.key(0))
    assert len(sampled) == 10 and all(0 <= t < TINY.vocab_size for t in sampled)


def test_abstract_params_allocate_nothing():
    cfg = ModelConfig(vocab_size=50304, seq_len=2048, num_layers=48, embed_dim=6144,
                      num_heads=48, num_kv_heads=8, mlp_dim=16384)
    shapes, axes = abstract_params(cfg)  # ~20B parameters: would not fit if allocated
    assert all(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(shapes))
    assert jax.tree.structure(shapes) == jax.tree.structure(axes, is_leaf=is_axis_names)
    n = count_params(shapes)
    assert n > 1e10
    non_embedding = n - cfg.vocab_size * cfg.embed_dim
    # 6N (plus the logits matmul) dominates; attention adds 12 * L * H * Dh * S.
    expected = 6 * non_embedding + 6 * cfg.embed_dim * cfg.vocab_size + 12 * 48 * 6144 * 2048
    assert abs(flops_per_token(cfg) - expected) / expected < 1e-3


# A 2-layer GQA model with an untied head, counted by hand: per layer query and out hold
# E x H x D, key and value E x KV x D, the SwiGLU's gate, up and down E x M; the head E x V.
E, H, KV, D, M, V, S, L = 32, 4, 2, 8, 64, 96, 16, 2
HAND = ModelConfig(vocab_size=V, seq_len=S, num_layers=L, embed_dim=E, num_heads=H,
                   num_kv_heads=KV, mlp_dim=M, tie_embeddings=False)
ATTN_W = L * (2 * E * H * D + 2 * E * KV * D)
MLP_W = L * 3 * E * M
HEAD_W = E * V
ATTN_FWD = 4 * L * H * D * S  # scores and weighted values, forward, per token


def test_full_training_counts_6_per_weight():
    expected = 6 * (ATTN_W + MLP_W + HEAD_W) + 3 * ATTN_FWD
    assert flops_per_token(HAND) == pytest.approx(expected, rel=1e-9)


def test_lora_counts_4_per_frozen_weight_and_6_per_adapter():
    """The frozen base: forward 2 + its input's gradient 2 (no weight gradient); rank-r
    adapters on a weight of in x out: r x (in + out) elements at 6 each."""
    r = 4
    cfg = dataclasses.replace(HAND, lora=dataclasses.replace(HAND.lora, rank=r))
    adapters = L * r * (2 * (E + H * D) + 2 * (E + KV * D) + 3 * (E + M))
    expected = 4 * (ATTN_W + MLP_W + HEAD_W) + 6 * adapters + 3 * ATTN_FWD
    assert flops_per_token(cfg) == pytest.approx(expected, rel=1e-9)


def test_lora_adapter_count_is_zf_loras():
    """The adapters counted are those ``zf.lora`` makes on the model (rank 4, default targets)."""
    from zeroflow.models.flops import matmul_weights
    from zeroflow.trainer import adapters as run_adapters
    r = 4
    cfg = dataclasses.replace(HAND, lora=dataclasses.replace(HAND.lora, rank=r))
    shapes, _ = abstract_params(cfg)
    lo = run_adapters.make_lora(make_loss_fn(cfg), cfg.lora, shapes)
    batch = {"tokens": jax.ShapeDtypeStruct((2, S + 1), jnp.int32)}
    sites = run_adapters.adapter_sites(lo, shapes, batch, jnp.float32)
    made = sum(math.prod(s) for site in sites.values() for s in site.factor_shapes(r))
    counted = sum(w.layers * r * w.in_plus_out for w in matmul_weights(cfg)
                  if w.path in sites)
    assert made == counted == L * r * (2 * (E + H * D) + 2 * (E + KV * D) + 3 * (E + M))


def test_train_freeze_counts_frozen_weights_at_4():
    """train.freeze='attn/': the attention projections frozen (4), the MLP and head train (6)."""
    expected = 4 * ATTN_W + 6 * (MLP_W + HEAD_W) + 3 * ATTN_FWD
    assert flops_per_token(HAND, "attn/") == pytest.approx(expected, rel=1e-9)


def test_a_frozen_body_under_a_trained_head_costs_its_forward_only():
    """Only the final norm and the head train: no gradient enters the layers, whose weights
    and attention cost their forward pass alone."""
    expected = 2 * (ATTN_W + MLP_W) + 6 * HEAD_W + ATTN_FWD
    assert flops_per_token(HAND, "layers|embedding") == pytest.approx(expected, rel=1e-9)
