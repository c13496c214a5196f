"""GPT model, its parameters and logical axes, loss and sampling."""

from zeroflow.models.flops import flops_per_token
from zeroflow.models.gpt import (
    GPT,
    LAYER_STACK,
    abstract_params,
    count_params,
    decay_mask,
    init_params,
    logical_axes,
    param_init_fn,
)
from zeroflow.models.loss import cross_entropy_loss, make_layerwise_loss_fn, make_loss_fn
from zeroflow.models.sampling import generate

__all__ = [
    "GPT",
    "LAYER_STACK",
    "abstract_params",
    "count_params",
    "cross_entropy_loss",
    "decay_mask",
    "flops_per_token",
    "generate",
    "init_params",
    "logical_axes",
    "make_layerwise_loss_fn",
    "make_loss_fn",
    "param_init_fn",
]
