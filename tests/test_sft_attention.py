"""Packed rows: attention never crosses examples, in every attention path of the GPT.

Two examples (and padding) packed in one row must give, at every real position, what each
example gives alone in a row of its own: the whole model on the xla path (rope and learned
positions), the Pallas flash kernel in interpret mode forward and backward, and the cuDNN path
lowered for CUDA (it only runs on a GPU).
"""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from zeroflow.config.schema import ModelConfig
from zeroflow.models import GPT, init_params
from zeroflow.models import gpt as gpt_module
from pallas_kernels import TuningConfig, flash_attention, reference_attention

pytestmark = pytest.mark.fast

LENGTHS = (5, 9)
"Two examples packed in a row of 16: segments 1 and 2, then 2 padding tokens (segment 0)."
SEQ = 16
SMALL = TuningConfig(block_k=64, block_k_dq=64)


def _packing():
    segment_ids = np.zeros(SEQ, np.int32)
    positions = np.zeros(SEQ, np.int32)
    start = 0
    for segment, length in enumerate(LENGTHS, 1):
        segment_ids[start:start + length] = segment
        positions[start:start + length] = np.arange(length)
        start += length
    return segment_ids, positions


def _spans():
    starts = np.cumsum((0,) + LENGTHS[:-1])
    return [(int(s), int(s) + n) for s, n in zip(starts, LENGTHS)]


@pytest.mark.parametrize("positions", ["rope", "learned"])
def test_packed_gpt_logits_equal_each_example_alone_xla(positions):
    cfg = ModelConfig(vocab_size=64, seq_len=SEQ, num_layers=1, embed_dim=32, num_heads=4,
                      num_kv_heads=2, mlp_dim=64, positions=positions)
    params, _ = init_params(cfg, jax.random.key(0))
    tokens = np.random.default_rng(0).integers(1, 64, (1, SEQ)).astype(np.int32)
    segment_ids, pos = _packing()
    model = GPT(cfg)
    packed = model.apply({"params": params}, tokens, segment_ids=segment_ids[None],
                         positions=pos[None])
    unmasked = model.apply({"params": params}, tokens)
    for start, end in _spans():
        alone = model.apply({"params": params}, tokens[:, start:end])  # positions 0.., no neighbours
        np.testing.assert_allclose(packed[0, start:end], alone[0], atol=1e-5, rtol=1e-5)
    # Without segments the second example would see the first: the check above can fail.
    second = slice(*_spans()[1])
    assert not np.allclose(unmasked[0, second], packed[0, second], atol=1e-3)


def _qkv(seed=0):
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.standard_normal((1, SEQ, 4, 16)), jnp.float32)
    k, v = (jnp.asarray(rng.standard_normal((1, SEQ, 2, 16)), jnp.float32) for _ in range(2))
    d_out = jnp.asarray(rng.standard_normal((1, SEQ, 4, 16)), jnp.float32)
    return q, k, v, d_out


def _per_example(q, k, v):
    """Causal attention of each example alone, placed back at its positions (padding: 0)."""
    out = jnp.zeros(q.shape, jnp.float32)
    for start, end in _spans():
        piece = reference_attention(q[:, start:end], k[:, start:end], v[:, start:end], causal=True)
        out = out.at[:, start:end].set(piece)
    return out


def test_pallas_packed_forward_and_backward_equal_unpacked_examples():
    q, k, v, d_out = _qkv()
    segment_ids = jnp.asarray(_packing()[0])[None]
    real = (segment_ids > 0)[..., None, None]  # padding rows are not compared

    def flash(q, k, v):
        return flash_attention(q, k, v, causal=True, segment_ids=segment_ids,
                               tuning=SMALL, interpret=True)

    def loss(attention, q, k, v):
        return jnp.sum(jnp.where(real, attention(q, k, v), 0.0) * d_out)

    out = jax.jit(flash)(q, k, v)
    want = _per_example(q, k, v)
    np.testing.assert_allclose(jnp.where(real, out, 0), want, atol=2e-5, rtol=2e-5)
    # The reference with segment ids agrees too (it is what the other tests compare against).
    reference = reference_attention(q, k, v, causal=True, segment_ids=segment_ids)
    np.testing.assert_allclose(jnp.where(real, reference, 0), want, atol=2e-5, rtol=2e-5)

    grads = jax.jit(jax.grad(functools.partial(loss, flash), argnums=(0, 1, 2)))(q, k, v)
    want_grads = jax.jit(jax.grad(functools.partial(loss, _per_example), argnums=(0, 1, 2)))(
        q, k, v)
    for name, got, expected in zip("qkv", grads, want_grads):
        np.testing.assert_allclose(got, expected, atol=2e-5, rtol=2e-5, err_msg=f"d{name}")


def test_pallas_segments_in_the_gpt_equal_xla():
    cfg = ModelConfig(vocab_size=64, seq_len=SEQ, num_layers=1, embed_dim=32, num_heads=2,
                      mlp_dim=64)
    params, _ = init_params(cfg, jax.random.key(1))
    tokens = np.random.default_rng(1).integers(1, 64, (1, SEQ)).astype(np.int32)
    segment_ids, pos = _packing()
    kwargs = dict(segment_ids=segment_ids[None], positions=pos[None])
    xla = GPT(cfg).apply({"params": params}, tokens, **kwargs)
    pallas = GPT(ModelConfig(**{**cfg.__dict__, "attention": "pallas"})).apply(
        {"params": params}, tokens, **kwargs)
    real = segment_ids > 0
    np.testing.assert_allclose(pallas[0, real], xla[0, real], atol=2e-5, rtol=2e-5)


def _custom_calls(fn, *args) -> list[str]:
    text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    return [line.split("@")[1].split("(")[0] for line in text.splitlines()
            if "stablehlo.custom_call @__cudnn" in line]


def test_cudnn_path_passes_segments_as_a_mask_and_lowers_for_cuda(monkeypatch):
    """cuDNN runs only on a GPU: lower for CUDA here and check that the segments reach the
    fused attention call as its bias operand (cuDNN's form of a boolean mask)."""
    from jax._src.cudnn import fused_attention_stablehlo as cudnn

    from zeroflow import backend

    # Lowering asks the installed cuDNN for its version; there is none on a CPU machine. Any
    # version with fused attention will do for lowering (nothing runs). causal_attention reads
    # the traits of the devices it is traced for: a GPU's here.
    monkeypatch.setattr(cudnn, "check_cudnn_version", lambda: 90100)
    q = jax.ShapeDtypeStruct((2, 64, 4, 32), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((2, 64, 2, 32), jnp.bfloat16)
    seg = jax.ShapeDtypeStruct((2, 64), jnp.int32)

    def attention(q, k, v, segment_ids=None):
        return gpt_module.causal_attention(q, k, v, "cudnn", segment_ids=segment_ids)

    def loss(q, k, v, segment_ids):
        return attention(q, k, v, segment_ids).astype(jnp.float32).sum()

    with backend.tracing_for(backend.for_platform("gpu")):
        assert _custom_calls(attention, q, kv, kv) == ["__cudnn$fmhaSoftmax"]
        assert _custom_calls(attention, q, kv, kv, seg) == ["__cudnn$fmhaScaleBiasSoftmax"]
        backward = _custom_calls(jax.grad(loss, argnums=(0, 1, 2)), q, kv, kv, seg)
    assert sorted(backward) == ["__cudnn$fmhaScaleBiasSoftmax",
                                "__cudnn$fmhaScaleBiasSoftmaxBackward"]


def test_pallas_segments_lower_for_cuda():
    from pallas_kernels._mgpu import lower_for_cuda

    q = jax.ShapeDtypeStruct((2, 100, 6, 64), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((2, 100, 2, 64), jnp.bfloat16)
    seg = jax.ShapeDtypeStruct((2, 100), jnp.int32)
    attention = functools.partial(flash_attention, causal=True, interpret=False)
    loss = lambda q, k, v, s: attention(q, k, v, segment_ids=s).astype(jnp.float32).sum()
    # The forward kernel, then the dQ and dK/dV kernels, all Mosaic GPU calls.
    assert lower_for_cuda(jax.grad(loss, argnums=(0, 1, 2)), q, kv, kv, seg) == 3
