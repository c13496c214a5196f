"""Checkpoints zeroflow cannot read as they are: an architecture or variant it does not run
(mixture-of-experts layers, a vision-language model, a rope scaling it lacks), tensors missing
or of the wrong shape, a tokenizer with more tokens than the model embeds. Each is one line
naming the file and the key, and nothing is written. The folders are tiny models transformers
makes on the spot (nothing downloaded), then edited. The commands on such folders:
test_hf_bad_input_cli.py; cuDNN attention's head dims: test_cudnn_head_dim.py."""
import json
import shutil

import pytest

torch = pytest.importorskip("torch", reason="torch is in the test extra (pip install -e '.[test]')")
transformers = pytest.importorskip("transformers", reason="transformers is in the test extra")
from safetensors.numpy import load_file, save_file  # noqa: E402
from tokenizers import Tokenizer, models, pre_tokenizers  # noqa: E402

from zeroflow import hf  # noqa: E402

pytestmark = pytest.mark.fast
T = transformers

QWEN3 = dict(vocab_size=101, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=False)
PHI3 = dict(vocab_size=83, hidden_size=32, intermediate_size=40, num_hidden_layers=1,
            num_attention_heads=4, num_key_value_heads=2, pad_token_id=0, bos_token_id=1,
            eos_token_id=2)
GEMMA2 = dict(vocab_size=67, hidden_size=16, intermediate_size=24, num_hidden_layers=2,
              num_attention_heads=2, num_key_value_heads=1, head_dim=8, sliding_window=3,
              query_pre_attn_scalar=8)
GEMMA3 = dict(vocab_size=71, hidden_size=16, intermediate_size=24, num_hidden_layers=2,
              num_attention_heads=2, num_key_value_heads=1, head_dim=8, sliding_window=3,
              query_pre_attn_scalar=8, sliding_window_pattern=2)


def _saved(root, name, model_class, config_class, kwargs, **save):
    torch.manual_seed(0)
    folder = root / name
    model_class(config_class(**kwargs)).save_pretrained(folder, **save)
    return folder


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("good")
    return {
        "qwen3": _saved(root, "qwen3", T.Qwen3ForCausalLM, T.Qwen3Config, QWEN3),
        "qwen3-sharded": _saved(root, "qwen3-sharded", T.Qwen3ForCausalLM, T.Qwen3Config, QWEN3,
                                max_shard_size="20KB"),
        "phi3": _saved(root, "phi3", T.Phi3ForCausalLM, T.Phi3Config, PHI3),
        "gemma3": _saved(root, "gemma3", T.Gemma3ForCausalLM, T.Gemma3TextConfig, GEMMA3),
        "gemma2": _saved(root, "gemma2", T.Gemma2ForCausalLM, T.Gemma2Config, GEMMA2),
    }


def _copy(folders, name, tmp_path, config=None, tensors=None):
    """A copy of a good folder with config.json edited by ``config(dict)`` and the tensors of
    model.safetensors by ``tensors(dict)``."""
    folder = tmp_path / f"bad-{name}"
    shutil.copytree(folders[name], folder)
    if config is not None:
        raw = json.loads((folder / "config.json").read_text())
        config(raw)
        (folder / "config.json").write_text(json.dumps(raw))
    if tensors is not None:
        weights = load_file(folder / "model.safetensors")
        tensors(weights)
        save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    return folder


def _listing(folder):
    return sorted((p.relative_to(folder), p.stat().st_size) for p in folder.rglob("*"))


def _one_line_naming(folder, error, file, *keys):
    before = _listing(folder)
    with pytest.raises(hf.HFCheckpointError) as err:
        hf.from_pretrained(folder)
    message = str(err.value)
    assert "\n" not in message
    assert message.startswith(str(folder / file) + ":"), message
    for key in keys:
        assert key in message, message
    assert _listing(folder) == before  # nothing written
    return message


# --- architectures and variants zeroflow does not run -------------------------------------


@pytest.mark.parametrize("edit, says", [
    (dict(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", num_experts=4),
     ["architectures[0]='Qwen3MoeForCausalLM'", "mixture-of-experts"]),
    (dict(architectures=["Qwen2MoeForCausalLM"], model_type="qwen2_moe", num_experts=4),
     ["architectures[0]='Qwen2MoeForCausalLM'", "mixture-of-experts"]),
    (dict(architectures=["MixtralForCausalLM"], model_type="mixtral", num_local_experts=8),
     ["architectures[0]='MixtralForCausalLM'", "mixture-of-experts"]),
    (dict(architectures=None, model_type="qwen3_moe"),
     ["model_type='qwen3_moe'", "mixture-of-experts"]),
    (dict(architectures=["LlavaForConditionalGeneration"], model_type="llava",
          vision_config={"model_type": "clip_vision_model"}),
     ["architectures[0]='LlavaForConditionalGeneration'", "vision-language"]),
])
def test_unsupported_architectures_are_one_line_naming_config_json_key(folders, tmp_path, edit,
                                                                        says):
    folder = _copy(folders, "qwen3", tmp_path, config=lambda c: c.update(edit))
    message = _one_line_naming(folder, None, "config.json", *says)
    assert "supported: LlamaForCausalLM" in message


@pytest.mark.parametrize("name, edit, key, kind", [
    # transformers 5 reads a rope_scaling over the rope_parameters it writes itself: a yarn
    # there is a yarn model, not the default rope_parameters says.
    ("qwen3", lambda c: c.update(rope_scaling={"rope_type": "yarn", "factor": 4.0,
                                               "original_max_position_embeddings": 32}),
     "rope_scaling.rope_type", "yarn"),
    ("qwen3", lambda c: (c.pop("rope_parameters"), c.update(
        rope_theta=1e4, rope_scaling={"type": "dynamic", "factor": 2.0})),
     "rope_scaling.rope_type", "dynamic"),
    ("qwen3", lambda c: c.update(rope_parameters={"rope_type": "yarn", "rope_theta": 1e4,
                                                  "factor": 4.0}),
     "rope_parameters.rope_type", "yarn"),
    # two settings that disagree: transformers 4 and 5 would build different models
    ("qwen3", lambda c: c.update(rope_scaling={"rope_type": "linear", "factor": 2.0}),
     "rope_scaling", "linear"),
    # Phi-3's 128k variants, in both dialects
    ("phi3", lambda c: (c.pop("rope_parameters"), c.update(rope_theta=1e4, rope_scaling={
        "type": "longrope", "short_factor": [1.0] * 4, "long_factor": [2.0] * 4})),
     "rope_scaling.rope_type", "longrope"),
    ("phi3", lambda c: c.update(rope_parameters={"rope_type": "longrope", "rope_theta": 1e4,
                                                 "short_factor": [1.0] * 4,
                                                 "long_factor": [2.0] * 4}),
     "rope_parameters.rope_type", "longrope"),
    # Gemma 3: per kind of layer (transformers 5), yarn on the global layers
    ("gemma3", lambda c: c["rope_parameters"]["full_attention"].update(rope_type="yarn",
                                                                       factor=4.0),
     "rope_parameters.full_attention.rope_type", "yarn"),
    ("gemma3", lambda c: c.update(rope_scaling={"rope_type": "linear", "factor": 2.0}),
     "rope_scaling", "linear"),
    # Gemma 2 scales its one rotary embedding in every layer; the GPT scales the global
    # layers' only (Gemma 3's way), so the windowed layers would differ: refused
    ("gemma2", lambda c: c["rope_parameters"].update(rope_type="linear", factor=4.0),
     "rope_parameters.rope_type", "linear"),
])
def test_unknown_rope_scaling_is_one_line_naming_the_key(folders, tmp_path, name, edit, key,
                                                         kind):
    folder = _copy(folders, name, tmp_path, config=edit)
    # transformers reads the edited config.json as a model of that rope type: a model zeroflow
    # would get wrong if it read the other key
    theirs = T.AutoConfig.from_pretrained(folder).rope_parameters
    theirs = theirs.get("full_attention", theirs)
    assert theirs["rope_type"] == kind
    _one_line_naming(folder, None, "config.json", key, repr(kind))


def _multimodal(root):
    vision = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                  num_attention_heads=2, image_size=28, patch_size=14)
    return _saved(root, "mm", T.Gemma3ForConditionalGeneration, T.Gemma3Config, dict(
        text_config={**GEMMA3, "vocab_size": 80}, vision_config=vision, mm_tokens_per_image=4,
        image_token_index=79, boi_token_index=77, eoi_token_index=78))


def test_a_rope_scaling_beside_rope_parameters_with_another_base_is_refused(folders, tmp_path):
    """transformers reads a rope_scaling over rope_parameters, rope_theta included: with a
    default rope_scaling and no rope_theta beside it, its base is the class default, not the
    500,000 rope_parameters says."""
    folder = _copy(folders, "qwen3", tmp_path, config=lambda c: c.update(
        rope_parameters={"rope_type": "default", "rope_theta": 5e5},
        rope_scaling={"rope_type": "default"}))
    assert T.AutoConfig.from_pretrained(folder).rope_parameters["rope_theta"] != 5e5
    _one_line_naming(folder, None, "config.json", "rope_scaling={'rope_type': 'default'}",
                     "'rope_theta': 500000.0")


def test_gemma3_multimodal_is_read_as_its_text_decoder_in_one_warning_line(tmp_path):
    """Gemma3ForConditionalGeneration: the text decoder is read, the vision tower is not;
    one warning line says so, naming the file and what the model is saved as."""
    folder = _multimodal(tmp_path)
    with pytest.warns(UserWarning) as caught:
        _, params, cfg = hf.from_pretrained(folder)
    messages = [str(w.message) for w in caught if issubclass(w.category, UserWarning)]
    assert len(messages) == 1 and "\n" not in messages[0], messages
    assert messages[0].startswith(str(folder / "config.json") + ":")
    assert "Gemma3ForConditionalGeneration read as its text decoder" in messages[0]
    assert "vision tower is not loaded" in messages[0] and "Gemma3ForCausalLM" in messages[0]
    assert cfg.architecture == "Gemma3ForCausalLM" and "vision_tower" not in params


# --- tensors ------------------------------------------------------------------------------


def test_a_missing_tensor_names_the_file_and_the_key(folders, tmp_path):
    folder = _copy(folders, "qwen3", tmp_path,
                   tensors=lambda t: t.pop("model.layers.1.self_attn.k_norm.weight"))
    _one_line_naming(folder, None, "model.safetensors",
                     "no tensor 'model.layers.1.self_attn.k_norm.weight'")


def test_a_text_tensor_missing_from_a_multimodal_checkpoint_names_its_spelling(tmp_path):
    """The decoder's keys sit under a prefix there; the line names the one looked for."""
    folder = _multimodal(tmp_path)
    weights = load_file(folder / "model.safetensors")
    spelled = next(k for k in weights
                   if k.startswith("language_model.") and k.endswith(".norm.weight"))
    del weights[spelled]
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.warns(UserWarning, match="vision tower is not loaded"):
        _one_line_naming(folder, None, "model.safetensors", "no tensor 'model.norm.weight'",
                         repr(spelled))


def test_a_tensor_missing_from_a_sharded_checkpoint_names_its_index(folders, tmp_path):
    folder = _copy(folders, "qwen3-sharded", tmp_path)
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1  # really sharded
    del index["weight_map"]["model.layers.0.mlp.up_proj.weight"]
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    _one_line_naming(folder, None, "model.safetensors.index.json",
                     "no tensor 'model.layers.0.mlp.up_proj.weight'")


def test_an_index_pointing_at_a_shard_without_the_tensor_names_the_shard(folders, tmp_path):
    folder = _copy(folders, "qwen3-sharded", tmp_path)
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    key = "model.norm.weight"
    shard = next(f for f in sorted(set(index["weight_map"].values()))
                 if f != index["weight_map"][key])
    index["weight_map"][key] = shard
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    _one_line_naming(folder, None, shard, f"no tensor '{key}'", "model.safetensors.index.json")


def test_a_tensor_of_the_wrong_shape_names_the_file_the_key_and_both_shapes(folders, tmp_path):
    key = "model.layers.0.mlp.up_proj.weight"
    folder = _copy(folders, "qwen3", tmp_path, tensors=lambda t: t.update({key: t[key][:40]}))
    _one_line_naming(folder, None, "model.safetensors", key, "[40, 32]", "[48, 32]")


def test_expert_weights_in_a_dense_checkpoint_are_not_dropped_silently(folders, tmp_path):
    """config.json says Qwen3ForCausalLM but the weights hold experts (a MoE export renamed):
    a weight nothing would read is an error, not a smaller model."""
    key = "model.layers.0.mlp.experts.0.up_proj.weight"
    folder = _copy(folders, "qwen3", tmp_path, tensors=lambda t: t.update(
        {key: t["model.layers.0.mlp.up_proj.weight"]}))
    _one_line_naming(folder, None, "model.safetensors", key, "not part of the architecture")


def test_a_tensor_of_a_shard_with_the_wrong_shape_names_that_shard(folders, tmp_path):
    folder = _copy(folders, "qwen3-sharded", tmp_path)
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    key = "model.embed_tokens.weight"
    shard = index["weight_map"][key]
    weights = load_file(folder / shard)
    weights[key] = weights[key][:100]
    save_file(weights, folder / shard, metadata={"format": "pt"})
    _one_line_naming(folder, None, shard, key, "[100, 32]", "[101, 32]")


# --- a tokenizer that does not match the vocabulary ---------------------------------------


def _word_tokenizer(folder, size: int):
    vocab = {f"w{i}": i for i in range(size - 1)} | {"[UNK]": size - 1}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(folder / "tokenizer.json"))
    return folder


def test_a_tokenizer_larger_than_the_embedding_is_one_line_naming_both_files(folders, tmp_path):
    folder = _copy(folders, "qwen3", tmp_path)
    model_vocab = json.loads((folder / "config.json").read_text())["vocab_size"]
    tokens = Tokenizer.from_file(str(_word_tokenizer(folder, 150) / "tokenizer.json"))
    assert tokens.get_vocab_size() == 150 > model_vocab  # the tokenizers library's own count
    tok = hf.load_tokenizer(folder)
    with pytest.raises(hf.HFCheckpointError) as err:
        hf.check_tokenizer(tok, hf.read_config(folder).model.vocab_size, folder, "data.tokenizer")
    message = str(err.value)
    assert "\n" not in message and message.startswith(f"data.tokenizer {folder}/tokenizer.json:")
    assert "150 tokens" in message and f"{folder}/config.json vocab_size={model_vocab}" in message
    # a tokenizer with no more tokens than rows is fine (padded embeddings are common)
    _word_tokenizer(folder, model_vocab)
    hf.check_tokenizer(hf.load_tokenizer(folder), model_vocab, folder)
