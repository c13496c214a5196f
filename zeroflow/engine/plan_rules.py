"""The rules tying ``ZeroPlan``'s settings together, each stated once.

A rule is a function of the plain settings (no mesh) that returns the one-line problem, or None.
``ZeroPlan`` raises the first problem; the config validation (``zeroflow.config.io``) reports
them all, spelled with its own keys (``Keys``); the step and the memory estimator ask
``batch_split_problem`` of a batch.
"""

from __future__ import annotations

import dataclasses
from typing import Any


@dataclasses.dataclass(frozen=True)
class Keys:
    """How a rule's message names the settings. By default as ``ZeroPlan``'s arguments with
    Python values (``stage``, ``hierarchical=True``); the config passes its own keys and values
    as written in YAML (``parallel.zero_stage``, ``parallel.hierarchical=true``)."""

    names: dict[str, str] = dataclasses.field(default_factory=dict)
    python: bool = True

    def __call__(self, name: str) -> str:
        return self.names.get(name, name)

    def set(self, name: str, value: Any) -> str:
        """``name=value``, as the user writes it."""
        if self.python:
            return f"{self(name)}={value!r}"
        shown = (
            "none" if value is None else str(value).lower() if isinstance(value, bool) else value
        )
        return f"{self(name)}={shown}"


PLAN_KEYS = Keys(
    {"batch_size": "batch size", "params": "Precision.params", "seq_len": "sequence length"}
)
"The engine's spelling: ``ZeroPlan``'s arguments, the batch's leading size and sequence length,"
" ``Precision``'s field."


def host_update_problem(offload: str, update_on: str, keys: Keys = PLAN_KEYS) -> str | None:
    """The update runs on the host only where the offloaded state already is."""
    if update_on == "host" and offload == "none":
        return (
            f"{keys.set('update_on', 'host')} needs {keys('offload')} 'optimizer' or "
            f"'optimizer+params'"
        )
    return None


def quantize_weights_problem(
    quantize_weights: str | None, stage: int, keys: Keys = PLAN_KEYS
) -> str | None:
    """qwZ quantizes weight gathers, which only stage 3 has."""
    if quantize_weights is None or stage == 3:
        return None
    return (
        f"{keys.set('quantize_weights', quantize_weights)} quantizes stage-3 weight gathers; "
        f"{keys('stage')} is {stage} (set it to 3)"
    )


def quantize_grads_problem(
    quantize_grads: str | None, stage: int, keys: Keys = PLAN_KEYS
) -> str | None:
    """qgZ quantizes the reduce-scatter of gathered weights' gradients: stage 3 only."""
    if quantize_grads is None or stage == 3:
        return None
    return (
        f"{keys.set('quantize_grads', quantize_grads)} quantizes the reduction of gathered "
        f"stage-3 weights' gradients; {keys('stage')} is {stage} (set it to 3)"
    )


def quantize_block_problem(quantize_block: int, keys: Keys = PLAN_KEYS) -> str | None:
    if (
        isinstance(quantize_block, bool)
        or not isinstance(quantize_block, int)
        or quantize_block < 1
    ):
        return f"{keys('quantize_block')} must be a positive int; got {quantize_block!r}"
    return None


def hierarchical_problem(
    hierarchical: bool, stage: int, offload: str, keys: Keys = PLAN_KEYS
) -> str | None:
    """hpZ keeps a second copy of the stage-3 compute weights, in device memory."""
    if not hierarchical:
        return None
    if stage != 3:
        return (
            f"{keys.set('hierarchical', True)} keeps a within-host copy of stage-3 weights; "
            f"{keys('stage')} is {stage} (set it to 3)"
        )
    if offload != "none":
        return (
            f"{keys.set('hierarchical', True)} keeps its weight copy in device memory; it "
            f"does not combine with {keys.set('offload', offload)} "
            f"(use {keys.set('offload', 'none')})"
        )
    return None


def hierarchical_hosts_problem(
    hierarchical: bool, hosts: int | None, keys: Keys = PLAN_KEYS
) -> str | None:
    """hpZ gathers within each host, which only helps when there are two or more (``hosts``:
    how many the data axis spans, None while unknown)."""
    if hierarchical and hosts == 1:
        return (
            f"{keys.set('hierarchical', True)} needs a data axis spanning two or more hosts; "
            f"on one host plain stage 3 gathers within it already (emulated devices: "
            f"{keys('hosts')}=H)"
        )
    return None


def hierarchical_copy_problem(
    hierarchical: bool, params: str, keys: Keys = PLAN_KEYS
) -> str | None:
    """hpZ's copy is of the compute-dtype weights; fp32 weights keep none (``params``: the
    ``Precision.params`` name of the compute dtype)."""
    if hierarchical and params == "fp32":
        return (
            f"{keys.set('hierarchical', True)} keeps a within-host copy of the compute-dtype "
            f"weights; {keys('params')} is fp32, which keeps none (set it to bf16)"
        )
    return None


def plan_problems(
    stage: int,
    offload: str = "none",
    update_on: str = "device",
    quantize_weights: str | None = None,
    quantize_block: int = 256,
    hierarchical: bool = False,
    quantize_grads: str | None = None,
    hosts: int | None = None,
    keys: Keys = PLAN_KEYS,
) -> list[str]:
    """Every rule between ``ZeroPlan``'s settings, given valid choices and no mesh (``hosts``:
    None while the mesh is to tell)."""
    found = [
        host_update_problem(offload, update_on, keys),
        quantize_weights_problem(quantize_weights, stage, keys),
        quantize_block_problem(quantize_block, keys),
        quantize_grads_problem(quantize_grads, stage, keys),
        hierarchical_problem(hierarchical, stage, offload, keys),
        hierarchical_hosts_problem(hierarchical, hosts, keys),
    ]
    return [problem for problem in found if problem]


def batch_split_problem(
    batch_size: int, grad_accum: int, data_size: int | None = None, keys: Keys = PLAN_KEYS
) -> str | None:
    """The global batch splits into ``grad_accum`` micro-batches, each over ``data_size``
    devices (None: before the mesh is known, the micro-batches alone)."""
    if grad_accum <= 0:
        return None  # a problem of its own, reported where grad_accum is read
    if data_size is None:
        if batch_size % grad_accum:
            return (
                f"{keys('batch_size')} {batch_size} does not divide by "
                f"{keys('grad_accum')} {grad_accum}"
            )
    elif batch_size % (data_size * grad_accum):
        return (
            f"{keys('batch_size')} {batch_size} does not divide by data axis size "
            f"{data_size} x {keys('grad_accum')} {grad_accum}"
        )
    return None


def sequence_split_problem(
    length: int, context: int, chunks: int = 1, keys: Keys = PLAN_KEYS
) -> str | None:
    """A sequence of ``length`` tokens splits into ``context`` equal parts, each of ``chunks``
    equal chunks (the ring's load-balanced layout holds two per device)."""
    if context <= 1 or length % (context * chunks) == 0:
        return None
    chunked = f" x {chunks} chunks each (the ring's load-balanced layout)" if chunks > 1 else ""
    return (
        f"{keys('seq_len')} {length} does not split into {keys('context')} {context} equal "
        f"parts{chunked}"
    )


CONTEXT_CHUNKS = {"allgather": 1, "ring": 2}
"""Chunks of a row each context device holds, per way attention crosses the split
(``model.context_attention``): the ring's load-balanced layout holds two."""

MODEL_KEYS = Keys(
    {
        name: f"model.{name}"
        for name in ("context_attention", "attention", "sliding_window", "seq_len")
    },
    python=False,
)
"The model's settings as its config spells them."


def context_attention_problem(
    strategy: str, attention: str, sliding_window: int, keys: Keys = MODEL_KEYS
) -> str | None:
    """The ring merges blocks by their log-sum-exp, which cuDNN's attention does not take into
    its backward pass, and its blocks have no sliding window."""
    if strategy == "allgather" and attention == "pallas" and sliding_window:
        return (
            f"{keys('sliding_window')} with {keys.set('context_attention', 'allgather')} needs "
            f"{keys('attention')} xla or cudnn (the Pallas kernel's band there is the row's "
            "causal offset)"
        )
    if strategy != "ring":
        return None
    if attention == "cudnn":
        return (
            f"{keys.set('context_attention', 'ring')} needs {keys('attention')} xla or pallas "
            f"(cuDNN's backward pass takes no log-sum-exp); use {keys('context_attention')} "
            "allgather with cuDNN"
        )
    if sliding_window:
        return (
            f"{keys('sliding_window')} needs {keys.set('context_attention', 'allgather')} "
            "(the ring's blocks have no window)"
        )
    return None
