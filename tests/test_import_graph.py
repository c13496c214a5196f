"""The package layering, read from the source: every ``import`` of every module, the ones inside
functions included (a lazy import must not hide a cycle or a reach upward).

Layers, lowest first; a module imports only from its own layer or below:
  util -> engine (engine/, backend/, autocast/, optim/) -> memory -> config -> models, data
  -> hf -> lora -> trainer, fusemix -> cli.
Entry points sit outside the layers: ``zeroflow/__init__.py`` (the public names), the
``python -m`` starters at the root and ``memory/__main__.py``.
"""
from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent / "zeroflow"

LAYERS = [
    {"util"},
    {"engine", "backend", "autocast", "optim"},
    {"memory"},
    {"config"},
    {"models", "data"},
    {"hf"},
    {"lora"},
    {"trainer", "fusemix"},
    {"cli"},
]
RANK = {package: rank for rank, packages in enumerate(LAYERS) for package in packages}
ENTRY_POINTS = {"zeroflow", "zeroflow.train", "zeroflow.sample", "zeroflow.export",
                "zeroflow.launch", "zeroflow.memory.__main__"}
# What the engine layer must never reach, even lazily: it is the library other code imports.
ABOVE_ENGINE = {"trainer", "cli", "config", "models", "data", "hf", "fusemix", "memory", "lora"}


def _module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(p): p for p in ROOT.rglob("*.py")}


def _imports(name: str) -> set[str]:
    """The zeroflow modules ``name`` imports (a package's ``__init__`` where the imported name is
    not a module of its own)."""
    path = MODULES[name]
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.split(".")[0] == "zeroflow"}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            if base.split(".")[0] != "zeroflow":
                continue
            found |= {f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base
                      for a in node.names}
    return found - {name}


GRAPH = {name: _imports(name) for name in MODULES}


def _layer_of(name: str) -> str:
    return name.split(".")[1]


def test_every_package_has_a_layer():
    packages = {_layer_of(n) for n in MODULES if n not in ENTRY_POINTS}
    assert packages <= set(RANK), f"packages without a layer: {sorted(packages - set(RANK))}"


def test_the_root_holds_packages_and_entry_points_only():
    files = {p.name for p in ROOT.glob("*.py")}
    assert files == {"__init__.py", "train.py", "sample.py", "export.py", "launch.py"}


def test_no_module_imports_a_higher_layer():
    upward = [f"{a} -> {b}" for a, targets in GRAPH.items() if a not in ENTRY_POINTS
              for b in targets if b != "zeroflow" and RANK[_layer_of(b)] > RANK[_layer_of(a)]]
    assert not upward, "imports against the layering:\n" + "\n".join(sorted(upward))


def test_no_module_but_an_entry_point_imports_the_public_package():
    # ``import zeroflow`` runs zeroflow/__init__.py, which imports the engine and memory: from
    # inside those it is a cycle, from anywhere else a hidden dependency on everything.
    inner = sorted(a for a, targets in GRAPH.items() if "zeroflow" in targets
                   and RANK.get(_layer_of(a), 99) <= RANK["memory"] and a not in ENTRY_POINTS)
    assert not inner, f"import the module, not zeroflow: {inner}"


@pytest.mark.parametrize("layer", sorted(LAYERS[1]))
def test_the_engine_imports_nothing_above_it(layer):
    reached = {f"{a} -> {b}" for a, targets in GRAPH.items()
               if a not in ENTRY_POINTS and _layer_of(a) == layer
               for b in targets if b != "zeroflow" and _layer_of(b) in ABOVE_ENGINE}
    assert not reached, sorted(reached)


def _cycles() -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in GRAPH.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(GRAPH):
        if v not in index:
            visit(v)
    return found


def test_no_import_cycle():
    assert not _cycles()


def test_the_checks_see_a_planted_upward_import_and_cycle():
    # The graph checks themselves, on an edge that must be caught: the engine reaching the trainer.
    GRAPH["zeroflow.engine.step"].add("zeroflow.trainer.loop")
    try:
        with pytest.raises(AssertionError):
            test_no_module_imports_a_higher_layer()
        assert _cycles(), "trainer.loop imports the engine's step: the planted edge closes a cycle"
    finally:
        GRAPH["zeroflow.engine.step"].discard("zeroflow.trainer.loop")
