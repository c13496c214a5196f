"""The gradient half of the train step: how weights reach the loss on each device (gathered,
streamed, whole) and how their gradients leave it (reduce-scattered on use, all-reduced).
``local_grads`` runs inside ``shard_map`` over ``data``."""
from zeroflow.grads.collectives import gather_weight
from zeroflow.grads.local import Detached, Route, local_grads, routes, split_loss

__all__ = ["Detached", "Route", "gather_weight", "local_grads", "routes", "split_loss"]
