"""The FuseMix CPU demo's two tiny encoders, made here with transformers (nothing downloaded).

- vision: a randomly initialised ``CLIPVisionModel`` (32x32 images in 8x8 patches);
- text: a randomly initialised ``BertModel`` with a word-level ``tokenizer.json`` over the
  digits captions' words (``digits.vocabulary``), built with the ``tokenizers`` library;

each written as transformers saves a published checkpoint (2 layers, 4 heads, width 64 by
default). torch's generator is seeded once and both models are built in that order whichever
of them is written, so the same seed always gives the same two encoders. configs/fusemix.yaml
(``fusemix.tiny_encoders: true``) makes the missing ones when it starts;
``python scripts/make_tiny_encoders.py --out DIR`` writes both to ``DIR/vision`` and
``DIR/text``.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from zeroflow.fusemix.digits import CLS, PAD, SEP, UNK, vocabulary

EXTRA = 'pip install -e ".[hf,fusemix]"'
"The install that brings torch and transformers (the hf extra) and the digits (fusemix)."


def holds_model(folder: str | os.PathLike) -> bool:
    """Whether ``folder`` holds a Hugging Face model (its ``config.json``)."""
    return (Path(folder) / "config.json").is_file()


def can_write(folder: str | os.PathLike) -> bool:
    """Whether a tiny encoder may be written to ``folder``: it does not exist or is empty."""
    path = Path(folder)
    return not path.exists() or (path.is_dir() and not any(path.iterdir()))


class MissingLibraries(RuntimeError):
    """torch or transformers is not installed; the message names the install that brings them."""


def _libraries():
    """torch and transformers, or ``MissingLibraries`` naming the extra that installs them."""
    try:
        import torch
        import transformers
    except ImportError as e:
        raise MissingLibraries(
            f"the tiny encoders are made with torch and transformers ({e}): {EXTRA}"
        ) from None
    return torch, transformers


def write_tokenizer(folder: Path) -> int:
    """The captions' word-level ``tokenizer.json`` in ``folder``; returns its vocabulary size."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    vocab = {word: i for i, word in enumerate(vocabulary())}
    tok = Tokenizer(models.WordLevel(vocab, unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(
        single=f"{CLS} $A {SEP}", special_tokens=[(CLS, vocab[CLS]), (SEP, vocab[SEP])]
    )
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    return len(vocab)


def _save(model, folder: Path, tokenizer: bool) -> None:
    """``model`` (and the tokenizer) saved to a sibling folder first, renamed into place once
    whole: a run stopped while writing leaves no half model where the config looks."""
    partial = folder.with_name(folder.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    if tokenizer:
        write_tokenizer(partial)
    model.eval().save_pretrained(partial)
    if holds_model(folder):
        shutil.rmtree(folder)  # a model written before (``make``'s caller allowed replacing it)
    elif folder.exists():
        folder.rmdir()  # empty: a folder holding anything but a model is never replaced
    partial.rename(folder)


def make(
    vision: str | os.PathLike | None,
    text: str | os.PathLike | None,
    *,
    width: int = 64,
    seed: int = 0,
) -> list[Path]:
    """Write the vision encoder to ``vision`` and the text encoder to ``text`` (either may be
    None: not written), each a new or empty folder or one holding a model (replaced); returns
    the folders written."""
    for folder in (vision, text):
        if folder is not None and not (can_write(folder) or holds_model(folder)):
            raise FileExistsError(f"{folder} holds files but no model: not replaced")
    torch, transformers = _libraries()
    torch.manual_seed(seed)
    vision_model = transformers.CLIPVisionModel(
        transformers.CLIPVisionConfig(
            hidden_size=width,
            intermediate_size=4 * width,
            num_hidden_layers=2,
            num_attention_heads=4,
            image_size=32,
            patch_size=8,
        )
    )
    text_model = transformers.BertModel(
        transformers.BertConfig(
            vocab_size=len(vocabulary()),
            hidden_size=width,
            intermediate_size=4 * width,
            num_hidden_layers=2,
            num_attention_heads=4,
            max_position_embeddings=32,
            pad_token_id=vocabulary().index(PAD),
        )
    )
    progress = transformers.utils.logging
    was_shown = progress.is_progress_bar_enabled()
    progress.disable_progress_bar()  # a bar per one-file save: noise above the run's lines
    try:
        return _write(vision_model, vision, text_model, text)
    finally:
        if was_shown:
            progress.enable_progress_bar()


def _write(vision_model, vision, text_model, text) -> list[Path]:
    written = []
    if vision is not None:
        Path(vision).parent.mkdir(parents=True, exist_ok=True)
        _save(vision_model, Path(vision), tokenizer=False)
        written.append(Path(vision))
    if text is not None:
        Path(text).parent.mkdir(parents=True, exist_ok=True)
        _save(text_model, Path(text), tokenizer=True)
        written.append(Path(text))
    return written
