"""The planner: on which GPUs, how many, with which plan, how fast (docs/planner.md).

    plan = zf.plan(loss_fn, params, batch, tx, targets=("h100", "l4"), devices=(1, 8))
    for row in plan.summaries():   # the best plan per GPU x device count, None where none fits
        print(row.row.where.title, row.best and row.best.choice.label(), row.tokens_per_s)
    plan.as_json()                 # every candidate: what-if, status, XLA's figures

The figures are XLA's compiles for the GPU (``zf.target_mesh``); the ZeRO formula's what-if only
proves which plans cannot fit and orders the rest (``zeroflow.planner.search``).
"""

from typing import TYPE_CHECKING

from zeroflow.util import lazy as _lazy

if TYPE_CHECKING:  # what a type checker and an editor see: the names __getattr__ resolves
    from zeroflow.planner.choices import Choice as Choice
    from zeroflow.planner.choices import Space as Space
    from zeroflow.planner.library import plan as plan
    from zeroflow.planner.results import Plan as Plan
    from zeroflow.planner.results import Summary as Summary

_WHERE = {
    "Choice": "zeroflow.planner.choices",
    "Space": "zeroflow.planner.choices",
    "plan": "zeroflow.planner.library",
    "Plan": "zeroflow.planner.results",
    "Summary": "zeroflow.planner.results",
}
"Where each public name lives (imported the first time it is read)."

_lazy.install(__name__, _WHERE)

__all__ = ["Choice", "Plan", "Space", "Summary", "plan"]
