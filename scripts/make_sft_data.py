"""Build a small instruction set from real text: questions about Python standard-library
functions, answered by the first paragraph of their own docstrings.

    python scripts/make_sft_data.py --out runs/sft-data/stdlib-qa.jsonl

Nothing is downloaded: the running interpreter's modules are imported and inspected. Each
line of the output is one conversation in the ``chat`` format::

    {"messages": [{"role": "user", "content": "What does textwrap.dedent do?"},
                  {"role": "assistant", "content": "Remove any common leading whitespace ..."}]}

The output is the same on every run with the same Python (functions are sorted, and the
question wording is picked by a hash of the function's name). configs/sft-llama.yaml
fine-tunes the tiny Llama of scripts/make_tiny_hf.py on it.
"""
from __future__ import annotations

import argparse
import builtins
import hashlib
import importlib
import inspect
import json
import sys
import warnings
from collections.abc import Iterator, Sequence
from pathlib import Path

MODULES = (
    "abc", "argparse", "array", "ast", "asyncio", "base64", "bisect", "calendar", "cmath",
    "codecs", "collections", "colorsys", "contextlib", "copy", "csv", "dataclasses", "datetime",
    "decimal", "difflib", "enum", "filecmp", "fnmatch", "fractions", "functools", "gc", "getpass",
    "glob", "gzip", "hashlib", "heapq", "hmac", "html", "http.client", "imaplib", "inspect",
    "io", "ipaddress", "itertools", "json", "keyword", "linecache", "locale", "logging", "lzma",
    "math", "mimetypes", "operator", "os", "os.path", "pathlib", "pickle", "pkgutil",
    "platform", "pprint", "queue", "quopri", "random", "re", "reprlib", "sched", "secrets",
    "select", "shelve", "shlex", "shutil", "signal", "smtplib", "socket", "sqlite3", "stat",
    "statistics", "string", "struct", "subprocess", "sys", "sysconfig", "tarfile", "tempfile",
    "textwrap", "threading", "time", "timeit", "tokenize", "traceback", "types", "typing",
    "unicodedata", "urllib.parse", "urllib.request", "uuid", "warnings", "weakref", "xml.dom",
    "zipfile", "zlib",
)
QUESTIONS = (
    "What does {name} do?",
    "Explain {name} in Python.",
    "What is {name} for?",
    "Describe the Python function {name}.",
)


def _first_paragraph(doc: str) -> str:
    """The docstring's first paragraph on one line; a leading signature line is dropped."""
    paragraphs = [p for p in inspect.cleandoc(doc).split("\n\n") if p.strip()]
    while paragraphs and "(" in paragraphs[0].splitlines()[0] and paragraphs[0].rstrip().endswith(")") \
            and len(paragraphs[0].splitlines()) == 1:
        paragraphs = paragraphs[1:]  # C functions start with "name(args)"
    return " ".join(paragraphs[0].split()) if paragraphs else ""


def _answer(text: str, max_chars: int) -> str:
    """``text`` cut after its last full sentence within ``max_chars``."""
    if len(text) <= max_chars:
        return text
    cut = text.rfind(". ", 0, max_chars)
    return text[:cut + 1] if cut > 0 else ""


TYPES = ("bytes", "dict", "float", "int", "list", "set", "str")
"Built-in types whose methods are asked about too (str.split, dict.get, ...)."


def _functions(module_name: str) -> Iterator[tuple[str, object]]:
    if module_name in TYPES:
        owner = getattr(builtins, module_name)
        for attr in sorted(vars(owner)):
            value = getattr(owner, attr)
            if not attr.startswith("_") and getattr(value, "__doc__", None):
                yield f"{module_name}.{attr}", value
        return
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            module = importlib.import_module(module_name)
    except Exception:  # noqa: BLE001  a module this interpreter was built without
        return
    for attr in sorted(dir(module)):
        if attr.startswith("_"):
            continue
        value = getattr(module, attr, None)
        if inspect.isroutine(value) and getattr(value, "__doc__", None):
            yield (attr if module_name == "builtins" else f"{module_name}.{attr}"), value


def _pick(name: str, choices: Sequence[str]) -> str:
    digest = hashlib.blake2b(name.encode(), digest_size=4).digest()
    return choices[int.from_bytes(digest, "big") % len(choices)]


def conversations(*, min_chars: int = 30, max_chars: int = 300) -> Iterator[dict]:
    """One conversation per documented public function of ``MODULES``."""
    seen = set()
    for module_name in ("builtins", *TYPES, *MODULES):
        for name, function in _functions(module_name):
            answer = _answer(_first_paragraph(function.__doc__), max_chars)
            if len(answer) < min_chars or answer in seen:
                continue
            seen.add(answer)
            question = _pick(name, QUESTIONS).format(name=name)
            yield {"messages": [{"role": "user", "content": question},
                                {"role": "assistant", "content": answer}]}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="runs/sft-data/stdlib-qa.jsonl", help="output .jsonl")
    parser.add_argument("--max-chars", type=int, default=300,
                        help="longest answer in characters (default 300)")
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    count = 0
    with open(out, "w", encoding="utf-8") as f:
        for conversation in conversations(max_chars=args.max_chars):
            f.write(json.dumps(conversation, ensure_ascii=False) + "\n")
            count += 1
    print(f"wrote {count} conversations to {out}; fine-tune with "
          f"python -m zeroflow.train --config configs/sft-llama.yaml")
    return 0


if __name__ == "__main__":
    sys.exit(main())
