"""A tokenizer checked against the model it feeds: ids the embedding has no row for would
index past it (jax clamps out-of-range gathers, so training would run on wrong rows instead
of failing)."""

from __future__ import annotations

import os

from zeroflow.hf.architectures import config_file
from zeroflow.hf.reader import HFCheckpointError


def check_tokenizer(tokenizer, model_vocab: int, checkpoint: str | os.PathLike, setting: str = ""):
    """HFCheckpointError, in one line naming the tokenizer's file and config.json's
    ``vocab_size``, when ``tokenizer`` (anything with ``vocab_size`` and ``name``, as
    ``load_tokenizer`` gives) has more tokens than ``checkpoint``'s embedding has rows.
    ``setting``: the config key that named the tokenizer (e.g. 'data.tokenizer')."""
    if tokenizer.vocab_size <= model_vocab:
        return
    named = f"{setting} " if setting else ""
    raise HFCheckpointError(
        f"{named}{getattr(tokenizer, 'name', tokenizer)}: the tokenizer has "
        f"{tokenizer.vocab_size} tokens, but {config_file(checkpoint)} vocab_size={model_vocab} "
        "(the model's embedding rows); use the model's own tokenizer"
    )
