"""Hugging Face checkpoints against the real implementation: transformers builds tiny random
models of each architecture, zeroflow loads them and must give the same logits; zeroflow's
save_pretrained (as loaded, and after a few zeroflow training steps) must load back in
transformers with the same logits again. Nothing is downloaded."""
import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

pytestmark = pytest.mark.fast

torch = pytest.importorskip("torch", reason="torch is in the test extra (pip install -e '.[test]')")
transformers = pytest.importorskip("transformers", reason="transformers is in the test extra")

import zeroflow as zf  # noqa: E402
from zeroflow import hf  # noqa: E402
from zeroflow.models import make_loss_fn  # noqa: E402
from helpers import train_losses  # noqa: E402

ATOL = 1e-4
T = transformers
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 8}
"Short enough an original context that a tiny head's frequencies fall in all three bands."

CASES = {
    # Llama: GQA 4:2, untied, llama3 rope, every bias; 1 layer MHA tied; 3 layers MQA with a
    # head_dim other than hidden / heads.
    "llama-gqa-untied-llama3-bias": (T.LlamaForCausalLM, T.LlamaConfig, dict(
        vocab_size=101, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
        rope_theta=500.0, rope_scaling=LLAMA3, attention_bias=True, mlp_bias=True)),
    "llama-1layer-tied": (T.LlamaForCausalLM, T.LlamaConfig, dict(
        vocab_size=257, hidden_size=32, intermediate_size=40, num_hidden_layers=1,
        num_attention_heads=2, tie_word_embeddings=True, rms_norm_eps=1e-5)),
    "llama-3layers-mqa-headdim": (T.LlamaForCausalLM, T.LlamaConfig, dict(
        vocab_size=99, hidden_size=48, intermediate_size=64, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=1, head_dim=16)),
    # Mistral: a sliding window shorter than the test sequence; no window, tied.
    "mistral-window4": (T.MistralForCausalLM, T.MistralConfig, dict(
        vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=4)),
    "mistral-nowindow-tied": (T.MistralForCausalLM, T.MistralConfig, dict(
        vocab_size=113, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=4, sliding_window=None,
        tie_word_embeddings=True)),
    # Qwen2: q/k/v biases; MQA tied; GQA untied 3 layers.
    "qwen2-mqa-tied": (T.Qwen2ForCausalLM, T.Qwen2Config, dict(
        vocab_size=257, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=1, tie_word_embeddings=True)),
    "qwen2-3layers-untied": (T.Qwen2ForCausalLM, T.Qwen2Config, dict(
        vocab_size=131, hidden_size=32, intermediate_size=40, num_hidden_layers=3,
        num_attention_heads=8, num_key_value_heads=2, tie_word_embeddings=False,
        rope_theta=1000.0)),
    # GPT-2: fused c_attn, Conv1D layout, learned positions; tanh and erf gelu, untied head.
    "gpt2-2layers": (T.GPT2LMHeadModel, T.GPT2Config, dict(
        vocab_size=101, n_embd=32, n_layer=2, n_head=4, n_positions=24, bos_token_id=0,
        eos_token_id=0)),
    "gpt2-1layer-untied-gelu": (T.GPT2LMHeadModel, T.GPT2Config, dict(
        vocab_size=67, n_embd=24, n_layer=1, n_head=2, n_inner=40, n_positions=16,
        activation_function="gelu", tie_word_embeddings=False, bos_token_id=0, eos_token_id=0)),
}
FINETUNED = ["llama-gqa-untied-llama3-bias", "mistral-window4", "qwen2-mqa-tied", "gpt2-2layers"]
"One case per architecture is also fine-tuned in zeroflow and saved back."


def scrambled(model_class, config_class, kwargs, seed=0):
    """A transformers model whose weights are O(1) random numbers (norm scales around 1), so
    logits spread over several units and a wrong mapping cannot hide under the tolerance."""
    torch.manual_seed(seed)
    model = model_class(config_class(**kwargs)).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            is_norm_scale = p.ndim == 1 and ("norm" in name or ".ln_" in name) and "weight" in name
            p.copy_(1.0 + 0.2 * noise if is_norm_scale else (0.3 if p.ndim > 1 else 0.2) * noise)
    return model


def torch_logits(model, tokens: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor(tokens, dtype=torch.long)).logits.float().numpy()


def zf_logits(model, params, tokens: np.ndarray) -> np.ndarray:
    return np.asarray(model.apply({"params": params}, jnp.asarray(tokens, jnp.int32)))


def tokens_for(vocab: int, seq: int = 12, seed: int = 1) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, vocab, (2, seq))


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Every case saved by transformers, with its reference logits."""
    out = {}
    for name, (model_class, config_class, kwargs) in CASES.items():
        model = scrambled(model_class, config_class, kwargs)
        folder = tmp_path_factory.mktemp(name)
        model.save_pretrained(folder)
        tokens = tokens_for(model.config.vocab_size)
        out[name] = (folder, model_class, tokens, torch_logits(model, tokens))
        out[name + "/numel"] = sum(p.numel() for p in model.parameters())  # tied counted once
    return out


@pytest.mark.parametrize("name", list(CASES))
def test_logits_match_transformers_and_round_trip(name, saved, tmp_path):
    folder, model_class, tokens, reference = saved[name]
    assert reference.std() > 0.5  # the weights are large enough for mistakes to show
    model, params, cfg = hf.from_pretrained(folder, dtype="fp32")
    assert cfg.architecture == model_class.__name__
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(params))
    ours = zf_logits(model, params, tokens)
    np.testing.assert_allclose(ours, reference, atol=ATOL, rtol=0)

    hf.save_pretrained(model, params, cfg, tmp_path / "out")
    back = model_class.from_pretrained(tmp_path / "out").eval()
    np.testing.assert_allclose(torch_logits(back, tokens), reference, atol=ATOL, rtol=0)


@pytest.mark.parametrize("name", list(CASES))
def test_memory_estimator_counts_every_parameter(name, saved):
    """The estimator's closed form (biases, learned positions, untied heads included) against
    transformers' own parameter count."""
    from zeroflow.memory import count_gpt_params
    cfg = hf.read_config(saved[name][0]).model
    assert count_gpt_params(cfg) == saved[name + "/numel"]


def _legacy_rope_keys(config: dict) -> dict:
    """transformers 5's rope_parameters rewritten as the rope_theta / rope_scaling keys most
    published checkpoints carry."""
    params = dict(config.pop("rope_parameters"))
    config["rope_theta"] = params.pop("rope_theta")
    config["rope_scaling"] = None if params.get("rope_type") == "default" else params
    return config


def test_older_rope_keys_read_the_same(saved, tmp_path):
    folder, model_class, tokens, reference = saved["llama-gqa-untied-llama3-bias"]
    legacy = tmp_path / "legacy"
    legacy.mkdir()
    (legacy / "model.safetensors").symlink_to(folder / "model.safetensors")
    config = json.loads((folder / "config.json").read_text())
    assert config["rope_parameters"]["rope_type"] == "llama3"  # what transformers 5 wrote
    (legacy / "config.json").write_text(json.dumps(_legacy_rope_keys(config)))
    model, params, cfg = hf.from_pretrained(legacy)
    assert cfg.model == hf.read_config(folder).model
    assert cfg.model.rope_scaling == "llama3" and cfg.model.rope_base == 500.0
    np.testing.assert_allclose(zf_logits(model, params, tokens), reference, atol=ATOL, rtol=0)
    # Written back in the style it came in, which transformers reads to the same model.
    hf.save_pretrained(model, params, cfg, tmp_path / "out")
    written = json.loads((tmp_path / "out" / "config.json").read_text())
    assert "rope_parameters" not in written and written["rope_scaling"]["rope_type"] == "llama3"
    back = model_class.from_pretrained(tmp_path / "out").eval()
    np.testing.assert_allclose(torch_logits(back, tokens), reference, atol=ATOL, rtol=0)


def _finetune(model, params, plan, tokens: np.ndarray, steps: int = 3):
    """A few zeroflow train steps on next-token loss."""
    prec = zf.Precision(params="fp32")
    tx = optax.adam(3e-2)
    state = zf.init_train_state(params, tx, plan, prec)
    step = zf.make_train_step(make_loss_fn(model.cfg), tx, plan, prec)
    batch = {"tokens": jnp.asarray(np.tile(tokens, (4, 1)), jnp.int32)}
    losses, state, _ = train_losses(step, state, [batch] * steps)
    return state.master_params, losses  # still sharded over the 8 devices: saved from there


@pytest.mark.parametrize("name", FINETUNED)
def test_finetuned_in_zeroflow_loads_back_in_transformers(name, saved, tmp_path):
    folder, model_class, tokens, reference = saved[name]
    plan = zf.ZeroPlan(zf.make_mesh(data=-1), stage=3)  # ZeRO-3 over the 8 emulated devices
    model, params, cfg = hf.from_pretrained(folder, plan=plan)
    tuned, losses = _finetune(model, params, plan, tokens)
    assert losses[-1] < losses[0]
    ours = zf_logits(model, tuned, tokens)
    assert np.abs(ours - reference).max() > 0.1  # training moved the model
    hf.save_pretrained(model, tuned, cfg, tmp_path / "tuned")
    back = model_class.from_pretrained(tmp_path / "tuned").eval()
    np.testing.assert_allclose(torch_logits(back, tokens), ours, atol=ATOL, rtol=0)
