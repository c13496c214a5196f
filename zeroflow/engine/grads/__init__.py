"""The gradient half of the train step: how weights reach the loss on each device (gathered,
streamed, whole) and how their gradients leave it (reduce-scattered on use, all-reduced).
``local_grads`` runs inside ``shard_map`` over ``data``."""
from zeroflow.engine.grads.collectives import gather_weight
from zeroflow.engine.grads.local import Detached, local_grads, native_gradients, split_loss
from zeroflow.engine.grads.routes import Fetch, Reduce, Route, step_routes

__all__ = ["Detached", "Fetch", "Reduce", "Route", "gather_weight", "local_grads",
           "native_gradients", "split_loss", "step_routes"]
