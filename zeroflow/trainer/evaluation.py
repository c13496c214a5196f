"""Held-out evaluation of a run's state: the loss (and bits per byte for text streams) over the
validation data's fixed batches, and the result a run returns. Shared by the training loop and
``train.eval_only`` (``zeroflow.trainer.evaluate_only``)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import jax
import numpy as np

from zeroflow.data import RecordData, bits_per_byte, eval_batches
from zeroflow.engine import offload
from zeroflow.engine.distributed import InLockstep
from zeroflow.models import LAYER_STACK
from zeroflow.trainer.setup import Run


@dataclasses.dataclass
class TrainResult:
    run_dir: Path
    step: int
    "Steps completed (the state's step)."
    losses: dict[int, float]
    "Training loss of every step this process ran, keyed by 1-based step."
    eval: dict[str, float]
    "Last evaluation: eval_loss and eval_bpb."
    stopped_by: str | None = None
    "Signal name when a SIGTERM/SIGINT ended the run early."


def make_eval(run: Run):
    def loss_of(state, batch):
        # Outside the step's shard_map, whole rows (tokens in order) as one device would see
        # them; the compiler splits the work.
        # Offloaded weights are read from host memory like the train step reads them: the
        # scanned layers one at a time as they run, the rest whole (no-ops when not offloaded).
        # No rng: evaluation is deterministic (dropout off).
        if run.gather_per_layer is None:  # LoRA, FP8 gathers on use: the loss reads weights whole
            return run.loss_fn(offload.to_device(state.params), batch)[0]
        params = {
            k: v if k == LAYER_STACK else offload.to_device(v) for k, v in state.params.items()
        }
        return run.loss_fn(params, batch, offload.to_device)[0]

    eval_loss = InLockstep(jax.jit(loss_of), "eval")

    def evaluate(state) -> dict[str, float]:
        cfg = run.cfg
        if run.data is None or cfg.train.eval_batches <= 0:
            return {}
        if isinstance(run.data, RecordData):
            return evaluate_packed(state, eval_loss, run, run.data)
        if len(run.data.val) <= cfg.model.seq_len:
            return {}
        batches = eval_batches(
            run.data.val,
            num_batches=cfg.train.eval_batches,
            global_batch=cfg.train.batch_size,
            seq_len=cfg.model.seq_len,
            process_index=jax.process_index(),
            process_count=jax.process_count(),
        )
        losses = [float(eval_loss(state, run.global_batch(b, balanced=False))) for b in batches]
        loss = float(np.mean(losses))
        return {"eval_loss": loss, "eval_bpb": bits_per_byte(loss, run.data.tokens_per_byte)}

    return evaluate


def evaluate_packed(state, eval_loss, run: Run, data: RecordData) -> dict[str, float]:
    """Mean loss per trained token of the held-out examples' fixed batches. No bits per byte:
    the loss covers only completions, not all the text the tokens stand for."""
    cfg = run.cfg
    batches = data.eval_batches(
        num_batches=cfg.train.eval_batches,
        batch_size=cfg.train.batch_size // jax.process_count(),
        process_index=jax.process_index(),
        process_count=jax.process_count(),
    )
    # Weight each batch by its trained tokens (this process's count stands for all).
    weights = [float(b["loss_mask"].sum()) for b in batches]
    if not batches or sum(weights) == 0:
        return {}
    losses = [float(eval_loss(state, run.global_batch(b, balanced=False))) for b in batches]
    return {"eval_loss": float(np.average(losses, weights=weights))}


def eval_text(result: dict[str, float]) -> str:
    text = f"eval loss {result.get('eval_loss', float('nan')):.4f}"
    return text + (f", {result['eval_bpb']:.3f} bits/byte" if "eval_bpb" in result else "")
