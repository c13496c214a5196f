"""Qwen3, Gemma 2, Gemma 3 and Phi-3 against transformers: tiny random models of each made on
the spot (nothing downloaded), read by zeroflow with the same logits and the same greedy
tokens, saved back and read by transformers with the same logits, and fine-tuned with LoRA at
ZeRO stage 3 over the 8 emulated devices with the adapters exported for peft."""
import json

import jax
import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch is in the test extra (pip install -e '.[test]')")
transformers = pytest.importorskip("transformers", reason="transformers is in the test extra")

from zeroflow import hf  # noqa: E402
from zeroflow.models.sampling import generate  # noqa: E402
from test_hf_parity import ATOL, scrambled, tokens_for, torch_logits, zf_logits  # noqa: E402

pytestmark = pytest.mark.fast
T = transformers

CASES = {
    # Qwen3: qk-norm, GQA, head_dim other than hidden / heads, untied; every bias, tied, MQA.
    "qwen3-gqa-headdim": (T.Qwen3ForCausalLM, T.Qwen3Config, dict(
        vocab_size=101, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=False,
        rope_theta=1000.0)),
    "qwen3-bias-tied": (T.Qwen3ForCausalLM, T.Qwen3Config, dict(
        vocab_size=67, hidden_size=32, intermediate_size=40, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=1, head_dim=8, attention_bias=True,
        tie_word_embeddings=True)),
    # Gemma 2: windowed / global layers alternating (window 4 < the 12 tokens), both
    # soft-caps, a query scalar other than head_dim.
    "gemma2-softcap": (T.Gemma2ForCausalLM, T.Gemma2Config, dict(
        vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=4,
        query_pre_attn_scalar=12, attn_logit_softcapping=5.0, final_logit_softcapping=3.0)),
    # Gemma 3: qk-norm, a global layer every 2nd, local rope base 100, global 5000 with linear
    # scaling; and the published 5:1 pattern with 6 layers.
    "gemma3-pattern2-linear": (T.Gemma3ForCausalLM, T.Gemma3TextConfig, dict(
        vocab_size=89, hidden_size=32, intermediate_size=48, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=1, head_dim=16, sliding_window=4,
        query_pre_attn_scalar=24, sliding_window_pattern=2, rope_theta=5000.0,
        rope_local_base_freq=100.0, rope_scaling={"rope_type": "linear", "factor": 4.0})),
    "gemma3-pattern6": (T.Gemma3ForCausalLM, T.Gemma3TextConfig, dict(
        vocab_size=71, hidden_size=16, intermediate_size=24, num_hidden_layers=6,
        num_attention_heads=2, num_key_value_heads=1, head_dim=8, sliding_window=3,
        query_pre_attn_scalar=8)),
    # Llama with linear rotary scaling (read for every rotary architecture now).
    "llama-linear-rope": (T.LlamaForCausalLM, T.LlamaConfig, dict(
        vocab_size=59, hidden_size=32, intermediate_size=40, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, rope_theta=100.0,
        rope_scaling={"rope_type": "linear", "factor": 3.0})),
    # Phi-3: fused qkv and gate_up, a window; Phi-4's shape (no window, MHA).
    "phi3-window": (T.Phi3ForCausalLM, T.Phi3Config, dict(
        vocab_size=83, hidden_size=32, intermediate_size=40, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, sliding_window=5, pad_token_id=0,
        bos_token_id=1, eos_token_id=2)),
    "phi4-shape": (T.Phi3ForCausalLM, T.Phi3Config, dict(
        vocab_size=61, hidden_size=24, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=3, num_key_value_heads=3, sliding_window=None, pad_token_id=0,
        bos_token_id=1, eos_token_id=2, rope_theta=250000.0)),
}
ONE_EACH = ["qwen3-gqa-headdim", "gemma2-softcap", "gemma3-pattern2-linear", "phi3-window"]
"One case per architecture for the slower checks (generation, LoRA at stage 3)."


def save_cases(tmp_path_factory, names=tuple(CASES)) -> dict:
    """The cases saved by transformers: (folder, model, tokens, reference logits)."""
    out = {}
    for name in names:
        model_class, config_class, kwargs = CASES[name]
        model = scrambled(model_class, config_class, kwargs)
        folder = tmp_path_factory.mktemp(name)
        model.save_pretrained(folder)
        tokens = tokens_for(model.config.vocab_size)
        out[name] = (folder, model, tokens, torch_logits(model, tokens))
    return out


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    return save_cases(tmp_path_factory)


@pytest.mark.parametrize("name", list(CASES))
def test_logits_match_transformers_and_round_trip(name, saved, tmp_path):
    folder, reference_model, tokens, reference = saved[name]
    assert reference.std() > 0.5  # the weights are large enough for mistakes to show
    model, params, cfg = hf.from_pretrained(folder, dtype="fp32")
    assert cfg.architecture == type(reference_model).__name__
    np.testing.assert_allclose(zf_logits(model, params, tokens), reference, atol=ATOL, rtol=0)
    hf.save_pretrained(model, params, cfg, tmp_path / "out")
    back = type(reference_model).from_pretrained(tmp_path / "out").eval()
    np.testing.assert_allclose(torch_logits(back, tokens), reference, atol=ATOL, rtol=0)
    assert back.config.to_dict().get("layer_types") == reference_model.config.to_dict().get(
        "layer_types")


@pytest.mark.parametrize("name", ONE_EACH)
def test_greedy_generation_is_token_identical(name, saved):
    folder, reference_model, tokens, _ = saved[name]
    prompt = [int(t) for t in tokens[0, :5]]
    with torch.no_grad():
        theirs = reference_model.generate(
            torch.tensor([prompt]), do_sample=False, max_new_tokens=8, min_new_tokens=8,
            pad_token_id=0)[0, len(prompt):].tolist()
    _, params, cfg = hf.from_pretrained(folder, seq_len=16)
    ours = generate(params, cfg.model, prompt, max_new_tokens=8, temperature=0.0,
                    rng=jax.random.key(0))
    assert ours == theirs


def test_gemma3_multimodal_checkpoint_reads_its_text_decoder(tmp_path):
    """A Gemma3ForConditionalGeneration folder (as the published 4B-27B): its language model
    is read (one warning line says the vision tower is not), with the logits transformers'
    multimodal model gives for text; saved back as a Gemma3ForCausalLM transformers reads."""
    vision = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                  num_attention_heads=2, image_size=28, patch_size=14)
    text = dict(vocab_size=80, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                num_attention_heads=2, num_key_value_heads=1, head_dim=16, sliding_window=4,
                query_pre_attn_scalar=16, rope_scaling={"rope_type": "linear", "factor": 8.0})
    model = scrambled(T.Gemma3ForConditionalGeneration, T.Gemma3Config, dict(
        text_config=text, vision_config=vision, mm_tokens_per_image=4, image_token_index=79,
        boi_token_index=77, eoi_token_index=78))
    model.save_pretrained(tmp_path / "mm")
    tokens = tokens_for(76)  # no image tokens
    reference = torch_logits(model, tokens)
    with pytest.warns(UserWarning, match="vision tower is not loaded"):
        ours_model, params, cfg = hf.from_pretrained(tmp_path / "mm")
    assert cfg.architecture == "Gemma3ForCausalLM" and cfg.model.rope_scaling == "linear"
    np.testing.assert_allclose(zf_logits(ours_model, params, tokens), reference, atol=ATOL,
                               rtol=0)
    hf.save_pretrained(ours_model, params, cfg, tmp_path / "text")
    back = T.Gemma3ForCausalLM.from_pretrained(tmp_path / "text").eval()
    np.testing.assert_allclose(torch_logits(back, tokens), reference, atol=ATOL, rtol=0)


# --- bad input: one line naming the file and key ------------------------------------------------


def _config_folder(tmp_path, config: dict):
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "config.json").write_text(json.dumps(config))
    return tmp_path


def _saved_config(saved, name) -> dict:
    return json.loads((saved[name][0] / "config.json").read_text())


@pytest.mark.parametrize("edit, key", [
    # Phi-3's 128k variants: LongRoPE.
    (lambda c: c.update(rope_parameters={"rope_type": "longrope", "rope_theta": 1e4,
                                         "short_factor": [1.0] * 4, "long_factor": [2.0] * 4}),
     "rope_parameters.rope_type"),
    # Phi-4-mini: rotary on part of the head.
    (lambda c: c["rope_parameters"].update(partial_rotary_factor=0.75), "partial_rotary_factor"),
])
def test_unsupported_phi3_variants_are_refused_in_one_line(saved, tmp_path, edit, key):
    config = _saved_config(saved, "phi3-window")
    edit(config)
    folder = _config_folder(tmp_path / "bad", config)
    with pytest.raises(hf.HFCheckpointError) as err:
        hf.read_config(folder)
    message = str(err.value)
    assert "\n" not in message and "config.json" in message and key in message


def test_unsupported_gemma_and_qwen3_variants_are_refused_in_one_line(saved, tmp_path):
    irregular = _saved_config(saved, "gemma3-pattern6")
    irregular["layer_types"] = ["full_attention", *irregular["layer_types"][1:]]
    sliding_qwen3 = {**_saved_config(saved, "qwen3-gqa-headdim"), "use_sliding_window": True,
                     "sliding_window": 4, "max_window_layers": 1}
    moe = {**_saved_config(saved, "qwen3-gqa-headdim"), "architectures": ["Qwen3MoeForCausalLM"]}
    for config, key in ((irregular, "layer_types"), (sliding_qwen3, "use_sliding_window"),
                        (moe, "Qwen3MoeForCausalLM")):
        folder = _config_folder(tmp_path / key, config)
        with pytest.raises(hf.HFCheckpointError, match=key) as err:
            hf.read_config(folder)
        assert "\n" not in str(err.value) and str(folder / "config.json") in str(err.value)


def test_fused_tensor_of_the_wrong_shape_is_refused_naming_it(saved, tmp_path):
    folder = saved["phi3-window"][0]
    config = {**_saved_config(saved, "phi3-window"), "num_key_value_heads": 4}
    bad = _config_folder(tmp_path / "bad", config)
    (bad / "model.safetensors").symlink_to(folder / "model.safetensors")
    with pytest.raises(hf.HFCheckpointError, match=r"qkv_proj.weight has shape \[64, 32\]"):
        hf.from_pretrained(bad)


def test_a_model_no_architecture_expresses_is_refused_and_nothing_written(tmp_path):
    from zeroflow.config.schema import ModelConfig
    from zeroflow.models.gpt import GPT, init_params
    cfg = ModelConfig(mlp_activation="geglu", post_norms=False, seq_len=8)  # Gemma's MLP only
    params, _ = init_params(cfg, jax.random.key(0))
    with pytest.raises(hf.HFCheckpointError, match="no Hugging Face architecture fits"):
        hf.save_pretrained(GPT(cfg), params, cfg, tmp_path / "out")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("fields, setting", [
    (dict(attn_softcap=50.0, attention="cudnn"), "model.attn_softcap"),
    (dict(attn_softcap=50.0, attention="pallas"), "model.attn_softcap"),
    (dict(logit_softcap=30.0, loss_chunk=4), "model.logit_softcap"),
    (dict(global_every=2), "model.global_every"),
])
def test_options_a_path_cannot_run_are_refused_at_config_time(fields, setting):
    from zeroflow.config.schema import ModelConfig
    from zeroflow.models.gpt import check_config
    with pytest.raises(ValueError, match=setting) as err:
        check_config(ModelConfig(**fields))
    assert "\n" not in str(err.value)


# --- the published configs stored under configs/hf/ -------------------------------------------


def _meta_param_count(model_class, config) -> int:
    with torch.device("meta"):
        return sum(p.numel() for p in model_class(config).parameters())


@pytest.mark.parametrize("folder, model_class", [
    ("configs/hf/qwen3-8b", "Qwen3ForCausalLM"),
    ("configs/hf/gemma-3-12b", "Gemma3ForCausalLM"),
])
def test_stored_published_configs_mean_what_transformers_reads(folder, model_class):
    """config.json as published (Gemma 3 12B's is multimodal and leaves most keys to the
    class defaults): the architecture we read has transformers' parameter count and layer
    kinds, window, query scalar and rotary bases."""
    from zeroflow.models.gpt import abstract_params, count_params
    from helpers import REPO
    if "gemma" in folder:
        with pytest.warns(UserWarning, match="vision tower is not loaded"):
            cfg = hf.read_config(REPO / folder).model
    else:
        cfg = hf.read_config(REPO / folder).model
    theirs = T.AutoConfig.from_pretrained(REPO / folder)
    theirs = getattr(theirs, "text_config", theirs)
    from zeroflow.memory import count_gpt_params
    published = _meta_param_count(getattr(T, model_class), theirs)
    assert count_params(abstract_params(cfg)[0]) == published
    # zf.memory's count, which the ZeRO formula reads (the model's own init, no restatement)
    assert count_gpt_params(cfg) == published
    assert (cfg.num_layers, cfg.head_dim or cfg.embed_dim // cfg.num_heads) == (
        theirs.num_hidden_layers, theirs.head_dim)
    kinds = getattr(theirs, "layer_types", None) or ["full_attention"] * cfg.num_layers
    local = [k == "sliding_attention" for k in kinds]
    every = cfg.global_every or cfg.num_layers + 1
    assert local == [bool(cfg.sliding_window) and (i + 1) % every != 0
                     for i in range(cfg.num_layers)]
    rope = theirs.rope_parameters
    if "full_attention" in rope:  # Gemma 3: one per kind of layer
        assert cfg.rope_base == rope["full_attention"]["rope_theta"]
        assert cfg.local_rope_base == rope["sliding_attention"]["rope_theta"]
        assert (cfg.rope_scaling, cfg.rope_scaling_factor) == (
            rope["full_attention"]["rope_type"], rope["full_attention"]["factor"])
        assert (cfg.sliding_window, cfg.query_pre_attn_scalar) == (
            theirs.sliding_window, theirs.query_pre_attn_scalar)
    else:
        assert cfg.rope_base == rope["rope_theta"] and cfg.qk_norm

