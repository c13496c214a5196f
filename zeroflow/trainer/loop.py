"""The training loop: ``train(cfg)`` runs (or resumes) a run described by a Config."""

from __future__ import annotations

import contextlib
import dataclasses
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jax

from zeroflow.backend import accelerators
from zeroflow.config.io import save_config
from zeroflow.config.schema import Config
from zeroflow.data import RecordData, TokenData, train_batch
from zeroflow.engine import frozen as frozen_weights
from zeroflow.engine import quantized
from zeroflow.engine.distributed import InLockstep, StopVote
from zeroflow.models.spec import run_spec
from zeroflow.trainer import adapters, loggers, optim, recovery, run_folder, sizes
from zeroflow.trainer.checkpoints import RunCheckpoints
from zeroflow.trainer.checkpoints import checkpoints_dir as checkpoint_folder
from zeroflow.trainer.divergence import Diverged, Divergence, Health, Monitor, TrainingDiverged
from zeroflow.trainer.evaluate_only import evaluate_only
from zeroflow.trainer.evaluation import TrainResult, eval_text, make_eval
from zeroflow.trainer.recovery import Position
from zeroflow.trainer.reporting import Reporter
from zeroflow.trainer.setup import Run, build_run

__all__ = ["TrainingDiverged", "train"]


@contextlib.contextmanager
def _stop_on_signals() -> Iterator[list[int]]:
    """SIGTERM/SIGINT set a flag; the loop saves a checkpoint and returns at the next step."""
    caught: list[int] = []
    previous = {}

    def handler(signum, _frame):
        caught.append(signum)

    for sig in (signal.SIGTERM, signal.SIGINT):
        try:
            previous[sig] = signal.signal(sig, handler)
        except ValueError:  # not the main thread (e.g. some notebook runners): no handler
            pass
    try:
        yield caught
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


def _train_loader(run: Run):
    """A Grain iterator of this process's packed training batches (None for token streams)."""
    if not isinstance(run.data, RecordData):  # token streams are drawn per step instead
        return None
    return iter(
        run.data.train_batches(
            batch_size=run.cfg.train.batch_size // jax.process_count(),
            seed=run.cfg.train.seed,
            process_index=jax.process_index(),
            process_count=jax.process_count(),
        )
    )


def _host_metrics(metrics) -> dict[str, float]:
    return {k: float(v) for k, v in jax.device_get(metrics).items()}


def train(cfg: Config, *, progress: bool | None = None) -> TrainResult:
    """Train (or resume) the run in ``cfg.run.dir``; returns losses and the last evaluation.

    Everything that can refuse the run (the config against the folder's run, the data, the
    model's initial weights, the checkpoint) is checked before the folder is written to. The
    folder is held by this trainer alone for the run's life (``run_folder.claim``); a run that
    fails before its first step leaves the folder as it found it."""
    loggers.check_installed(cfg)
    sizes.check_fits(cfg)
    sizes.check_backend(cfg)
    if cfg.train.eval_only:  # reads the run folder like sample does: no claim, nothing written
        return evaluate_only(cfg)
    run_dir = Path(cfg.run.dir)
    with run_folder.claim(run_dir, holder=jax.process_index() == 0) as held:
        return _train_held(cfg, run_dir, held, progress)


def _train_held(cfg: Config, run_dir: Path, held, progress) -> TrainResult:
    previous = run_folder.previous_config(run_dir)
    checkpoints_dir = checkpoint_folder(cfg, run_dir)
    if checkpoints_dir.is_dir() and any(p.name.isdigit() for p in checkpoints_dir.iterdir()):
        run_folder.check_same_model(run_dir, previous, cfg)
    run = build_run(cfg)
    loader = _train_loader(run)
    checkpoints = RunCheckpoints(
        checkpoints_dir,
        cfg.checkpoint.keep,
        with_loader=loader is not None,
        allow_unverified=cfg.checkpoint.allow_unverified,
        keep_every=cfg.checkpoint.keep_every,
        async_save=cfg.checkpoint.async_save,
    )
    if held is not None:  # a run that fails before a complete checkpoint is undone
        checkpoints.when_complete = held.started
    state, meta = _restored_or_fresh(run, checkpoints, loader)
    checkpoints.check_writable()
    resumed = meta is not None
    health = Health.from_meta(meta) if resumed else Health()
    start = int(state.step)
    if (
        start == cfg.train.steps
        and cfg.train.eval_batches > 0
        and not run_folder.final_eval_recorded(run_dir, start)
    ):
        return _final_eval_only(run, state, checkpoints, held, progress)
    if start >= cfg.train.steps:
        checkpoints.close()
        if jax.process_index() == 0:
            print(
                f"{run_dir}: the checkpoint is at step {start}, train.steps is {cfg.train.steps}: "
                "nothing to do (raise train.steps to train on)"
            )
        return TrainResult(run_dir=run_dir, step=start, losses={}, eval={})
    if resumed:
        run_folder.announce_schedule_change(previous, cfg, int(state.applied))
    # Checked: from here on the folder is written to.
    run_dir.mkdir(parents=True, exist_ok=True)
    if jax.process_index() == 0:
        with run_folder.writing(run_dir / run_folder.CONFIG_FILE):
            save_config(cfg, run_dir / run_folder.CONFIG_FILE)
    with run_folder.writing(run_dir / "metrics.jsonl"):
        reporter = _reporter(run, start, progress, resumed=resumed, rollbacks=health.rollbacks)
    if resumed:
        reporter.print(f"resumed from step {start} ({checkpoints.directory})")
    reporter.print(_banner(run, state))
    # A resumed run goes on at the rate its rollbacks set (the state's layout is the same).
    position = Position(run.with_lr_factor(health.lr_factor), state, health, loader)
    del state
    failing = True
    # The handler covers the closing too: a signal while the last checkpoint is written waits
    # for it instead of ending the process half-way.
    with _stop_on_signals() as caught:
        try:
            state, losses, last_eval, stopped_by = _train_steps(
                position,
                checkpoints,
                reporter,
                caught,
            )
            failing = False
        except TrainingDiverged:
            if held is not None:  # its metrics say what diverged: kept, even without a checkpoint
                held.started()
            raise
        finally:
            reporter.close(failing=failing)
            checkpoints.close()
        if stopped_by is None and caught:  # came while the run was closing: say so
            stopped_by = signal.Signals(caught[0]).name
            if jax.process_index() == 0:
                print(
                    f"{stopped_by}: the run had finished; its last checkpoint is step {int(state.step)}"
                )
    return TrainResult(
        run_dir=run_dir, step=int(state.step), losses=losses, eval=last_eval, stopped_by=stopped_by
    )


def _reporter(run: Run, start: int, progress, *, resumed: bool, rollbacks: int = 0) -> Reporter:
    """The run's progress bar, metrics file and plot, from ``start`` on."""
    cfg, par = run.cfg, run.cfg.parallel
    device = accelerators.of_kind(jax.devices()[0].device_kind)
    spec = run_spec(
        dataclasses.replace(cfg, model=run.model_cfg),
        num_devices=max(jax.device_count() // (par.model * par.context), 1),
        target=device.name if device else None,
    )
    return Reporter(
        Path(cfg.run.dir),
        cfg.train.steps,
        start,
        progress=cfg.run.progress if progress is None else progress,
        cfg=cfg,
        spec=spec,
        num_devices=jax.device_count(),
        resumed=resumed,
        rollbacks=rollbacks,
    )


def _final_eval_only(run: Run, state, checkpoints: RunCheckpoints, held, progress) -> TrainResult:
    """The run's steps are done but its final evaluation was never recorded (the run was killed
    during it): run that evaluation alone and record it."""
    run_dir, end = Path(run.cfg.run.dir), int(state.step)
    checkpoints.close()
    reporter = _reporter(run, end, progress, resumed=True)
    try:
        reporter.print(
            f"{run_dir}: step {end} is trained; running its final evaluation, "
            "which was not recorded"
        )
        last_eval = make_eval(run)(state)
        if held is not None:
            held.started()
        if last_eval:
            reporter.write(end, last_eval)
            reporter.print(f"final: {eval_text(last_eval)}")
    finally:
        reporter.close()
    return TrainResult(run_dir=run_dir, step=end, losses={}, eval=last_eval)


def _restored_or_fresh(run: Run, checkpoints: RunCheckpoints, loader):
    """``(state, meta)``: the latest checkpoint's state (and loader position) and meta, else a
    fresh state and None; the checkpoints are closed when either fails."""
    try:
        state = run.init_state()
        restored = checkpoints.restore_latest(state, loader)
    except BaseException:
        checkpoints.close()
        raise
    return (state, None) if restored is None else restored


def _banner(run: Run, state) -> str:
    trained, frozen = frozen_weights.count(
        quantized.as_weights(state.trainable, False), quantized.as_weights(state.params)
    )
    params = (
        adapters.banner(run.lora, trained, frozen, run.model_cfg.lora.quantize)
        if run.lora is not None
        else f"params: {trained:,} trained" + (f", {frozen:,} frozen" if frozen else "")
    )
    return (
        f"{run.data.summary() if run.data else ''}  {params}"
        + f"  mesh: {dict(run.plan.mesh.shape)}  "
        f"ZeRO stage {run.plan.stage}  precision: {run.prec.summary}"
    )


def _batches(run: Run, loader, data_offset: int):
    """``batch_for(step)``: the global batch of a step, from the packed-records loader (it knows
    the step, and past the batches rollbacks skipped) or drawn from the token data for that
    step (moved on by ``data_offset`` skipped batches) and this process."""
    cfg = run.cfg
    tokens = run.data if isinstance(run.data, TokenData) else None

    def batch_for(step: int):
        if loader is not None:
            return run.global_batch(next(loader))
        if tokens is None:
            raise ValueError("this run has no token data to draw training batches from")
        local = train_batch(
            tokens.train,
            step + data_offset,
            global_batch=cfg.train.batch_size,
            seq_len=cfg.model.seq_len,
            seed=cfg.train.seed,
            process_index=jax.process_index(),
            process_count=jax.process_count(),
        )
        return run.global_batch(local)

    return batch_for


def _recorder(run: Run, reporter: Reporter, monitor: Monitor, losses: dict):
    """``finish_step(step, metrics, seconds)``: a step's metrics fetched, judged (a diverging
    step raises ``Diverged``), derived rates added, and reported."""
    cfg = run.cfg
    learning_rate = optim.lr_schedule(cfg.train, run.lr_factor)
    tokens_per_step = cfg.train.batch_size * cfg.model.seq_len

    def finish_step(step: int, metrics, seconds: float):
        m: dict[str, Any] = _host_metrics(metrics)  # and derived rates, "mfu" None when unknown
        monitor.check(step, m)
        losses[step] = m["loss"]
        m["step_time"] = seconds
        m["mfu"] = reporter.mfu(tokens_per_step / max(seconds, 1e-9))
        if "trained_tokens" in m:  # packed records: count only the tokens the loss trains on
            # (the loss reports the mean over devices and micro-batches of their counts).
            m["trained_tokens"] = round(
                m["trained_tokens"] * run.plan.batch_split * cfg.parallel.grad_accum
            )
        m["tokens_per_s"] = m.get("trained_tokens", tokens_per_step) / max(seconds, 1e-9)
        # The rate the schedule gave this step's update: optax's count, i.e. the updates applied
        # before it (skipped steps do not advance it).
        m["lr"] = float(learning_rate(int(m["applied"]) - 1 + int(m["skipped"])))
        reporter.step(step, m, log_line=step % cfg.train.log_every == 0 or step == cfg.train.steps)

    return finish_step


def _train_steps(
    position: Position,
    checkpoints: RunCheckpoints,
    reporter: Reporter,
    caught,
):
    """Steps from the position's step to ``train.steps``, with evaluations and checkpoints on
    their schedules; a caught signal saves and stops at the same step on every process; a
    diverging step stops the run or rolls it back (``zeroflow.trainer.recovery``).
    Returns
    ``(state, losses, last evaluation, name of the stopping signal or None)``."""
    first = position.run
    evaluate, stop_vote = make_eval(first), StopVote(first.plan.mesh)
    step_fns: dict[float, object] = {}  # compiled once per learning-rate factor
    losses: dict[int, float] = {}
    while True:
        run = position.run
        if run.lr_factor not in step_fns:
            step_fns[run.lr_factor] = InLockstep(run.make_step(), f"step x{run.lr_factor}")
        segment = _Segment(
            run, step_fns[run.lr_factor], evaluate, checkpoints, reporter, stop_vote, losses
        )
        outcome = segment.train(position, caught)
        if not isinstance(outcome, Divergence):
            return outcome
        position = recovery.recover(
            outcome, position, checkpoints, reporter, lambda: _train_loader(first)
        )
        restored = position.state
        if restored is None:
            raise ValueError("recovery returned a position without a state")
        for step in [s for s in losses if s > int(restored.step)]:
            del losses[step]  # trained again from the restored step


class _Segment:
    """The steps a run trains from one position until it ends, stops or diverges."""

    def __init__(self, run, step_fn, evaluate, checkpoints, reporter, stop_vote, losses):
        self.run, self.step_fn, self.evaluate = run, step_fn, evaluate
        self.checkpoints, self.reporter, self.stop_vote = checkpoints, reporter, stop_vote
        self.losses = losses

    def train(self, position: Position, caught):
        """``(state, losses, last evaluation, stopping signal)``, or the ``Divergence`` that
        ended it (the segment's state is dropped with it; ``position.state`` is set to None)."""
        monitor = Monitor(position.health, self.run.cfg.train, self.run.prec)
        try:
            return self._steps(position, monitor, caught)
        except Diverged as e:
            return e.divergence

    def _steps(self, position: Position, monitor: Monitor, caught):
        state, position.state = position.state, None  # the loop holds the only reference
        if state is None:
            raise ValueError("a training segment needs a position with a state")
        run, reporter, checkpoints = self.run, self.reporter, self.checkpoints
        cfg, tcfg = run.cfg, run.cfg.train
        batch_for = _batches(run, position.loader, position.health.data_offset)
        finish_step = _recorder(run, reporter, monitor, self.losses)
        loader = position.loader

        def meta(s):
            return {"step": s, "seed": tcfg.seed, **monitor.health.to_meta()}

        last_eval: dict[str, float] = {}
        pending = None
        t_last = time.perf_counter()
        for step in range(int(state.step), tcfg.steps):
            state, metrics = self.step_fn(state, batch_for(step))
            # Fetch the previous step's metrics while this one runs: one step in flight.
            if pending is not None:
                finish_step(*pending)
            now = time.perf_counter()
            pending = (step + 1, metrics, now - t_last)
            t_last = now
            stop = self.stop_vote.cast(caught[0] if caught else 0)
            done = step + 1
            is_eval = tcfg.eval_every > 0 and done % tcfg.eval_every == 0 and done < tcfg.steps
            is_ckpt = cfg.checkpoint.every > 0 and done % cfg.checkpoint.every == 0
            if is_eval or is_ckpt or stop or done == tcfg.steps:
                jax.block_until_ready(state)
                finish_step(*pending)
                pending = None
                t_last = time.perf_counter()
            if is_eval:
                last_eval = self.evaluate(state)
                reporter.write(done, last_eval)
                reporter.print(f"step {done}: {eval_text(last_eval)}")
            if is_ckpt or stop:
                checkpoints.save(done, state, meta(done), loader)
            if stop:
                stopped_by = signal.Signals(stop).name
                reporter.print(
                    f"{stopped_by}: saved a checkpoint at step {done}; resume with the same command"
                )
                return state, self.losses, last_eval, stopped_by
        if pending is not None:
            finish_step(*pending)
        end = int(state.step)
        checkpoints.save(end, state, meta(end), loader)
        last_eval = self.evaluate(state)
        if last_eval:
            reporter.write(end, last_eval)
            reporter.print(
                f"final: train loss {self.losses.get(end, float('nan')):.4f}, "
                f"{eval_text(last_eval)}"
            )
        return state, self.losses, last_eval, None
