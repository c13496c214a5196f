"""``train.eval_only=true``: evaluate without training, like nanoGPT's ``eval_only``.

The weights are the newest readable checkpoint of ``run.dir`` (read as ``sample`` reads it:
nothing in the folder is created, moved or written), or, where the folder has none, the run's
initial weights: a Hugging Face model's with ``model.init_from``. The result is printed (and
returned); metrics.jsonl, TensorBoard and the plot are left as they are.

    python -m zeroflow.train --config runs/tiny/config.yaml train.eval_only=true
    python -m zeroflow.train --config configs/finetune-llama.yaml train.eval_only=true
"""

from __future__ import annotations

from pathlib import Path

import jax

from zeroflow.config.schema import Config
from zeroflow.trainer.checkpoints import RunCheckpoints, checkpoints_dir
from zeroflow.trainer.evaluation import TrainResult, eval_text, make_eval
from zeroflow.trainer.setup import build_run


def _has_checkpoints(directory: Path) -> bool:
    return directory.is_dir() and any(p.name.isdigit() for p in directory.iterdir())


def evaluate_only(cfg: Config):
    """Evaluate the run's newest checkpoint (or initial weights); a ``TrainResult`` whose
    ``eval`` holds ``eval_loss`` (and ``eval_bpb`` for text streams)."""
    if cfg.train.eval_batches <= 0:
        raise ValueError("train.eval_only needs train.eval_batches > 0")
    run_dir = Path(cfg.run.dir)
    run = build_run(cfg)
    directory = checkpoints_dir(cfg, run_dir)
    if _has_checkpoints(directory):
        checkpoints = RunCheckpoints(
            directory,
            cfg.checkpoint.keep,
            read_only=True,
            allow_unverified=cfg.checkpoint.allow_unverified,
        )
        try:
            state, meta = checkpoints.read(run.abstract_state())
        finally:
            checkpoints.close()
        source = f"step {meta['step']} of {directory}"
    else:
        state = run.init_state()
        source = (
            f"the initial weights of {cfg.model.init_from}"
            if cfg.model.init_from
            else f"freshly initialised weights (no checkpoint in {directory})"
        )
    result = make_eval(run)(state)
    if not result:
        raise ValueError(
            f"no held-out data to evaluate on ({run.data.summary() if run.data else 'no data'})"
        )
    if jax.process_index() == 0:
        print(f"eval only, {source}: {eval_text(result)}")
    return TrainResult(run_dir=run_dir, step=int(state.step), losses={}, eval=result)
