"""Records -> training examples: token ids and which of them the loss trains on.

``data.format`` says how a record becomes text:

- ``text``: the ``data.text_field`` string, then the end-of-document token; every token trains.
- ``prompt_completion``: the prompt (with the tokenizer's own added tokens, e.g. Llama's
  begin-of-text), then the completion and the end-of-document token. The two are tokenized
  apart, so no token straddles them; ``data.train_on=completion`` trains on the completion
  and end-of-document tokens only.
- ``chat``: ``data.messages_field``, a list of ``{"role", "content"}`` messages, rendered with
  the tokenizer's chat template (``zeroflow.data.chat``) and tokenized without added tokens,
  as transformers' ``apply_chat_template`` does; ``data.train_on=completion`` trains on the
  tokens the template marks with ``{% generation %}`` (the assistant's turns).

An example of n tokens gives n - 1 (input, target) pairs; it must fit in ``seq_len``. A record
that cannot be used raises ``BadRecord`` with a short kind (counted) and a detail.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, cast

import numpy as np

from zeroflow.config.schema import DataConfig
from zeroflow.data.chat import ChatTemplate, assistant_mask, load_chat_template
from zeroflow.data.tokenizers import HFTokenizer, Tokenizer

SEPARATOR = "\n"
"Ends a document when the tokenizer has no end-of-document token (as the stream format)."


class BadRecord(ValueError):
    """A record that cannot become an example: ``kind`` is what is counted."""

    def __init__(self, kind: str, detail: str = ""):
        super().__init__(f"{kind} ({detail})" if detail else kind)
        self.kind, self.detail = kind, detail


class TemplateFailed(ValueError):
    """The chat template itself raised (not its ``raise_exception``): the run stops, naming
    the template file, the record and the error."""

    def __init__(self, template: str, error: Exception):
        first = (str(error).splitlines() or [""])[0]
        super().__init__(f"chat template {template} raised {type(error).__name__}: {first}")
        self.template, self.error = template, error


@dataclasses.dataclass(frozen=True)
class Encoded:
    tokens: np.ndarray
    "int32 [n]: the whole example."
    trained: np.ndarray
    "bool [n]: tokens the loss is computed on (as targets)."
    num_bytes: int
    "UTF-8 bytes of the text the tokens stand for."


def _present(record: Any, field: str):
    """``record[field]``, or a BadRecord saying why there is none."""
    if not isinstance(record, dict):
        raise BadRecord("not a JSON object", type(record).__name__)
    if field not in record or record[field] is None:
        raise BadRecord(f"missing field '{field}'")
    return record[field]


def _string_field(record: Any, field: str, *, allow_empty: bool = False) -> str:
    value = _present(record, field)
    if not isinstance(value, str):
        raise BadRecord(f"field '{field}' is not a string", type(value).__name__)
    if not value and not allow_empty:
        raise BadRecord(f"field '{field}' is empty")
    return value


def _plain_ids(tokenizer: Tokenizer, text: str) -> list[int]:
    """Token ids of ``text`` without the tokenizer's added tokens (a Hugging Face tokenizer's
    begin-of-text); byte and SentencePiece tokenizers add none."""
    if isinstance(tokenizer, HFTokenizer):
        return tokenizer.backend.encode(text, add_special_tokens=False).ids
    return tokenizer.encode(text)


def _end_ids(tokenizer: Tokenizer) -> list[int]:
    eos = getattr(tokenizer, "eos_id", None)
    return [eos] if eos is not None else _plain_ids(tokenizer, SEPARATOR)


def _encoded(ids, trained, num_bytes: int) -> Encoded:
    return Encoded(np.asarray(ids, np.int32), np.asarray(trained, bool), num_bytes)


def _text(record, cfg: DataConfig, tokenizer: Tokenizer) -> Encoded:
    text = _string_field(record, cfg.text_field)
    ids = list(tokenizer.encode(text)) + _end_ids(tokenizer)
    return _encoded(ids, np.ones(len(ids), bool), len(text.encode("utf-8")))


def _prompt_completion(record, cfg: DataConfig, tokenizer: Tokenizer) -> Encoded:
    prompt = _string_field(record, cfg.prompt_field, allow_empty=True)
    completion = _string_field(record, cfg.completion_field)
    head = list(tokenizer.encode(prompt)) if prompt else []
    tail = _plain_ids(tokenizer, completion) + _end_ids(tokenizer)
    trained = [cfg.train_on == "all"] * len(head) + [True] * len(tail)
    return _encoded(head + tail, trained, len((prompt + completion).encode("utf-8")))


def _messages(record, field: str) -> list[dict]:
    messages = _present(record, field)
    if not isinstance(messages, list):
        raise BadRecord(f"field '{field}' is not a list", type(messages).__name__)
    if not messages:
        raise BadRecord("empty conversation")
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise BadRecord("message is not an object", f"message {i}")
        for key in ("role", "content"):
            if not isinstance(message.get(key), str):
                raise BadRecord(f"message without a string '{key}'", f"message {i}")
    return messages


def _chat(record, cfg: DataConfig, tokenizer: HFTokenizer, template: ChatTemplate) -> Encoded:
    from jinja2.exceptions import TemplateError

    messages = _messages(record, cfg.messages_field)
    try:
        text, spans = template.render(messages)
    except TemplateError as e:  # the template's own raise_exception: e.g. roles must alternate
        raise BadRecord("rejected by the chat template", str(e).splitlines()[0]) from None
    except Exception as e:
        raise TemplateFailed(template.name, e) from None
    encoding = tokenizer.backend.encode(text, add_special_tokens=False)
    ids = encoding.ids
    if cfg.train_on == "all":
        trained = np.ones(len(ids), bool)
    else:
        trained = assistant_mask(encoding, spans, len(ids))
    return _encoded(ids, trained, len(text.encode("utf-8")))


def chat_template_for(cfg: DataConfig, tokenizer: Tokenizer) -> ChatTemplate:
    """The tokenizer folder's chat template, checked against ``cfg`` (one-line errors)."""
    if not isinstance(tokenizer, HFTokenizer):
        raise ValueError(
            f"data.format=chat needs a Hugging Face tokenizer folder with a chat "
            f"template as data.tokenizer; got {cfg.tokenizer!r}"
        )
    folder = tokenizer.folder
    template = load_chat_template(folder)
    if template is None:
        raise ValueError(
            f"data.format=chat: {folder} has no chat template (chat_template.jinja "
            "or tokenizer_config.json's chat_template)"
        )
    if cfg.train_on == "completion" and not template.marks_generation:
        raise ValueError(
            f"data.train_on=completion needs a chat template that marks the "
            f"assistant's text with {{% generation %}}; {template.name} does not "
            "(use data.train_on=all, or add the markers)"
        )
    return template


def example_encoder(
    cfg: DataConfig, tokenizer: Tokenizer, seq_len: int
) -> Callable[[Any], Encoded]:
    """``record -> Encoded`` for ``cfg.format``; raises BadRecord for a record it cannot use."""
    if cfg.format == "text":
        encode = lambda r: _text(r, cfg, tokenizer)  # noqa: E731
    elif cfg.format == "prompt_completion":
        encode = lambda r: _prompt_completion(r, cfg, tokenizer)  # noqa: E731
    elif cfg.format == "chat":
        template = chat_template_for(cfg, tokenizer)
        hf_tokenizer = cast(HFTokenizer, tokenizer)  # chat_template_for raised unless it is one
        encode = lambda r: _chat(r, cfg, hf_tokenizer, template)  # noqa: E731
    else:
        raise ValueError(f"data.format={cfg.format!r} is not a records format")

    def checked(record) -> Encoded:
        example = encode(record)
        n = len(example.tokens)
        if n - 1 > seq_len:
            raise BadRecord(
                "longer than seq_len", f"{n} tokens, at most seq_len + 1 = {seq_len + 1} fit"
            )
        if n < 2:
            raise BadRecord("fewer than 2 tokens")
        if not example.trained[1:].any():
            raise BadRecord("no tokens to train on", "no completion or assistant turn")
        return example

    return checked


def training_pairs(example: Encoded) -> dict[str, np.ndarray]:
    """The example as aligned (input, target, weight) arrays of n - 1 entries."""
    return {
        "inputs": example.tokens[:-1],
        "targets": example.tokens[1:],
        "weights": example.trained[1:].astype(np.int32),
    }
