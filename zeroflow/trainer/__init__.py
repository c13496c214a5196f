"""The trainer behind ``python -m zeroflow.train``.

Its names are imported the first time they are read (as ``zeroflow``'s are), so a module of
the package that needs none of the trainer starts without it: ``python -m
zeroflow.trainer.plot RUN_DIR`` draws a run's picture with matplotlib alone, without jax.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # what a type checker and an editor see: the names __getattr__ resolves
    from zeroflow.trainer.evaluation import TrainResult as TrainResult
    from zeroflow.trainer.loop import TrainingDiverged as TrainingDiverged
    from zeroflow.trainer.loop import train as train
    from zeroflow.trainer.setup import Run as Run
    from zeroflow.trainer.setup import build_run as build_run

_WHERE = {
    "train": "zeroflow.trainer.loop",
    "TrainResult": "zeroflow.trainer.evaluation",
    "TrainingDiverged": "zeroflow.trainer.loop",
    "Run": "zeroflow.trainer.setup",
    "build_run": "zeroflow.trainer.setup",
}
"Where each public name lives: ``zeroflow.trainer.<name>`` is ``<module>.<name>``."

__all__ = list(_WHERE)


def __getattr__(name: str) -> Any:
    if name not in _WHERE:  # a submodule (``from zeroflow.trainer import loop``) is imported
        raise AttributeError(f"module 'zeroflow.trainer' has no attribute {name!r}")
    value = getattr(importlib.import_module(_WHERE[name]), name)
    globals()[name] = value  # read once: later reads find it without this function
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_WHERE})
