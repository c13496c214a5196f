"""zeroflow.hf.load_encoder: CLIP's vision tower and BERT read from folders transformers saved
(tiny random weights, nothing downloaded) give transformers' outputs within 1e-4."""
import numpy as np
import pytest

pytestmark = pytest.mark.fast

torch = pytest.importorskip("torch", reason="the reference is transformers on torch")
transformers = pytest.importorskip("transformers", reason="the reference is transformers on torch")

import jax  # noqa: E402

from zeroflow import hf  # noqa: E402
from zeroflow.hf.reader import HFCheckpointError  # noqa: E402


def _save(model, folder):
    model.eval().save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def vision_dir(tmp_path_factory):
    torch.manual_seed(0)
    cfg = transformers.CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, image_size=16, patch_size=4)
    model = transformers.CLIPVisionModel(cfg)
    with torch.no_grad():  # random layer norms, so a swapped scale/bias shows
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.3 * torch.randn_like(p))
    return model, _save(model, tmp_path_factory.mktemp("clip-vision"))


@pytest.fixture(scope="module")
def text_dir(tmp_path_factory):
    torch.manual_seed(1)
    cfg = transformers.BertConfig(vocab_size=60, hidden_size=32, intermediate_size=64,
                                  num_hidden_layers=2, num_attention_heads=4,
                                  max_position_embeddings=16)
    model = transformers.BertModel(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "LayerNorm" in name:
                p.add_(0.3 * torch.randn_like(p))
    return model, _save(model, tmp_path_factory.mktemp("bert"))


def test_clip_vision_matches_transformers(vision_dir):
    reference, folder = vision_dir
    pixels = np.random.default_rng(0).normal(size=(3, 3, 16, 16)).astype(np.float32)
    with torch.no_grad():
        theirs = reference(pixel_values=torch.tensor(pixels))
    module, params, cfg = hf.load_encoder(folder)
    ours = jax.jit(module.apply)({"params": params}, pixels)
    assert cfg.architecture == "CLIPVisionModel" and cfg.encoder.num_patches == 16
    np.testing.assert_allclose(ours["hidden"], theirs.last_hidden_state.numpy(), atol=1e-4)
    np.testing.assert_allclose(ours["pooled"], theirs.pooler_output.numpy(), atol=1e-4)


def test_bert_matches_transformers_with_padding(text_dir):
    reference, folder = text_dir
    rng = np.random.default_rng(1)
    ids = rng.integers(1, 60, size=(3, 12)).astype(np.int32)
    mask = np.ones_like(ids)
    mask[1, 7:] = 0
    mask[2, 3:] = 0
    with torch.no_grad():
        theirs = reference(input_ids=torch.tensor(ids, dtype=torch.long),
                           attention_mask=torch.tensor(mask)).last_hidden_state.numpy()
    module, params, cfg = hf.load_encoder(folder)
    ours = np.asarray(jax.jit(module.apply)({"params": params}, ids, mask)["hidden"])
    real = mask.astype(bool)  # padded positions' states are not used by either side
    np.testing.assert_allclose(ours[real], theirs[real], atol=1e-4)
    assert cfg.architecture == "BertModel" and cfg.encoder.modality == "text"


def test_bf16_encoder_is_close(vision_dir):
    _, folder = vision_dir
    pixels = np.random.default_rng(2).normal(size=(2, 3, 16, 16)).astype(np.float32)
    fp32, p32, _ = hf.load_encoder(folder)
    bf16, p16, _ = hf.load_encoder(folder, dtype="bf16")
    a = np.asarray(fp32.apply({"params": p32}, pixels)["pooled"])
    b = np.asarray(bf16.apply({"params": p16}, pixels)["pooled"], np.float32)
    assert np.abs(a - b).max() < 0.1 * np.abs(a).max()


def test_unsupported_encoder_is_one_line(tmp_path, text_dir):
    _, folder = text_dir
    bad = tmp_path / "relative"
    bad.mkdir()
    raw = (folder / "config.json").read_text().replace('"model_type"',
                                                        '"position_embedding_type": "relative_key", "model_type"')
    (bad / "config.json").write_text(raw)
    with pytest.raises(HFCheckpointError, match="position_embedding_type='relative_key'"):
        hf.load_encoder(bad)
