"""Public names of a package imported the first time they are read (PEP 562), so that importing
the package costs nothing: ``python -m zeroflow.memory`` checks its flags before jax starts, and
a program that needs one name does not pay for the rest."""

from __future__ import annotations

import importlib
import sys
import types
from typing import Any


class _Package(types.ModuleType):
    """A package some of whose public functions share a module's name (``memory.estimate`` is
    ``memory.estimate.estimate``; ``memory.collectives`` is ``xla.collectives.collectives``, and
    ``memory.collectives`` is also the module kept where it used to live): importing that module
    records it on the package, which would hide the function; the function stays what the name
    reads."""

    _lazy_where: dict[str, str]

    def __setattr__(self, name: str, value: Any) -> None:
        where = self.__dict__.get("_lazy_where", {})
        if (
            isinstance(value, types.ModuleType)
            and name in where
            and value.__name__ == f"{self.__name__}.{name}"
        ):
            return
        super().__setattr__(name, value)


def install(package: str, where: dict[str, str]) -> None:
    """Give ``package`` (being imported) the names of ``where``: ``n`` is ``where[n]``'s
    attribute of the same name, imported when first read and kept in the package after."""
    module = sys.modules[package]
    namespace = module.__dict__

    def __getattr__(name: str) -> Any:
        if name not in where:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(where[name]), name)
        namespace[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted(set(namespace) | set(where))

    namespace.update(__getattr__=__getattr__, __dir__=__dir__, _lazy_where=where)
    module.__class__ = _Package
