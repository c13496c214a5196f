"""The package layering, read from the source: every ``import`` of every module, the ones inside
functions included (a lazy import must not hide a cycle or a reach upward).

One layer per package, lowest first; a module imports only from its own package or below:
  util -> backend -> ops -> optim -> autocast -> engine -> xla -> memory -> config -> data
  -> models -> hf -> lora -> trainer -> planner -> fusemix -> cli.
``xla`` (what XLA says about a compiled step: its HLO, collectives and XLA:GPU's time estimate)
sits just above the engine, whose hosts it reads, and below everything that reads it.
``ops`` (computations in plain JAX any model calls, such as the chunked cross-entropy) sits
just above ``backend``: it may ask what the device offers, and knows nothing of training.
Inside a package a sub-package (``engine/grads``, ``engine/zeropp``) is one node: the modules it
imports sit below it and none of them imports it back.
Entry points sit outside the layers: ``zeroflow/__init__.py`` (the public names), the
``python -m`` starters at the root, ``memory/__main__.py`` and ``planner/__main__.py``.
"""
from __future__ import annotations

import ast
import pathlib

import pytest

pytestmark = pytest.mark.fast

ROOT = pathlib.Path(__file__).resolve().parent.parent / "zeroflow"

LAYERS = ["util", "backend", "ops", "optim", "autocast", "engine", "xla", "memory", "config",
          "data", "models", "hf", "lora", "trainer", "planner", "fusemix", "cli"]
RANK = {package: rank for rank, package in enumerate(LAYERS)}
ENTRY_POINTS = {"zeroflow", "zeroflow.train", "zeroflow.sample", "zeroflow.export",
                "zeroflow.launch", "zeroflow.memory.__main__",
                "zeroflow.planner.__main__"}
# What the engine layer must never reach, even lazily: it is the library other code imports.
ABOVE_ENGINE = {"trainer", "cli", "config", "models", "data", "hf", "fusemix", "memory", "lora",
                "xla"}


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
    if name == "zeroflow":  # the public names are imported at first use, by module name
        found |= {node.value for node in ast.walk(ast.parse(path.read_text()))
                  if isinstance(node, ast.Constant) and node.value in MODULES}
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


# A package's lazy table (``zeroflow.util.lazy``) names modules by string: what it resolves at
# first read is an import too. The one upward entry: the trainer GPT's figures named in
# ``zf.memory`` (``memory.GPT_NAMES``) for its callers, which read the model's own init.
NAMED_UPWARD = {("zeroflow.memory", "zeroflow.models.spec")}


def _named_modules(name: str) -> set[str]:
    """Modules a package's ``__init__`` names in string constants (its lazy table)."""
    tree = ast.parse(MODULES[name].read_text())
    return {node.value for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and node.value in MODULES} - {name}


def _named_upward() -> set[tuple[str, str]]:
    return {(a, b) for a, p in MODULES.items() if p.name == "__init__.py" and a not in ENTRY_POINTS
            for b in _named_modules(a) if RANK[_layer_of(b)] > RANK[_layer_of(a)]}


def test_lazy_tables_name_nothing_above_their_package_but_the_gpt_figures():
    assert _named_upward() == NAMED_UPWARD


def test_no_module_but_an_entry_point_imports_the_public_package():
    # ``import zeroflow`` runs zeroflow/__init__.py, which imports the engine and memory: from
    # inside those it is a cycle, from anywhere else a hidden dependency on everything.
    inner = sorted(a for a, targets in GRAPH.items() if "zeroflow" in targets
                   and RANK.get(_layer_of(a), 99) <= RANK["memory"] and a not in ENTRY_POINTS)
    assert not inner, f"import the module, not zeroflow: {inner}"


def test_nothing_inside_the_package_imports_it_whole():
    """``import zeroflow`` (``as zf`` or not) from inside the package runs every layer's
    public names, the planner's included: any module doing so reaches above itself."""
    whole = sorted(
        name for name, path in MODULES.items() if name not in ENTRY_POINTS
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Import) and any(a.name == "zeroflow" for a in node.names)
    )
    assert not whole, f"import the module you need, not zeroflow: {whole}"


@pytest.mark.parametrize("layer", ["util", "backend", "ops", "optim", "autocast", "engine"])
def test_the_engine_imports_nothing_above_it(layer):
    reached = {f"{a} -> {b}" for a, targets in GRAPH.items()
               if a not in ENTRY_POINTS and _layer_of(a) == layer
               for b in targets if b != "zeroflow" and _layer_of(b) in ABOVE_ENGINE}
    assert not reached, sorted(reached)


SUBPACKAGES = sorted(n for n, p in MODULES.items() if p.name == "__init__.py" and n.count(".") >= 2)


def _entered_both_ways(graph: dict[str, set[str]]) -> list[str]:
    """Sub-packages that import a module which imports them back (directly or through others):
    with the sub-package contracted to one node, a path from it returns to it."""
    found = []
    for sub in SUBPACKAGES:
        def node(m, sub=sub):
            return sub if m == sub or m.startswith(sub + ".") else m
        contracted: dict[str, set[str]] = {}
        for a, targets in graph.items():
            contracted.setdefault(node(a), set()).update(node(b) for b in targets)
        contracted[sub].discard(sub)
        seen, todo = set(), list(contracted[sub])
        while todo:
            v = todo.pop()
            if v not in seen:
                seen.add(v)
                todo.extend(contracted.get(v, ()))
        if sub in seen:
            found.append(sub)
    return found


def test_no_sub_package_is_entered_both_ways():
    assert not _entered_both_ways(GRAPH)


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


@pytest.mark.parametrize("edge", [("zeroflow.backend.targets", "zeroflow.engine.plan"),
                                  ("zeroflow.autocast.scaling", "zeroflow.engine.state"),
                                  ("zeroflow.optim.adam", "zeroflow.autocast.interpret"),
                                  ("zeroflow.data.packing", "zeroflow.models.gpt")])
def test_a_planted_back_import_between_two_packages_is_caught(edge):
    # Each of these packages was once one layer with its neighbour; now each is its own.
    a, b = edge
    GRAPH[a].add(b)
    try:
        with pytest.raises(AssertionError):
            test_no_module_imports_a_higher_layer()
    finally:
        GRAPH[a].discard(b)


def test_a_planted_back_import_into_a_sub_package_is_caught():
    # The plan reading ZeRO++'s hierarchical module, which itself takes a plan.
    GRAPH["zeroflow.engine.plan"].add("zeroflow.engine.zeropp.hierarchical")
    try:
        assert _entered_both_ways(GRAPH) == ["zeroflow.engine.zeropp"]
    finally:
        GRAPH["zeroflow.engine.plan"].discard("zeroflow.engine.zeropp.hierarchical")
