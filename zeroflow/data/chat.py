"""Chat templates: a tokenizer folder's own Jinja template, rendered as transformers renders it.

The template comes from ``chat_template.jinja`` in the tokenizer's folder, else from
``tokenizer_config.json``'s ``chat_template`` (a string, or a list of named templates of which
``default`` is used). It is rendered in a sandboxed ``jinja2`` environment with the settings
and globals transformers' ``apply_chat_template`` uses (``trim_blocks``, ``lstrip_blocks``,
loop controls, ``raise_exception``, ``strftime_now``, a ``tojson`` that keeps non-ASCII text),
with the special tokens of ``tokenizer_config.json`` (``bos_token``, ``eos_token``, ...) and
``add_generation_prompt`` as variables, so the same conversation gives the same text, and
tokenized without added special tokens, the same ids.

``{% generation %} ... {% endgeneration %}`` marks text the model is trained to produce
(the assistant's turns). Rendering records where each marked piece lands in the output; the
tokens whose characters fall in those spans form the assistant mask, as transformers'
``return_assistant_tokens_mask=True`` computes it.
"""

from __future__ import annotations

import datetime
import functools
import json
import os
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from zeroflow.data.tokenizers import CHAT_TEMPLATE_FILE as TEMPLATE_FILE

_GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")


@functools.cache
def _generation_extension():
    """The jinja2 extension class for ``{% generation %}``: made lazily, jinja2 is imported
    only by runs that use a chat template."""
    from jinja2 import nodes
    from jinja2.ext import Extension

    class GenerationSpans(Extension):
        tags = {"generation"}

        def __init__(self, environment) -> None:
            super().__init__(environment)
            self.emitted: list[str] | None = None
            "The output pieces rendered so far; set while a render tracks spans."
            self.spans: list[tuple[int, int]] = []

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.CallBlock(self.call_method("_marked", []), [], [], body).set_lineno(lineno)

        def _marked(self, caller) -> str:
            text = caller()
            # The block's text is emitted right after everything already in self.emitted.
            if self.emitted is not None and text:
                start = sum(map(len, self.emitted))
                self.spans.append((start, start + len(text)))
            return text

    return GenerationSpans


def _raise_exception(message):
    from jinja2.exceptions import TemplateError

    raise TemplateError(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


class ChatTemplate:
    """``render(messages)`` -> (text, assistant character spans)."""

    def __init__(self, source: str, variables: dict[str, Any] | None = None, name: str = ""):
        from jinja2 import TemplateSyntaxError
        from jinja2.ext import loopcontrols
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        self.source = source
        self.name = name
        self.variables = dict(variables or {})
        "Passed to every render: the tokenizer's special tokens (bos_token, eos_token, ...)."
        self.marks_generation = bool(_GENERATION_TAG.search(source))
        spans_extension = _generation_extension()
        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=[spans_extension, loopcontrols]
        )
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
        self._tracker = next(e for e in env.extensions.values() if isinstance(e, spans_extension))
        try:
            self._template = env.from_string(source)
        except TemplateSyntaxError as e:
            raise ValueError(f"chat template {name}: line {e.lineno}: {e.message}") from None

    def render(
        self, messages: Sequence[dict], *, add_generation_prompt: bool = False
    ) -> tuple[str, list[tuple[int, int]]]:
        """The conversation's text and the [start, end) character spans of its
        ``{% generation %}`` blocks. Keys whose value is None are dropped from each message
        first (as transformers does: templates test for a key, not for None)."""
        messages = [{k: v for k, v in m.items() if v is not None} for m in messages]
        pieces: list[str] = []
        self._tracker.emitted, self._tracker.spans = pieces, []
        try:
            for piece in self._template.generate(
                messages=messages, add_generation_prompt=add_generation_prompt, **self.variables
            ):
                pieces.append(piece)
            return "".join(pieces), list(self._tracker.spans)
        finally:
            self._tracker.emitted, self._tracker.spans = None, []


def special_tokens(config: dict) -> dict[str, str]:
    """``bos_token``, ``eos_token``, ... of a tokenizer_config.json, as strings."""
    found = {}
    for key, value in config.items():
        if key.endswith("_token") and isinstance(value, (str, dict)):
            content = value.get("content") if isinstance(value, dict) else value
            if isinstance(content, str):
                found[key] = content
    return found


def load_chat_template(folder: str | os.PathLike) -> ChatTemplate | None:
    """The chat template of a tokenizer folder, or None when it has none."""
    folder = Path(folder)
    config_path = folder / "tokenizer_config.json"
    config: dict = {}
    if config_path.is_file():
        try:
            config = json.loads(config_path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as e:
            raise ValueError(f"cannot read {config_path}: {e}") from None
    source = None
    if (folder / TEMPLATE_FILE).is_file():
        source, name = (folder / TEMPLATE_FILE).read_text(encoding="utf-8"), folder / TEMPLATE_FILE
    else:
        source, name = config.get("chat_template"), config_path
        if isinstance(source, list):  # named templates: [{"name": ..., "template": ...}]
            named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
            source = named.get("default")
    if not isinstance(source, str) or not source:
        return None
    return ChatTemplate(source, special_tokens(config), name=os.fspath(name))


def assistant_mask(encoding, spans: Sequence[tuple[int, int]], num_tokens: int) -> np.ndarray:
    """Bool [num_tokens]: tokens from the one holding a span's first character to the one
    holding its last (a ``tokenizers`` Encoding maps characters to tokens)."""
    mask = np.zeros(num_tokens, bool)
    for start, end in spans:
        first = encoding.char_to_token(start)
        if first is None:  # the span starts past the encoded text
            break
        last = encoding.char_to_token(end - 1)
        mask[first : num_tokens if last is None else last + 1] = True
    return mask
