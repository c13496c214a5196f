"""The gradient half of the train step: how weights reach the loss on each device (gathered,
streamed, whole) and how their gradients leave it (reduce-scattered on use, all-reduced).
``local_grads`` runs inside ``shard_map`` over ``data``."""

from zeroflow.engine.grads.local import WeightAndStandIn, local_grads, native_gradients, split_loss
from zeroflow.engine.grads.routes import Fetch, Reduce, Route, step_routes
from zeroflow.engine.grads.sources import Stage3Collectives, gather_weight

__all__ = [
    "Fetch",
    "Reduce",
    "Route",
    "Stage3Collectives",
    "WeightAndStandIn",
    "gather_weight",
    "local_grads",
    "native_gradients",
    "split_loss",
    "step_routes",
]
