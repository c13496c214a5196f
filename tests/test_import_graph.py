"""zeroflow's modules import each other without a circle, and without function-local imports
standing in for one: read from the source (nothing is imported, so it takes no jax time)."""
import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "zeroflow"


def _modules() -> dict[str, Path]:
    names = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        names[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return names


def _imports(name: str, path: Path, modules) -> set[str]:
    """The zeroflow modules ``name`` imports anywhere in its file, function bodies included. An
    import of a package that holds ``name`` is not counted: Python runs a package's
    ``__init__`` before its modules, which is how packages are, not a circle."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            found.update(f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base
                         for a in node.names)
    return {m for m in found if m in modules and m != name and not name.startswith(m + ".")}


def _cycle(graph) -> list[str] | None:
    """One import circle of ``graph`` (module -> modules it imports), or None."""
    state: dict[str, str] = {}

    def visit(module, trail):
        state[module] = "open"
        for target in sorted(graph[module]):
            if state.get(target) == "open":
                return trail[trail.index(target):] + [target]
            if target not in state:
                found = visit(target, trail + [target])
                if found:
                    return found
        state[module] = "done"
        return None

    for module in sorted(graph):
        if module not in state:
            found = visit(module, [module])
            if found:
                return found
    return None


def test_no_import_circle():
    modules = _modules()
    graph = {name: _imports(name, path, modules) for name, path in modules.items()}
    assert _cycle(graph) is None, " -> ".join(_cycle(graph))


def test_the_cycle_check_finds_a_circle():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


@pytest.mark.parametrize("module", ["autocast/paint.py", "autocast/interpret.py",
                                    "autocast/higher_order.py"])
def test_autocast_interpreters_import_at_the_top(module):
    """The painter and the interpreter find higher-order rules in the tables that
    ``higher_order`` fills, not by importing it inside a function."""
    tree = ast.parse((PACKAGE / module).read_text())
    local = [ast.unparse(node) for fn in ast.walk(tree)
             if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef))
             for node in ast.walk(fn) if isinstance(node, (ast.Import, ast.ImportFrom))]
    assert local == []


def _reachable(graph, start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for target in graph[todo.pop()] - seen:
            seen.add(target)
            todo.append(target)
    return seen


@pytest.mark.parametrize("library", ["zeroflow.memory", "zeroflow.grads", "zeroflow.backend",
                                     "zeroflow.step", "zeroflow.state"])
def test_the_engine_does_not_reach_the_trainer(library):
    """The library (and ``zeroflow.memory``'s planning) imports no trainer, model or data code,
    so it can be used and tested alone; ``python -m zeroflow.memory`` (its ``__main__``) is the
    trainer's program and may."""
    modules = _modules()
    graph = {name: _imports(name, path, modules) for name, path in modules.items()}
    starts = [m for m in modules if (m == library or m.startswith(library + "."))
              and not m.endswith("__main__")]
    reached = set().union(*(_reachable(graph, m) for m in starts))
    assert not {m for m in reached
                if m.split(".")[1] in ("trainer", "models", "data", "config", "config_io")}
