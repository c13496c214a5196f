"""``python -m zeroflow.train --config configs/fusemix.yaml``: FuseMix through the ZeRO engine.

The latents are encoded once into the cache (or found there), then two adapters train on
them with ``zf.make_train_step``; the step's key (``state.rng``) draws each batch's mixup, and
the batch of a step is a function of the step (``stream.batch_rows``), so a run resumed from
any checkpoint continues exactly as the uninterrupted run. Held-out retrieval recall is
evaluated every ``train.eval_every`` steps and at the end; metrics go to
``run.dir/metrics.jsonl``, checkpoints to ``run.dir/checkpoints``.
"""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path
from typing import Any

import jax
import numpy as np
import optax
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
from rich.table import Column

from zeroflow.autocast.precision import Precision
from zeroflow.config.io import save_config
from zeroflow.config.schema import Config
from zeroflow.engine.plan import ZeroPlan
from zeroflow.engine.state import TrainState, init_train_state
from zeroflow.engine.step import make_train_step
from zeroflow.fusemix import digits, latents, retrieval, stream, tiny_encoders
from zeroflow.fusemix.model import IMAGE, TEXT, make_loss
from zeroflow.trainer import loggers
from zeroflow.trainer.checkpoints import RunCheckpoints
from zeroflow.trainer.evaluation import TrainResult
from zeroflow.trainer.optim import make_optimizer
from zeroflow.trainer.parallel import mesh_of, plan_of
from zeroflow.trainer.plot import write_plot
from zeroflow.util import lines

MIXUP_STREAM = 2
"Folded into the seed's key for the state's rng (the engine derives each step's mixup key)."


@dataclasses.dataclass
class FuseMixRun:
    cfg: Config
    plan: ZeroPlan
    prec: Precision
    tx: optax.GradientTransformation
    module: Any
    loss_fn: Any
    latents: dict[str, np.ndarray]
    train_rows: np.ndarray
    val_rows: np.ndarray
    groups: np.ndarray

    def init_state(self) -> TrainState:
        dims = {k: v.shape[1] for k, v in self.latents.items()}

        def init():
            return self.module.init(
                jax.random.key(self.cfg.train.seed),
                np.zeros((1, dims[IMAGE]), np.float32),
                np.zeros((1, dims[TEXT]), np.float32),
            )["params"]

        rng = jax.random.fold_in(jax.random.key(self.cfg.train.seed), MIXUP_STREAM)
        return init_train_state(init, self.tx, self.plan, self.prec, rng=rng)


def _find_encoders(fm, console: Console) -> None:
    """Both encoder folders hold a model, or, with ``fusemix.tiny_encoders``, the missing ones
    are written now (the CPU demo's); otherwise one line naming the key."""
    if not fm.image_encoder or not fm.text_encoder:
        raise ValueError(
            "fusemix.image_encoder and fusemix.text_encoder must name Hugging Face folders "
            "(with fusemix.tiny_encoders=true the CPU demo's tiny ones are written there)"
        )
    folders = {"image_encoder": fm.image_encoder, "text_encoder": fm.text_encoder}
    missing = {key: f for key, f in folders.items() if not tiny_encoders.holds_model(f)}
    for key, folder in missing.items():
        if not fm.tiny_encoders:
            raise FileNotFoundError(
                f"fusemix.{key}: no Hugging Face model at {folder}; set "
                "fusemix.tiny_encoders=true to write the CPU demo's tiny random one there"
            )
        if not tiny_encoders.can_write(folder):
            raise ValueError(
                f"fusemix.{key}: {folder} holds files but no model (no config.json); "
                "fusemix.tiny_encoders writes only to a new or empty folder"
            )
    if missing:
        try:
            written = tiny_encoders.make(missing.get("image_encoder"), missing.get("text_encoder"))
        except tiny_encoders.MissingLibraries as e:
            raise ValueError(f"fusemix.tiny_encoders: {e}") from None
        _say(
            console,
            f"FuseMix: wrote the tiny random encoders {', '.join(map(str, written))} "
            "(fusemix.tiny_encoders)",
        )


def build_fusemix(cfg: Config, progress: bool, console: Console | None = None) -> FuseMixRun:
    """The data and its latents (encoded now when the cache lacks them; the tiny encoders
    written first where ``fusemix.tiny_encoders`` asks), mesh, plan, optimizer."""
    fm, par = cfg.fusemix, cfg.parallel
    _find_encoders(fm, console or Console(stderr=True))
    if par.model != 1:
        raise ValueError(
            f"parallel.model={par.model}: FuseMix's adapters are not split over a model axis; "
            "set parallel.model=1 (ZeRO over parallel.data shards them)"
        )
    mesh = mesh_of(par)
    pairs = digits.digits_pairs(cfg.train.seed)
    found = {
        IMAGE: latents.image_latents(cfg, pairs, mesh, progress),
        TEXT: latents.text_latents(cfg, pairs, mesh, progress),
    }
    train_rows, val_rows = digits.split(len(pairs.captions), fm.val_pairs, cfg.train.seed)
    plan = plan_of(par, mesh)
    module, loss_fn = make_loss(
        fm.adapter_hidden,
        fm.adapter_layers,
        fm.shared_dim,
        fm.temperature,
        fm.mixup_alpha,
        adapter=fm.adapter,
        expansion=fm.adapter_expansion,
    )
    decay = lambda params: jax.tree.map(lambda x: x.ndim > 1, params)  # noqa: E731  kernels only
    return FuseMixRun(
        cfg,
        plan,
        Precision.from_config(cfg.precision),
        make_optimizer(cfg.train, decay),
        module,
        loss_fn,
        found,
        train_rows,
        val_rows,
        pairs.groups,
    )


def evaluate(run: FuseMixRun, state) -> dict[str, float]:
    """Recall@1/5/10 image->text and text->image on the held-out pairs (no mixup)."""
    params = jax.device_get(state.params)
    rows = run.val_rows
    za, zb = run.module.apply(
        {"params": params},
        np.asarray(run.latents[IMAGE][rows], np.float32),
        np.asarray(run.latents[TEXT][rows], np.float32),
    )
    similarity = np.asarray(za, np.float64) @ np.asarray(zb, np.float64).T
    return retrieval.recall(similarity, run.groups[rows])


def _log(run_dir: Path, record: dict, sinks=()) -> None:
    """A row of ``metrics.jsonl``, and its numbers to the run's loggers (TensorBoard, ...)."""
    with open(run_dir / "metrics.jsonl", "a") as f:
        f.write(json.dumps(record) + "\n")
    numbers = {k: v for k, v in record.items() if k != "step" and isinstance(v, (int, float))}
    for sink in sinks:
        sink.log(numbers, record["step"])


def _draw(cfg: Config, run_dir: Path) -> None:
    """``plot.png``, as every run folder has it (``run.plot``)."""
    if cfg.run.plot:
        write_plot(run_dir, title=f"FuseMix {run_dir.name}")


def _recall_text(r: dict[str, float]) -> str:
    return "  ".join(f"{k} {v:.3f}" for k, v in r.items())


def _say(console: Console, message: str) -> None:
    """A progress or result line: whole when piped, cut only between its items in a terminal
    narrower than it (``zeroflow.util.lines``), never inside a figure."""
    for line in lines.fit(message, console.width if console.is_terminal else None):
        console.print(line, markup=False, highlight=False, soft_wrap=True)


def _step_text(step: int, total: int, m: dict[str, float], rate: float) -> str:
    return f"step {step}/{total}  loss {m['loss']:.4f}  {rate:.1f} steps/s"


def train_fusemix(cfg: Config, *, progress: bool | None = None) -> TrainResult:
    """Train (or resume) the FuseMix run of ``cfg`` in ``cfg.run.dir``."""
    show = cfg.run.progress if progress is None else progress
    console = Console(stderr=True)
    run = build_fusemix(cfg, show, console)
    run_dir = Path(cfg.run.dir)
    checkpoints = RunCheckpoints(run_dir / "checkpoints", cfg.checkpoint.keep)
    try:
        state = run.init_state()
        restored = checkpoints.restore_latest(state)
        state = state if restored is None else restored[0]
        run_dir.mkdir(parents=True, exist_ok=True)
        save_config(cfg, run_dir / "config.yaml")
        chance = retrieval.chance(run.groups[run.val_rows])
        _say(
            console,
            f"FuseMix: {len(run.train_rows)} training pairs, {len(run.val_rows)} "
            f"held out (chance recall@1 {chance['r1']:.3f}); latents "
            f"{ {k: v.shape[1] for k, v in run.latents.items()} }; ZeRO stage "
            f"{run.plan.stage}, mesh {dict(run.plan.mesh.shape)}"
            + (f"; resumed at step {int(state.step)}" if restored else ""),
        )
        state, losses, last = _train_steps(run, state, checkpoints, console, show)
    finally:
        checkpoints.close()
    return TrainResult(run_dir=run_dir, step=int(state.step), losses=losses, eval=last)


def _train_steps(run: FuseMixRun, state, checkpoints: RunCheckpoints, console, show: bool):
    cfg, tcfg = run.cfg, run.cfg.train
    run_dir, start = Path(cfg.run.dir), int(state.step)
    step_fn = make_train_step(
        run.loss_fn, run.tx, run.plan, run.prec, grad_accum=cfg.parallel.grad_accum
    )
    batches = stream.device_batches(
        run.latents,
        run.train_rows,
        tcfg.batch_size,
        tcfg.seed,
        start,
        tcfg.steps,
        run.plan.batch_sharding(),
        prefetch=cfg.fusemix.prefetch,
    )
    losses: dict[int, float] = {}
    last: dict[str, float] = {}
    columns = [
        TextColumn("training"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeRemainingColumn(),
        TextColumn("{task.fields[loss]}", table_column=Column(no_wrap=True)),
    ]
    t0 = time.perf_counter()
    sinks = loggers.open_sinks(cfg, run_dir, start, resumed=start > 0)
    # The bar in a terminal; otherwise (piped, or run.progress=false) a plain line per log step.
    plain = not (show and console.is_terminal)
    bar = Progress(*columns, console=console, disable=plain, transient=True)
    try:
        bar.start()
        task = bar.add_task("train", total=tcfg.steps, completed=start, loss="")
        for step, batch in zip(range(start + 1, tcfg.steps + 1), batches):
            state, metrics = step_fn(state, batch)
            # The first step is always recorded, so the plot starts at the starting loss.
            if step % tcfg.log_every == 0 or step in (1, tcfg.steps):
                m = {k: float(v) for k, v in jax.device_get(metrics).items()}
                losses[step] = m["loss"]
                rate = (step - start) / (time.perf_counter() - t0)
                _log(run_dir, {"step": step, **m, "steps_per_s": rate}, sinks)
                bar.update(task, loss=f"loss {m['loss']:.3f}")
                if plain:
                    _say(console, _step_text(step, tcfg.steps, m, rate))
            bar.update(task, completed=step)
            if (tcfg.eval_every and step % tcfg.eval_every == 0) or step == tcfg.steps:
                last = evaluate(run, state)
                _log(run_dir, {"step": step, **last}, sinks)
                _say(console, f"step {step}:  {_recall_text(last)}")
                _draw(cfg, run_dir)
            if (cfg.checkpoint.every and step % cfg.checkpoint.every == 0) or step == tcfg.steps:
                checkpoints.save(step, state, {"step": step, "seed": tcfg.seed})
    finally:
        bar.stop()
        for sink in sinks:
            sink.close()
    return state, losses, last
