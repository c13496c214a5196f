"""Where the loader puts each tensor and what it reads: ZeRO-3 and tensor-parallel placement on
8 emulated devices, bf16 exactness, sharded saving, and one-line errors for what zeroflow
cannot run."""
import json
from collections import defaultdict

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

pytestmark = pytest.mark.fast

torch = pytest.importorskip("torch", reason="torch is in the test extra (pip install -e '.[test]')")
transformers = pytest.importorskip("transformers", reason="transformers is in the test extra")

import zeroflow as zf  # noqa: E402
from zeroflow import hf  # noqa: E402
from zeroflow.models import abstract_params  # noqa: E402
from zeroflow.models.rules import gpt_tensor_rules  # noqa: E402
from zeroflow.util.tree import path_str  # noqa: E402
from zeroflow.engine.plan import LeafLayout  # noqa: E402

T = transformers
QWEN2 = (T.Qwen2ForCausalLM, T.Qwen2Config, dict(
    vocab_size=101, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False))
GPT2 = (T.GPT2LMHeadModel, T.GPT2Config, dict(
    vocab_size=101, n_embd=64, n_layer=2, n_head=4, n_positions=32, bos_token_id=0,
    eos_token_id=0))
LLAMA = (T.LlamaForCausalLM, T.LlamaConfig, dict(
    vocab_size=99, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2))


def save_hf(spec, folder, dtype=None, seed=0):
    model_class, config_class, kwargs = spec
    torch.manual_seed(seed)
    model = model_class(config_class(**kwargs)).eval()
    if dtype is not None:
        model = model.to(dtype)
    model.save_pretrained(folder)
    return model


class CountingReader(hf.SafetensorsReader):
    """Records every slice the loader asks for: (key, elements)."""

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self.reads = []

    def read(self, key, slices):
        out = super().read(key, slices)
        self.reads.append((key, out.size, slices))
        return out


def _load_counted(folder, plan):
    cfg = hf.read_config(folder)
    converter = hf.CONVERTERS[cfg.architecture]
    reader = CountingReader(folder, converter.key_prefixes)
    abstract = abstract_params(cfg.model)[0]
    params = hf.load_params(folder, cfg.model, converter=converter, reader=reader,
                            shardings=plan.storage_shardings(abstract))
    return cfg, converter, params, reader.reads, abstract


@pytest.mark.parametrize("spec,mesh", [(QWEN2, dict(data=8, model=1)),
                                       (GPT2, dict(data=8, model=1)),
                                       (QWEN2, dict(data=4, model=2))],
                         ids=["qwen2-zero3", "gpt2-zero3", "qwen2-zero3-tp2"])
def test_each_device_gets_only_its_shard_and_each_tensor_is_read_once(spec, mesh, tmp_path):
    save_hf(spec, tmp_path)
    cfg = hf.read_config(tmp_path)
    mesh = zf.make_mesh(**mesh)
    rules = gpt_tensor_rules(cfg.model, mesh.shape["model"]) if mesh.shape["model"] > 1 else ()
    plan = zf.ZeroPlan(mesh, stage=3, tensor_rules=rules)
    cfg, converter, params, reads, abstract = _load_counted(tmp_path, plan)
    reference = hf.load_params(tmp_path, cfg.model)  # one device, read whole
    expected = plan.storage_shardings(abstract)
    layouts = plan.layouts(abstract)
    split = 0
    for (path, leaf), want, layout, whole in zip(
            jax.tree_util.tree_leaves_with_path(params), jax.tree.leaves(expected),
            jax.tree.leaves(layouts, is_leaf=lambda x: isinstance(x, LeafLayout)),
            jax.tree.leaves(reference)):
        assert leaf.sharding.is_equivalent_to(want, leaf.ndim), path_str(path)
        np.testing.assert_array_equal(np.asarray(leaf), np.asarray(whole))
        for shard in leaf.addressable_shards:  # a device holds its slice, never the whole leaf
            assert shard.data.shape == want.shard_shape(leaf.shape)
        if layout.zero_dim is not None:
            split += 1
            assert want.shard_shape(leaf.shape)[layout.zero_dim] < leaf.shape[layout.zero_dim]
    assert split >= len(jax.tree.leaves(params)) - 2  # all but maybe a tiny vector or two
    # Every element of every tensor is read exactly once: no device's slice is read twice
    # (devices sharing a slice share one read) and no leaf is read whole for a device that
    # keeps a part of it.
    per_key = defaultdict(int)
    for key, size, _ in reads:
        per_key[key] += size
    tables = converter.tensor_maps(cfg.model)
    expected_reads = defaultdict(int)
    for m in tables:
        for layer in (range(cfg.model.num_layers) if m.stacked else [None]):
            expected_reads[m.key(layer)] += int(np.prod(m.part_shape))
    assert dict(per_key) == dict(expected_reads)
    # Reads go leaf by leaf: once the loader moves on from a tensor it never comes back, so at
    # most one tensor's slices are staged on the host at a time.
    def leaf_of(key, slices):  # GPT-2's c_attn holds three leaves: tell them by the offset
        for m in tables:
            if key in (m.key(i) for i in range(cfg.model.num_layers)) or key == m.key(None):
                if m.part is None:
                    return m.ours
                dim, offset = m.part
                if offset <= slices[dim].start < offset + m.part_shape[dim]:
                    return m.ours
    leaf_sequence = [leaf_of(key, slices) for key, _, slices in reads]
    assert None not in leaf_sequence
    finished = set()
    for previous, current in zip(leaf_sequence, leaf_sequence[1:]):
        if current != previous:
            finished.add(previous)
            assert current not in finished


def test_bf16_checkpoint_loads_exactly(tmp_path):
    model = save_hf(LLAMA, tmp_path, dtype=torch.bfloat16)
    stored = load_file(str(tmp_path / "model.safetensors"))
    assert stored["model.embed_tokens.weight"].dtype == ml_dtypes.bfloat16
    _, fp32, _ = hf.from_pretrained(tmp_path, dtype="fp32")
    _, bf16, cfg = hf.from_pretrained(tmp_path, dtype="bf16")
    embed = model.model.embed_tokens.weight.detach()
    np.testing.assert_array_equal(np.asarray(fp32["embedding"]), embed.float().numpy())
    assert bf16["embedding"].dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(bf16["embedding"]).view(np.uint16),
                                  embed.view(torch.int16).numpy().view(np.uint16))
    q = model.model.layers[1].self_attn.q_proj.weight.detach().float().numpy()  # [H*D, E]
    ours = np.asarray(fp32["layers"]["attn"]["query"]["kernel"][1])  # [E, H, D]
    np.testing.assert_array_equal(ours.reshape(ours.shape[0], -1).T, q)
    # Saved back in bf16 the file holds the same bits as transformers wrote.
    hf.save_pretrained(hf.from_pretrained(tmp_path)[0], bf16, cfg, tmp_path / "out", dtype="bf16")
    again = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert set(again) == set(stored)
    for key, value in stored.items():
        assert again[key].dtype == value.dtype
        np.testing.assert_array_equal(again[key].view(np.uint16), value.view(np.uint16))


def test_large_models_are_saved_in_shards_that_transformers_reads(tmp_path):
    save_hf(GPT2, tmp_path / "src")
    model, params, cfg = hf.from_pretrained(tmp_path / "src")
    out = hf.save_pretrained(model, params, cfg, tmp_path / "out", max_shard_bytes=20_000)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) >= 4 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    assert sorted(p.name for p in out.glob("*.safetensors")) == files
    tokens = torch.randint(0, 101, (2, 10))
    with torch.no_grad():
        theirs = T.GPT2LMHeadModel.from_pretrained(out).eval()(tokens).logits.numpy()
    ours = np.asarray(model.apply({"params": params}, jnp.asarray(tokens.numpy(), jnp.int32)))
    np.testing.assert_allclose(theirs, ours, atol=1e-4, rtol=0)
    _, again, _ = hf.from_pretrained(out)
    jax.tree.map(np.testing.assert_array_equal, again, params)
    # Saving again unsharded leaves no stale shard behind.
    hf.save_pretrained(model, params, cfg, out)
    assert [p.name for p in out.glob("*.safetensors")] == ["model.safetensors"]
    assert not (out / "model.safetensors.index.json").exists()


def _edit_config(folder, **changes):
    config = json.loads((folder / "config.json").read_text())
    config.update(changes)
    (folder / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize("spec,changes,needle", [
    (LLAMA, {"architectures": ["FalconForCausalLM"]},
     "config.json architectures[0]='FalconForCausalLM' is not supported; supported: "
     "LlamaForCausalLM, "
     "MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM, Phi3ForCausalLM"),
    (LLAMA, {"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}},
     "rope_parameters.rope_type='yarn' is not supported; zeroflow supports rope types "
     "default, llama3"),
    (LLAMA, {"rope_parameters": None, "rope_theta": 1e4, "rope_scaling": {"type": "dynamic",
                                                                          "factor": 2.0}},
     "rope_scaling.rope_type='dynamic' is not supported"),
    (LLAMA, {"hidden_act": "gelu"}, "hidden_act='gelu' is not supported"),
    (LLAMA, {"rope_parameters": {"rope_type": "default", "rope_theta": 1e4,
                                 "partial_rotary_factor": 0.5}}, "partial_rotary_factor=0.5"),
    (QWEN2, {"use_sliding_window": True, "sliding_window": 4}, "use_sliding_window=True"),
    (GPT2, {"scale_attn_by_inverse_layer_idx": True}, "scale_attn_by_inverse_layer_idx=True"),
    (GPT2, {"activation_function": "relu"}, "activation_function='relu' is not supported"),
    (LLAMA, {"hidden_size": 48}, "has shape [99, 32], but config.json implies [99, 48]"),
    (LLAMA, {"num_hidden_layers": 3}, "model.safetensors: no tensor 'model.layers.2.input_layernorm.weight'"),
    (LLAMA, {"num_hidden_layers": 1}, "tensors are not part of the architecture"),
    (LLAMA, {"tie_word_embeddings": True, "num_hidden_layers": "two"},
     "num_hidden_layers='two' is not supported; zeroflow supports a int"),
])
def test_what_zeroflow_cannot_run_is_one_clear_line(spec, changes, needle, tmp_path):
    save_hf(spec, tmp_path)
    _edit_config(tmp_path, **changes)
    with pytest.raises(ValueError) as info:
        hf.from_pretrained(tmp_path)
    message = str(info.value)
    assert needle in message and "\n" not in message and str(tmp_path) in message


def test_bad_arguments_and_inputs_are_one_line(tmp_path):
    with pytest.raises(ValueError, match=r"no Hugging Face config at .*nowhere"):
        hf.from_pretrained(tmp_path / "nowhere")
    save_hf(LLAMA, tmp_path / "m")
    with pytest.raises(ValueError, match=r"dtype='fp8'; choose one of \['fp32', 'bf16', 'fp16'\]"):
        hf.from_pretrained(tmp_path / "m", dtype="fp8")
    with pytest.raises(ValueError, match="no tokenizer.json at"):
        hf.load_tokenizer(tmp_path / "m")
    (tmp_path / "m" / "model.safetensors").rename(tmp_path / "m" / "weights.bin")
    with pytest.raises(ValueError, match=r"has no \*.safetensors weights"):
        hf.from_pretrained(tmp_path / "m")
    # A model a Qwen2 checkpoint cannot hold is refused, not written wrongly.
    save_hf(QWEN2, tmp_path / "q")
    model, params, cfg = hf.from_pretrained(tmp_path / "q")
    import dataclasses
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, attn_bias="all"))
    with pytest.raises(ValueError, match=r"Qwen2ForCausalLM cannot express model.attn_bias='all'"):
        hf.save_pretrained(model.clone(cfg=cfg.model), params, cfg, tmp_path / "out")


def test_bare_gpt2_keys_without_the_transformer_prefix(tmp_path):
    """The original GPT-2 files name tensors 'h.0.attn.c_attn.weight' and carry the causal
    mask buffer 'h.0.attn.bias'; both load."""
    model = save_hf(GPT2, tmp_path)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    bare = {k.removeprefix("transformer."): v for k, v in tensors.items()}
    bare["h.0.attn.bias"] = np.tril(np.ones((1, 1, 32, 32), np.float32))
    save_file(bare, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    ours_model, params, _ = hf.from_pretrained(tmp_path)
    tokens = torch.randint(0, 101, (1, 9))
    with torch.no_grad():
        theirs = model(tokens).logits.numpy()
    ours = np.asarray(ours_model.apply({"params": params}, jnp.asarray(tokens.numpy(), jnp.int32)))
    np.testing.assert_allclose(ours, theirs, atol=1e-4, rtol=0)


def test_offloaded_plan_loads_straight_into_pinned_host_memory(tmp_path):
    save_hf(LLAMA, tmp_path)
    plan = zf.ZeroPlan(zf.make_mesh(data=8), stage=3, offload="optimizer", update_on="host")
    _, params, _ = hf.from_pretrained(tmp_path, plan=plan)
    reference = hf.load_params(tmp_path, hf.read_config(tmp_path).model)
    for leaf, whole in zip(jax.tree.leaves(params), jax.tree.leaves(reference)):
        assert leaf.sharding.memory_kind == "pinned_host"
        np.testing.assert_array_equal(np.asarray(leaf), np.asarray(whole))


def test_llama_3_1_8b_config_has_its_published_parameter_count():
    """configs/hf/llama-3.1-8b/config.json (what docs/hf.md plans with) is read into a model of
    exactly Llama 3.1 8B's 8,030,261,248 parameters."""
    from pathlib import Path

    from zeroflow.memory import count_gpt_params
    cfg = hf.read_config(Path(__file__).resolve().parents[1] / "configs/hf/llama-3.1-8b")
    assert cfg.model.rope_scaling == "llama3" and cfg.model.num_kv_heads == 8
    assert count_gpt_params(cfg.model) == 8_030_261_248
