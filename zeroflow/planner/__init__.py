"""The planner: on which GPUs, how many, with which plan, how fast.

    plan = zf.plan(loss_fn, params, batch, tx, targets=("h100", "l4"), devices=(1, 8))
    for row in plan.summaries():   # the best plan per GPU x device count, None where none fits
        print(row.row.where.title, row.best and row.best.choice.label(), row.tokens_per_s)
    plan.as_json()                 # every candidate: what-if, status, XLA's figures

``python -m zeroflow.planner --config X --gpus h100,a100,l4 --devices 1,8`` does the same for a
trainer config, searching its remat and attention too, and writes each row's plan as config
overrides.

The figures are XLA's: each plan the search picks is compiled for the GPU without one
(``zf.target_mesh``), its peak read from XLA's memory analysis and its step time from XLA:GPU's
latency-hiding scheduler (``zeroflow.memory.schedule``). The ZeRO paper's formula is the instant
what-if: it proves which plans cannot fit (never compiled) and, with a roofline, orders the rest
so that a few compiles per row suffice (``zeroflow.planner.search``). See docs/planner.md.
"""

from zeroflow.planner.choices import Choice, Space
from zeroflow.planner.library import plan
from zeroflow.planner.results import Plan, Summary

__all__ = ["Choice", "Plan", "Space", "Summary", "plan"]
