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
"""

from zeroflow.util import interrupts as _interrupts

_interrupts.install_for_commands()  # first: a Ctrl-C while jax imports is one line too

from zeroflow.util import quiet_jax as _quiet_jax  # noqa: E402

_quiet_jax.start()  # before anything imports jax: see zeroflow/util/quiet_jax.py

from zeroflow import backend, memory, optim  # noqa: E402  (zf.memory.estimate, zf.memory.measure)
from zeroflow.autocast import AutocastPolicy, autocast, autocast_report, scaled_value_and_grad  # noqa: E402
from zeroflow.autocast.precision import LossScaleState, Precision  # noqa: E402
from zeroflow.backend import target_mesh  # noqa: E402
from zeroflow.backend.mesh import make_mesh, planning_mesh  # noqa: E402
from zeroflow.engine import offload, padding  # noqa: E402  (zf.offload, zf.padding)
from zeroflow.engine.checkpoint import restore_checkpoint, save_checkpoint  # noqa: E402
from zeroflow.engine.plan import PlanDescription, ZeroPlan  # noqa: E402
from zeroflow.engine.quantized import QuantizedArray, quantize_frozen  # noqa: E402
from zeroflow.engine.state import TrainState, init_train_state, state_shardings  # noqa: E402
from zeroflow.engine.step import make_train_step  # noqa: E402
from zeroflow.lora import LoRA, lora, lora_merge  # noqa: E402
from zeroflow.ops import chunked_cross_entropy, chunked_token_losses  # noqa: E402
from zeroflow.planner import plan  # noqa: E402

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
