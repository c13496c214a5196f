"""Every command the docs show a user (docs/*.md, README.md, the header comments of configs/*.yaml
and the docstrings of scripts/, experiments/ and zeroflow/cli/) is checked without running its
work: the program exists, its own argument parser accepts the arguments as written, ``--config``
files exist and ``key=value`` overrides are keys of that config, and the files it reads exist or
are made by another documented command. One case per command, named by file and line, so a
renamed flag, key, file or script fails naming the place a newcomer would copy it from.

"The parser the command itself uses" is reached by starting the program as ``python`` would
(``runpy``) with ``parse_args`` stopped right after it parses: no refactor can make the test
check a different parser than the one a user meets."""

import argparse
import ast
import contextlib
import io
import os
import re
import runpy
import shlex
import subprocess
import sys

import pytest
from helpers import REPO

PROGRAM = re.compile(r"\bpython (-m zeroflow\.[\w.]+|(?:scripts|experiments)/\w+\.py)\b")
# Words the docs use for "your value here": parsed as written where argparse accepts any string,
# never looked up as files.
PLACEHOLDER = re.compile(r"^([A-Z][A-Z_]*|\$OUT)(/|$)|<|^/path/to/|^~")
# Placeholders that stand for a number, where the flag takes one.
NUMBERS = {"N": "2", "P": "2", "D": "2"}
# Flags whose value is a file or folder the command reads.
INPUT_FLAGS = ("--config", "--run", "--render", "--input", "--tokenizer")
# Inputs no documented command makes, with why they may be absent from a fresh clone.
NOT_IN_CLONE = {
    "stdlib": "not a file: prepare_data.py's name for the Python standard library's sources",
    "sentencepiece": "not a file: prepare_data.py's word for training a SentencePiece model",
    "run1/results.jsonl": "gpu_report.py's usage: the results of an earlier --out run1 call",
    "run2/results.jsonl": "gpu_report.py's usage: the results of an earlier --out run2 call",
}
# Config keys that name files or folders a run reads.
CONFIG_INPUTS = (
    "model.init_from",
    "data.tokenizer",
    "data.source",
    "fusemix.image_encoder",
    "fusemix.text_encoder",
)
# What argparse says when a span names a program and some of its flags but not a whole command
# (``--target`` in a sentence): accepted for inline code only, its flags still checked.
FRAGMENT = ("the following arguments are required", "expected one argument")


def _fenced_lines(text: str):
    """(line number, command) for each line of each fenced block, continuations joined."""
    for block in re.finditer(r"^```[^\n]*\n(.*?)^```", text, re.S | re.M):
        first = text.count("\n", 0, block.start(1)) + 1
        yield from _joined_lines(block.group(1), first)


def _joined_lines(text: str, first: int):
    start, buf = None, ""
    for offset, line in enumerate(text.split("\n")):
        start = first + offset if start is None else start
        if line.rstrip().endswith("\\"):
            buf += line.rstrip()[:-1] + " "
            continue
        yield start, buf + line
        start, buf = None, ""


def _inline_spans(text: str):
    """(line number, text) of each `inline code` span outside fenced blocks."""
    blank = re.sub(
        r"^```.*?^```", lambda m: re.sub(r"[^\n]", " ", m.group(0)), text, flags=re.S | re.M
    )
    for span in re.finditer(r"(?<!`)`([^`]+)`(?!`)", blank):
        yield (
            blank.count("\n", 0, span.start()) + 1,
            " ".join(span.group(1).replace("\\\n", " ").split()),
        )


def _markdown_sources():
    for doc in [*sorted((REPO / "docs").glob("*.md")), REPO / "README.md"]:
        text = doc.read_text()
        for line, span in [*_fenced_lines(text), *_inline_spans(text)]:
            yield doc, line, span


def _comment_sources():
    """Header comments of the configs and module docstrings of the programs, line by line."""
    for config in sorted((REPO / "configs").glob("*.yaml")):
        lines = config.read_text().split("\n")
        header = "\n".join(line.lstrip("# ") for line in lines if line.startswith("#"))
        yield from ((config, n, s.split("`")[0]) for n, s in _joined_lines(header, 1))
    for path in sorted(
        [
            *(REPO / "scripts").glob("*.py"),
            *(REPO / "experiments").glob("*.py"),
            *(REPO / "zeroflow" / "cli").glob("*.py"),
        ]
    ):
        tree = ast.parse(path.read_text())
        doc = ast.get_docstring(tree, clean=False)
        if doc:
            first = tree.body[0].lineno
            yield from (
                (path, n, s.replace("``", "`").split("`")[0])
                for n, s in _joined_lines(doc, first)
                for s in [s[s.find("python") :] if "python" in s else s]
            )


def _words(fragment: str) -> list[str]:
    """The words of one documented command, optional parts ([...]) taken as given, placeholders
    for repeated items (``...``, ``key=value``, ``$(cat FILE)``) dropped."""
    fragment = re.sub(r"\$\([^)]*\)", "", fragment)
    fragment = re.sub(r"\{([^,}]+),[^}]*\}", r"\1", fragment)  # {2,3} -> 2
    fragment = re.sub(r"(^|\s)\[([^\]]*)\]", r"\1\2", fragment)
    try:
        words = shlex.split(fragment)
    except ValueError:  # a quote the span cut off: the span is not a whole command
        return []
    for end, word in enumerate(words):
        if word in ("&&", "||", ";", "|", "#") or word.startswith(("#", "(")):
            words = words[:end]
            break
        if word.endswith((",", ";", ")")):  # the sentence around the command goes on
            words = [*words[:end], word[:-1]]
            break
    return [
        NUMBERS.get(w, w)
        for w in words
        if w != "..." and not re.fullmatch(r"(section\.)?key=value", w)
    ]


def _commands() -> list[tuple[str, list[str], bool]]:
    """(id, argv from the program on, whether it is shown as a whole command: a fenced block or
    a usage line, not a program named in a sentence)."""
    found: dict[tuple[str, str], tuple[str, list[str], bool]] = {}
    fenced_ids = set()
    for doc in [*sorted((REPO / "docs").glob("*.md")), REPO / "README.md"]:
        fenced_ids.update((doc, n) for n, _ in _fenced_lines(doc.read_text()))
    for where, line, span in [*_markdown_sources(), *_comment_sources()]:
        for match in PROGRAM.finditer(span):
            rest = span[match.start() :]
            nested = PROGRAM.search(rest, match.end() - match.start())
            words = _words(rest[: nested.start()] if nested else rest)
            if len(words) < 2:
                continue
            name = f"{where.relative_to(REPO)}:{line}"
            key = (name, " ".join(words))
            whole = (where, line) in fenced_ids or where.suffix != ".md"  # usage lines
            found[key] = (name, words, whole)
    return list(found.values())


COMMANDS = _commands()


# Two commands on one line (``a && b``) get #2 after the second's line.
def _unique_ids() -> list[str]:
    ids: list[str] = []
    for name, _, _ in COMMANDS:
        before = sum(i == name or i.startswith(name + "#") for i in ids)
        ids.append(f"{name}#{before + 1}" if before else name)
    return ids


IDS = _unique_ids()


class _ParseError(AssertionError):
    """argparse's one line: the command as written would stop with it."""

    def __init__(self, parser: argparse.ArgumentParser, line: str):
        super().__init__(line)
        self.parser = parser


class _Parsed(Exception):
    def __init__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace | None):
        super().__init__()
        self.parser, self.namespace = parser, namespace


@contextlib.contextmanager
def _stop_after_parsing():
    """argparse parses as usual, then the program stops: nothing past its parsing runs."""
    originals = {
        name: getattr(argparse.ArgumentParser, name)
        for name in ("parse_args", "parse_intermixed_args")
    }

    def stopping(name):
        def parse(self, *args, **kwargs):
            try:
                namespace = originals[name](self, *args, **kwargs)
            except SystemExit as stop:  # a usage error (on stderr), or --help (exit 0)
                raise (
                    _Parsed(self, None) if stop.code in (0, None) else _ParseError(self, "")
                ) from None
            raise _Parsed(self, namespace)

        return parse

    saved_env, saved_path, saved_argv = dict(os.environ), list(sys.path), list(sys.argv)
    try:
        for name in originals:
            setattr(argparse.ArgumentParser, name, stopping(name))
        yield
    finally:
        for name, original in originals.items():
            setattr(argparse.ArgumentParser, name, original)
        os.environ.clear()
        os.environ.update(saved_env)
        sys.path[:], sys.argv[:] = saved_path, saved_argv


def _parse_as_the_program_does(words: list[str]) -> _Parsed:
    """Start the program with ``words`` as ``python`` would; its parser and namespace (None
    after --help), or _ParseError with argparse's message."""
    module, args = (words[2], words[3:]) if words[1] == "-m" else (None, words[2:])
    script = None if module else REPO / words[1]
    errors = io.StringIO()
    with (
        _stop_after_parsing(),
        contextlib.redirect_stderr(errors),
        contextlib.redirect_stdout(io.StringIO()),
    ):
        sys.argv[:] = [str(script or module), *args]
        sys.path.insert(0, str(script.parent if script else REPO))  # as python does
        try:
            if module:
                runpy.run_module(module, run_name="__main__", alter_sys=True)
            else:
                runpy.run_path(str(script), run_name="__main__")
        except _Parsed as parsed:
            return parsed
        except _ParseError as failed:
            message = errors.getvalue().strip().split("\n")[-1]
            raise _ParseError(failed.parser, message) from None
    raise AssertionError("the program finished without parsing its arguments")


def _check_program_exists(words: list[str]) -> None:
    if words[1] == "-m":
        import importlib.util

        assert importlib.util.find_spec(words[2]) is not None, f"no module {words[2]}"
    else:
        assert (REPO / words[1]).is_file(), f"no file {words[1]}"


def _takes_arguments(words: list[str]) -> bool:
    """Whether the program has an argument parser (a few experiments take none)."""
    if words[1] == "-m":
        return True
    return "ArgumentParser(" in (REPO / words[1]).read_text()


def _made_by_documented_commands() -> set[str]:
    """Paths a documented command writes: ``--out`` values and the run folders of train runs."""
    from zeroflow.config.io import load_config

    made = set()
    for _, words, _ in COMMANDS:
        if "--out" in words[:-1]:
            made.add(words[words.index("--out") + 1].rstrip("/"))
        if words[1:3] == ["-m", "zeroflow.train"] and "--config" in words[:-1]:
            config = words[words.index("--config") + 1]
            overrides = [w for w in words[3:] if "=" in w and not w.startswith("-")]
            with contextlib.suppress(ValueError):  # a bad key fails that command's own case
                made.add(load_config(REPO / config, overrides).run.dir.rstrip("/"))
    return made


MADE = _made_by_documented_commands()


def _check_input(what: str, path: str) -> None:
    path = path.rstrip("/")
    if PLACEHOLDER.search(path):
        return
    made = any(path == m or path.startswith(m + "/") for m in MADE)
    assert (REPO / path).exists() or made or path in NOT_IN_CLONE, (
        f"{what} {path}: no such file, and no documented command makes it"
    )


def _check_inputs(words: list[str]) -> None:
    for i, word in enumerate(words[:-1]):
        if word in INPUT_FLAGS:
            _check_input(word, words[i + 1])


def _check_flags_exist(words: list[str], parser: argparse.ArgumentParser) -> None:
    known = parser._option_string_actions  # argparse keeps no public list of its flags
    own = words[: words.index("--")] if "--" in words else words  # then the launched command
    unknown = [w for w in own if w.startswith("--") and w.split("=")[0] not in known]
    assert not unknown, f"{parser.prog}: no such option: {' '.join(unknown)}"


def _check_config(namespace) -> None:
    config = getattr(namespace, "config", None)
    overrides = getattr(namespace, "overrides", None)
    if overrides is None or (config and PLACEHOLDER.search(config)):
        return
    from zeroflow.config.io import load_config

    if config and not (REPO / config).is_file():  # made by a documented run (_check_inputs)
        config = None  # a run folder's config.yaml has the schema's keys: check against those
    cfg = load_config(REPO / config if config else None, overrides)  # one line on a bad key
    # What the run reads: the Hugging Face folders and data a fresh clone lacks until a
    # documented preparation command (make_tiny_hf.py, make_tiny_encoders.py, ...) writes them.
    for key in CONFIG_INPUTS:
        section, field = key.split(".")
        value = getattr(getattr(cfg, section), field)
        if "/" in value:  # "stdlib", "byte": built in, not files
            _check_input(key, value)


@pytest.mark.fast
@pytest.mark.parametrize("name,words,fenced", COMMANDS, ids=IDS)
def test_documented_command_is_accepted_as_written(name, words, fenced):
    command = shlex.join(words)
    try:
        _check_program_exists(words)
        if not _takes_arguments(words):
            assert len(words) == 2, "the program takes no arguments"
            return
        if words[1:3] == ["-m", "zeroflow.launch"] and "--" not in words:
            return  # "zeroflow.launch" alone names the program; its commands carry a --
        if words[1:3] == ["-m", "zeroflow.trainer.plot"]:
            assert len(words) == 4, "usage: python -m zeroflow.trainer.plot RUN_DIR"
            return
        _check_inputs(words)
        try:
            parsed = _parse_as_the_program_does(words)
        except _ParseError as e:
            if fenced or not any(f in str(e) for f in FRAGMENT):
                raise
            _check_flags_exist(words, e.parser)
            return
        _check_flags_exist(words, parsed.parser)  # argparse also takes a flag's prefix
        if parsed.namespace is not None:
            _check_config(parsed.namespace)
    except (AssertionError, ValueError) as e:
        problem = str(e)
    else:
        return
    pytest.fail(f"{name}: `{command}`: {problem}", pytrace=False)  # outside: no chained trace


@pytest.mark.fast
def test_the_docs_show_commands_of_every_kind():
    """The extraction itself: a regex that silently found nothing would pass every case."""
    programs = {w[2] if w[1] == "-m" else w[1].split("/")[0] for _, w, _ in COMMANDS}
    assert {
        "zeroflow.train",
        "zeroflow.memory",
        "zeroflow.launch",
        "scripts",
        "experiments",
    } <= programs
    assert any(name.startswith("configs/") for name, _, _ in COMMANDS)
    assert len(COMMANDS) > 100


HELP = [(n, w) for n, w, _ in COMMANDS if w[-1] == "--help"]


@pytest.mark.slow
@pytest.mark.parametrize("name,words", HELP, ids=[n for n, _ in HELP])
def test_help_commands_run_for_real(name, words):
    done = subprocess.run(
        [sys.executable, *words[1:]],
        cwd=REPO,
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        timeout=300,
    )
    assert done.returncode == 0 and "usage:" in done.stdout, f"{name}: {done.stderr[-500:]}"
