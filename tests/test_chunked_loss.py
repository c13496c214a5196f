"""``zf.chunked_cross_entropy``: the cross-entropy of a linear output layer in token x vocabulary
tiles with its own backward pass, against the plain loss on the whole logits (optax), in value
and gradients, and inside the train step at every ZeRO stage."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import zeroflow as zf
from helpers import optax_losses, train_losses, walk

pytestmark = pytest.mark.fast

ROWS, SEQ, WIDTH, VOCAB = 3, 20, 8, 50


def problem(seed=0, dtype=jnp.float32):
    keys = jax.random.split(jax.random.key(seed), 4)
    hidden = jax.random.normal(keys[0], (ROWS, SEQ, WIDTH), dtype)
    w_out = jax.random.normal(keys[1], (WIDTH, VOCAB), dtype)
    labels = jax.random.randint(keys[2], (ROWS, SEQ), 0, VOCAB)
    mask = jax.random.bernoulli(keys[3], 0.7, (ROWS, SEQ))
    return hidden, w_out, labels, mask


def plain_loss(hidden, w_out, labels, mask=None):
    """The reference: optax's cross-entropy on the whole fp32 logits, masked mean."""
    logits = jnp.einsum("bsd,dv->bsv", hidden, w_out, preferred_element_type=jnp.float32)
    losses = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
    if mask is None:
        return losses.mean()
    mask = mask.astype(jnp.float32)
    return (losses * mask).sum() / mask.sum()


# Chunks that divide the sizes (5 | 20 tokens, 10 | 50 entries), that do not (7, 16), of one
# token or entry, and larger than the sizes (clamped to them).
CHUNKS = [(5, 10), (7, 16), (1, 1), (20, 50), (64, 4096), (3, 49)]


@pytest.mark.parametrize("token_chunk,vocab_chunk", CHUNKS)
@pytest.mark.parametrize("masked", [False, True])
def test_equals_the_plain_loss_in_value_and_gradients(token_chunk, vocab_chunk, masked):
    hidden, w_out, labels, mask = problem()
    mask = mask if masked else None

    def chunked(h, w):
        return zf.chunked_cross_entropy(h, w, labels, weights=mask, token_chunk=token_chunk,
                                        vocab_chunk=vocab_chunk)

    want, want_grads = jax.value_and_grad(plain_loss, (0, 1))(hidden, w_out, labels, mask)
    got, got_grads = jax.jit(jax.value_and_grad(chunked, (0, 1)))(hidden, w_out)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    for g, w in zip(got_grads, want_grads):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5)


def test_a_vocabulary_first_projection_is_a_tied_embedding():
    hidden, w_out, labels, mask = problem(1)
    want = jax.grad(plain_loss, (0, 1))(hidden, w_out, labels, mask)
    got = jax.grad(lambda h, e: zf.chunked_cross_entropy(
        h, e, labels, weights=mask, token_chunk=6, vocab_chunk=12, vocab_axis=0), (0, 1))(
        hidden, w_out.T)
    np.testing.assert_allclose(got[0], want[0], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got[1].T, want[1], rtol=1e-5, atol=1e-6)


def test_predictions_are_the_first_arg_max_as_jnp_argmax():
    hidden, w_out, labels, _ = problem(2)
    # Ties: columns 3, 17 and 40 are equal, in three different chunks of 16.
    w_out = w_out.at[:, 17].set(w_out[:, 3]).at[:, 40].set(w_out[:, 3])
    hidden = hidden.at[0, :, :].set(w_out[:, 3] * 10.0)  # row 0 picks the tied columns
    logits = jnp.einsum("bsd,dv->bsv", hidden, w_out)
    losses, predictions = zf.chunked_token_losses(hidden, w_out, labels, token_chunk=7,
                                                  vocab_chunk=16)
    np.testing.assert_array_equal(predictions, jnp.argmax(logits, -1))
    assert (predictions[0] == 3).all()
    np.testing.assert_allclose(
        losses, optax.softmax_cross_entropy_with_integer_labels(logits, labels), rtol=1e-5)


def test_masked_out_tokens_may_carry_any_label():
    hidden, w_out, labels, mask = problem(3)
    ignored = jnp.where(mask, labels, -100)  # an ignore index outside the vocabulary
    want_value, want_grads = jax.value_and_grad(plain_loss, (0, 1))(hidden, w_out, labels, mask)
    value, grads = jax.value_and_grad(
        lambda h, w: zf.chunked_cross_entropy(h, w, ignored, weights=mask, token_chunk=8,
                                              vocab_chunk=8), (0, 1))(hidden, w_out)
    np.testing.assert_allclose(value, want_value, rtol=1e-5)
    for g, w in zip(grads, want_grads):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)


def test_half_precision_inputs_give_gradients_in_their_dtype():
    hidden, w_out, labels, mask = problem(4, jnp.bfloat16)
    f32 = jax.value_and_grad(plain_loss, (0, 1))(hidden.astype(jnp.float32),
                                                 w_out.astype(jnp.float32), labels, mask)
    value, grads = jax.value_and_grad(
        lambda h, w: zf.chunked_cross_entropy(h, w, labels, weights=mask, token_chunk=6,
                                              vocab_chunk=16), (0, 1))(hidden, w_out)
    assert value.dtype == jnp.float32 and [g.dtype for g in grads] == [jnp.bfloat16] * 2
    # fp32 logits from bf16 inputs: the value as fp32's; the gradients to bf16's precision.
    np.testing.assert_allclose(value, f32[0], rtol=1e-5)
    for g, w in zip(grads, f32[1]):
        np.testing.assert_allclose(np.asarray(g, np.float32), w, rtol=0.02, atol=2e-3)


def test_no_array_as_large_as_the_logits_exists_forward_or_backward():
    """Every value in the traced loss and its gradient, scans' bodies included, is smaller than
    the [tokens, vocab] logits; the plain loss holds them (the check sees them)."""
    tokens, width, vocab = 64, 16, 512
    keys = jax.random.split(jax.random.key(5), 3)
    hidden = jax.random.normal(keys[0], (1, tokens, width))
    w_out = jax.random.normal(keys[1], (width, vocab))
    labels = jax.random.randint(keys[2], (1, tokens), 0, vocab)

    def largest(loss):
        jaxpr = jax.make_jaxpr(jax.value_and_grad(loss, (0, 1)))(hidden, w_out)
        return max(np.prod(v.aval.shape) for e in walk(jaxpr) for v in e.outvars
                   if hasattr(v.aval, "shape"))

    chunked = largest(lambda h, w: zf.chunked_cross_entropy(h, w, labels, token_chunk=16,
                                                            vocab_chunk=64))
    assert largest(lambda h, w: plain_loss(h, w, labels)) >= tokens * vocab
    # The largest is the gradient of w_out, [16, 512]: a quarter of the [64, 512] logits.
    assert chunked == width * vocab, chunked


@pytest.mark.parametrize("kwargs,message", [
    (dict(token_chunk=0), "token_chunk must be a positive int"),
    (dict(vocab_chunk=2.5), "vocab_chunk must be a positive int"),
    (dict(vocab_axis=2), "vocab_axis must be 0"),
])
def test_bad_settings_are_one_line(kwargs, message):
    hidden, w_out, labels, _ = problem()
    with pytest.raises(ValueError, match=message) as caught:
        zf.chunked_cross_entropy(hidden, w_out, labels, **kwargs)
    assert "\n" not in str(caught.value)


def test_bad_shapes_are_one_line():
    hidden, w_out, labels, mask = problem()
    cases = [
        ((hidden, w_out.T, labels), {}, "does not contract with hidden"),
        ((hidden, w_out, labels[:, :-1]), {}, "labels shape"),
        ((hidden, w_out, labels.astype(jnp.float32)), {}, "labels must be integers"),
        ((hidden[0, 0], w_out, labels[0, 0]), {}, "hidden must be"),
        ((hidden, w_out, labels), {"weights": mask[0]}, "weights shape"),
    ]
    for args, kwargs, message in cases:
        with pytest.raises(ValueError, match=message) as caught:
            zf.chunked_cross_entropy(*args, **kwargs)
        assert "\n" not in str(caught.value)


def test_inside_a_bare_shard_map_with_replicated_weights():
    """Each device's loss over its rows, the weights the same on every device (unvarying): the
    loops' accumulators must take the varying type their bodies give them, and the weights'
    gradient is summed over the devices, as jax's autodiff of the plain loss does there."""
    mesh = jax.make_mesh((8,), ("data",), devices=jax.devices()[:8])
    keys = jax.random.split(jax.random.key(6), 3)
    hidden = jax.random.normal(keys[0], (8, SEQ, WIDTH))
    w_out = jax.random.normal(keys[1], (WIDTH, VOCAB))
    labels = jax.random.randint(keys[2], (8, SEQ), 0, VOCAB)

    def per_device(h, w, y):
        chunked = jax.value_and_grad(
            lambda h, w: zf.chunked_cross_entropy(h, w, y, token_chunk=6, vocab_chunk=16),
            (0, 1))(h, w)
        plain = jax.value_and_grad(lambda h, w: plain_loss(h, w, y), (0, 1))(h, w)
        return [(loss[None], grads) for loss, grads in (chunked, plain)]

    specs = (P("data"), (P("data"), P()))  # each device's loss; d hidden, d w_out
    sharded = jax.jit(jax.shard_map(per_device, mesh=mesh, in_specs=(P("data"), P(), P("data")),
                                    out_specs=[specs, specs]))
    place = lambda x, spec: jax.device_put(x, NamedSharding(mesh, spec))  # noqa: E731
    chunked, plain = sharded(place(hidden, P("data")), place(w_out, P()),
                             place(labels, P("data")))
    np.testing.assert_allclose(chunked[0], plain[0], rtol=1e-5)
    for got, want in zip(chunked[1], plain[1]):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_trains_in_the_step_at_every_stage_like_plain_optax(stage):
    """A tied-embedding model whose loss is the chunked cross-entropy, trained by the ZeRO step
    on 8 devices, against the same model with the plain loss under plain optax. The mask
    keeps the same number of tokens in every row, so the mean of the devices' means is the
    global mean."""
    width, vocab, seq = 16, 40, 12
    keys = jax.random.split(jax.random.key(7), 2)
    params = {"embedding": jax.random.normal(keys[0], (vocab, width)) * 0.3,
              "mix": jax.random.normal(keys[1], (width, width)) * 0.3}
    batches = [{"tokens": np.random.default_rng(0).integers(0, vocab, (16, seq + 1),
                                                           dtype=np.int32)}] * 3
    mask = jnp.arange(seq) % 3 != 0

    def features(p, batch):
        inputs, targets = batch["tokens"][:, :-1], batch["tokens"][:, 1:]
        return jnp.tanh(p["embedding"][inputs] @ p["mix"]), targets

    def chunked(p, batch):
        hidden, targets = features(p, batch)
        weights = jnp.broadcast_to(mask, targets.shape)
        return zf.chunked_cross_entropy(hidden, p["embedding"], targets, weights=weights,
                                        token_chunk=5, vocab_chunk=16, vocab_axis=0)

    def plain(p, batch):
        hidden, targets = features(p, batch)
        return plain_loss(hidden, p["embedding"].T, targets, jnp.broadcast_to(mask, targets.shape))

    tx = optax.adam(1e-2)
    want, *_ = optax_losses(plain, tx, params, batches)
    plan, prec = zf.ZeroPlan(zf.make_mesh(data=8), stage=stage), zf.Precision()
    state = zf.init_train_state(params, tx, plan, prec)
    got, *_ = train_losses(zf.make_train_step(chunked, tx, plan, prec), state, batches)
    np.testing.assert_allclose(got, want, rtol=1e-5)
    assert want[-1] < want[0]  # it learns
