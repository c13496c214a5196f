"""Helpers shared by several test files (tests/ is on sys.path under pytest)."""
import importlib.util
from pathlib import Path

from jax.extend import core as jcore

REPO = Path(__file__).resolve().parents[1]


def load_script(name):
    """The module of ``scripts/<name>.py`` (scripts are not a package)."""
    spec = importlib.util.spec_from_file_location(name, REPO / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def walk(jaxpr):
    """Every equation of ``jaxpr`` and of its sub-jaxprs, depth first."""
    jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
    for eqn in jaxpr.eqns:
        yield eqn
        for sub in jcore.jaxprs_in_params(eqn.params):
            yield from walk(sub)
