"""zeroflow: ZeRO-sharded, mixed-precision training for JAX.

import zeroflow as zf
mesh  = zf.make_mesh(data=-1, model=1)   # or zf.target_mesh("h100", data=8): compile only
prec  = zf.Precision(params="bf16", master="fp32", loss_scale="none")
plan  = zf.ZeroPlan(mesh, stage=2)
state = zf.init_train_state(params, tx, plan, prec)   # model_state=..., rng=..., trainable=...
step  = zf.make_train_step(loss_fn, tx, plan, prec, grad_accum=1)
state, metrics = step(state, batch)

tx  = zf.optim.adamw_8bit(3e-4)       # AdamW with 8-bit moments (docs/engine.md)
f16 = zf.autocast(fn, dtype="bf16")   # an unmodified fp32 model in half precision (docs/autocast.md)
lo  = zf.lora(loss_fn, rank=8, alpha=16, targets=r"query|value")  # adapters (docs/lora.md)
q, mask = zf.quantize_frozen(params, trainable, kind="nf4")  # 4-bit frozen base (docs/nf4.md)
ce  = zf.chunked_cross_entropy(hidden, w_out, labels)  # never holds the logits (docs/memory.md)
best = zf.plan(loss_fn, params, batch, tx, targets=("h100",), devices=(8,))  # docs/planner.md

``import zeroflow`` does nothing else: it imports no layer (each public name is imported the
first time it is read, so the engine never pays for the planner), sets no environment variable,
changes nothing inside jax and installs no signal handler. Only a ``python -m zeroflow.<command>``
process is prepared here, the first code such a process runs (``zeroflow.memory`` and
``zeroflow.planner`` are packages that import jax): ``zeroflow.cli.common.start_command``.
"""

from __future__ import annotations

import importlib
import sys
import types
from typing import TYPE_CHECKING, Any

from zeroflow.util import interrupts as _interrupts

if TYPE_CHECKING:  # what a type checker and an editor see: the names __getattr__ resolves
    from zeroflow import backend as backend
    from zeroflow import memory as memory
    from zeroflow import optim as optim
    from zeroflow.autocast.interpret import autocast as autocast
    from zeroflow.autocast.policy import AutocastPolicy as AutocastPolicy
    from zeroflow.autocast.precision import LossScaleState as LossScaleState
    from zeroflow.autocast.precision import Precision as Precision
    from zeroflow.autocast.report import autocast_report as autocast_report
    from zeroflow.autocast.scaling import scaled_value_and_grad as scaled_value_and_grad
    from zeroflow.backend import target_mesh as target_mesh
    from zeroflow.backend.mesh import make_mesh as make_mesh
    from zeroflow.backend.mesh import planning_mesh as planning_mesh
    from zeroflow.engine import offload as offload
    from zeroflow.engine import padding as padding
    from zeroflow.engine.checkpoint import restore_checkpoint as restore_checkpoint
    from zeroflow.engine.checkpoint import save_checkpoint as save_checkpoint
    from zeroflow.engine.plan import PlanDescription as PlanDescription
    from zeroflow.engine.plan import ZeroPlan as ZeroPlan
    from zeroflow.engine.quantized import QuantizedArray as QuantizedArray
    from zeroflow.engine.quantized import quantize_frozen as quantize_frozen
    from zeroflow.engine.state import TrainState as TrainState
    from zeroflow.engine.state import init_train_state as init_train_state
    from zeroflow.engine.state import state_shardings as state_shardings
    from zeroflow.engine.step import make_train_step as make_train_step
    from zeroflow.lora.transform import LoRA as LoRA
    from zeroflow.lora.transform import lora as lora
    from zeroflow.lora.transform import lora_merge as lora_merge
    from zeroflow.ops.cross_entropy import chunked_cross_entropy as chunked_cross_entropy
    from zeroflow.ops.cross_entropy import chunked_token_losses as chunked_token_losses
    from zeroflow.planner.library import plan as plan

if _interrupts.command() is not None:  # python -m zeroflow.<command>, never a program's import
    from zeroflow.cli.common import start_command as _start_command

    _start_command()

_WHERE = {
    "make_mesh": "zeroflow.backend.mesh",
    "planning_mesh": "zeroflow.backend.mesh",
    "target_mesh": "zeroflow.backend",
    "Precision": "zeroflow.autocast.precision",
    "LossScaleState": "zeroflow.autocast.precision",
    "ZeroPlan": "zeroflow.engine.plan",
    "PlanDescription": "zeroflow.engine.plan",
    "TrainState": "zeroflow.engine.state",
    "init_train_state": "zeroflow.engine.state",
    "state_shardings": "zeroflow.engine.state",
    "make_train_step": "zeroflow.engine.step",
    "quantize_frozen": "zeroflow.engine.quantized",
    "QuantizedArray": "zeroflow.engine.quantized",
    "save_checkpoint": "zeroflow.engine.checkpoint",
    "restore_checkpoint": "zeroflow.engine.checkpoint",
    "autocast": "zeroflow.autocast.interpret",
    "AutocastPolicy": "zeroflow.autocast.policy",
    "autocast_report": "zeroflow.autocast.report",
    "scaled_value_and_grad": "zeroflow.autocast.scaling",
    "lora": "zeroflow.lora.transform",
    "LoRA": "zeroflow.lora.transform",
    "lora_merge": "zeroflow.lora.transform",
    "chunked_cross_entropy": "zeroflow.ops.cross_entropy",
    "chunked_token_losses": "zeroflow.ops.cross_entropy",
    "plan": "zeroflow.planner.library",
}
"Where each public function and class lives: ``zf.<name>`` is ``<module>.<name>``."

_MODULES = {
    "backend": "zeroflow.backend",
    "memory": "zeroflow.memory",
    "optim": "zeroflow.optim",
    "offload": "zeroflow.engine.offload",
    "padding": "zeroflow.engine.padding",
}
"The public modules: ``zf.memory.estimate_step``, ``zf.offload``, ..."

__all__ = [
    "make_mesh",
    "planning_mesh",
    "target_mesh",
    "backend",
    "Precision",
    "LossScaleState",
    "ZeroPlan",
    "PlanDescription",
    "TrainState",
    "init_train_state",
    "state_shardings",
    "make_train_step",
    "quantize_frozen",
    "QuantizedArray",
    "save_checkpoint",
    "restore_checkpoint",
    "memory",
    "offload",
    "optim",
    "padding",
    "autocast",
    "AutocastPolicy",
    "autocast_report",
    "scaled_value_and_grad",
    "lora",
    "LoRA",
    "lora_merge",
    "chunked_cross_entropy",
    "chunked_token_losses",
    "plan",
]
__version__ = "0.1.0"


_FUNCTIONS_NAMED_AS_PACKAGES = ("autocast", "lora")
"""``zf.autocast`` and ``zf.lora`` are functions of the sub-packages of the same names."""


class _Package(types.ModuleType):
    def __setattr__(self, name: str, value: Any) -> None:
        # Loading a sub-package records it on its parent (``zeroflow.lora = <module>``); for
        # these names the public function is meant, and stays what ``zf.<name>`` reads.
        if name in _FUNCTIONS_NAMED_AS_PACKAGES and isinstance(value, types.ModuleType):
            return
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package


def __getattr__(name: str) -> Any:
    """``zf.<name>``, imported at its first use and kept (later reads cost nothing)."""
    if name in _WHERE:
        value = getattr(importlib.import_module(_WHERE[name]), name)
    elif name in _MODULES:
        value = importlib.import_module(_MODULES[name])
    else:
        raise AttributeError(f"module 'zeroflow' has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
