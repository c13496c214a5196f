"""What the planner plans: ``ModelProblem`` (``zf.plan``: any JAX loss, compiled with
``zf.make_train_step``) and ``ConfigProblem`` (a trainer config: each plan is the config with
``section.key=value`` overrides, compiled as the trainer builds its step, so the overrides the
planner writes are the ones it compiled). Each gives its compile, its run (a ``RunSpec``) and the
model FLOPs its MFU counts."""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

from zeroflow.autocast.precision import DTYPES
from zeroflow.config.io import apply_overrides
from zeroflow.engine.frozen import trainable_mask
from zeroflow.engine.plan import ZeroPlan
from zeroflow.memory.estimate import DTYPE_BYTES
from zeroflow.memory.measure import compile_step, itemsize
from zeroflow.memory.spec import RunSpec
from zeroflow.models.spec import activations, offloaded_activations, run_spec
from zeroflow.planner.choices import Choice
from zeroflow.planner.where import Where
from zeroflow.trainer.planning import compile_config, count_frozen_params, trace_config
from zeroflow.trainer.setup import run_model_config


class ModelProblem:
    """``zf.plan``'s problem (see ``zeroflow.planner.library.plan``)."""

    def __init__(self, loss_fn, params, batch, tx, prec, *, tokens_per_example=None, **step):
        """``step``: ``compile_step``'s ``trainable`` and ``gather_per_layer``."""
        self.loss_fn, self.params, self.batch, self.tx, self.prec = loss_fn, params, batch, tx, prec
        self.step, self.tokens_per_example = step, tokens_per_example
        trainable = step.get("trainable")
        leaves = jax.tree.leaves(batch)
        if not leaves or not np.shape(leaves[0]):
            raise ValueError("zf.plan: batch must hold arrays with a leading batch dimension")
        self.batch_size = int(np.shape(leaves[0])[0])
        total = sum(math.prod(np.shape(x)) for x in jax.tree.leaves(params))
        frozen, frozen_bytes = _frozen(params, trainable, DTYPE_BYTES[prec.params])
        # 6 FLOPs per trained parameter and token, 4 per frozen one (no weight gradient), as
        # ``zeroflow.models.flops_per_token`` counts them.
        self.spec = RunSpec(
            params,
            precision=prec.params,
            optimizer=_optimizer_bytes(tx, params, total),
            frozen_params=frozen,
            frozen_bytes=frozen_bytes,
            flops_per_token=6.0 * (total - frozen) + 4.0 * frozen,
            tokens_per_step=self.batch_size * (tokens_per_example or 1),
        )
        self.title = f"{total:,} params, batch {self.batch_size}"
        if step.get("gather_per_layer") is None:  # else loss_fn(params, batch, gather_layer)
            _check_traces(loss_fn, params, batch, prec.params)

    def compile(self, choice: Choice, where: Where, options: dict):
        plan = ZeroPlan(where.mesh(), **choice.plan_settings())
        prec = dataclasses.replace(self.prec, autocast=choice.autocast or self.prec.autocast)
        args = (self.loss_fn, self.params, self.batch, self.tx, plan, prec)
        return compile_step(
            *args, grad_accum=choice.grad_accum, compiler_options=options, **self.step
        )

    def fp8_problem(self) -> str | None:
        """Why the precision cannot take FP8 matmuls (its own rule, one line), else None."""
        try:
            dataclasses.replace(self.prec, autocast="fp8")
        except ValueError as e:
            return str(e)
        return None

    def model_flops(self) -> float | None:
        """The run's FLOPs per token x tokens per step, when tokens per example are known."""
        if self.tokens_per_example is None:
            return None
        return self.spec.flops_per_token * self.spec.tokens_per_step

    def activations(self, choice: Choice, micro: int) -> tuple[float, float]:
        """A loss given as a function has no activation formula: the what-if counts its state."""
        return 0.0, 0.0

    def overrides(self, choice: Choice, devices: int) -> None:
        return None


def _check_traces(loss_fn, params, batch, compute: str) -> None:
    """Trace ``loss_fn`` once on abstract values (the weights in the compute dtype, as the step
    passes them): a loss that cannot trace is one error before anything is compiled, not the
    same failure in every plan's compile."""

    def cast(x):
        floating = jnp.issubdtype(x.dtype, jnp.floating)
        return jax.ShapeDtypeStruct(np.shape(x), DTYPES[compute] if floating else x.dtype)

    try:
        jax.eval_shape(loss_fn, jax.tree.map(cast, params), batch)
    except Exception as e:  # whatever the loss raised, said in one line
        first = (str(e).strip().splitlines() or [""])[0][:200]
        raise ValueError(
            f"zf.plan: loss_fn(params, batch) does not trace on the abstract params and batch "
            f"given: {type(e).__name__}: {first}"
        ) from None


def _frozen(params, trainable, width: int) -> tuple[int, int]:
    """``(elements, stored bytes)`` of the frozen leaves: a floating-point one is stored in the
    compute dtype (``width`` bytes), any other (a ``zf.quantize_frozen`` leaf's packed bytes)
    in its own."""
    if trainable is None:
        return 0, 0
    flags = jax.tree.leaves(trainable_mask(trainable, params))
    frozen = [x for x, keep in zip(jax.tree.leaves(params), flags, strict=True) if not keep]
    floating = lambda x: jnp.issubdtype(x.dtype, jnp.floating)  # noqa: E731
    stored = sum(
        math.prod(np.shape(x)) * (width if floating(x) else itemsize(x.dtype)) for x in frozen
    )
    return sum(math.prod(np.shape(x)) for x in frozen), stored


def _optimizer_bytes(tx, params, total: int) -> float:
    """The optimizer state's bytes per parameter, from its abstract ``init``."""
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), np.float32), params)
    state = jax.eval_shape(tx.init, abstract)
    nbytes = sum(math.prod(x.shape) * itemsize(x.dtype) for x in jax.tree.leaves(state))
    return nbytes / max(total, 1)


class ConfigProblem:
    """The trainer's GPT step of ``cfg`` (the config as loaded; ``model.init_from``'s
    architecture is read from its config.json). Its sizes and FLOPs are the config's
    ``RunSpec`` (``zeroflow.models.spec.run_spec``)."""

    def __init__(self, cfg, name: str = "config"):
        self.cfg, self.name = cfg, name
        self.model = run_model_config(cfg)
        own = dataclasses.replace(cfg, model=self.model)
        self.spec = run_spec(own, num_devices=1, frozen_params=count_frozen_params(own))
        self.batch_size = cfg.train.batch_size
        prec = self.spec.precision
        # What keeps two problems' compiles apart: their configs (the advice compiles the same
        # plan of a config with LoRA, and with LoRA on 4-bit weights).
        self.key = repr(cfg)
        self.title = (
            f"{name}: {self.spec.num_params:,} params, batch {cfg.train.batch_size} x "
            f"{cfg.model.seq_len} tokens, {prec}"
        )

    def own_choice(self, stage: int, offload: str, remat: str) -> Choice:
        """``stage``/``offload``/``remat`` with everything else as the config says."""
        par = self.cfg.parallel
        update_on = par.update_on if offload != "none" else "device"
        qw, qg = (None if q == "none" else q for q in (par.quantize_weights, par.quantize_grads))
        return Choice(
            stage, offload, update_on, par.grad_accum, remat, None, qw, qg, par.hierarchical
        )

    def overrides(self, choice: Choice, devices: int) -> list[str]:
        """The config keys that make ``choice`` on ``devices`` data devices
        (``model.remat_dtype`` where it keeps FP8 residuals or the config's differs,
        ``precision.autocast`` with FP8 matmuls)."""
        out = [
            f"parallel.data={devices}",
            f"parallel.zero_stage={choice.stage}",
            f"parallel.offload={choice.offload}",
            f"parallel.update_on={choice.update_on}",
            f"parallel.grad_accum={choice.grad_accum}",
            f"parallel.quantize_weights={choice.quantize_weights or 'none'}",
            f"parallel.quantize_grads={choice.quantize_grads or 'none'}",
            f"parallel.hierarchical={str(choice.hierarchical).lower()}",
        ]
        if choice.remat is not None:
            out.append(f"model.remat={choice.remat}")
        if choice.fp8_residuals() or choice.remat_dtype not in (None, self.model.remat_dtype):
            out.append(f"model.remat_dtype={choice.remat_dtype}")
        if choice.attention is not None:
            out.append(f"model.attention={choice.attention}")
        return out + [f"precision.autocast={choice.autocast}"] * bool(choice.autocast)

    def fp8_problem(self) -> str | None:
        """Why the config cannot take FP8 matmuls (its own rule, one line), else None."""
        try:
            apply_overrides(self.cfg, ["precision.autocast=fp8"])
        except ValueError as e:
            return str(e)
        return None

    def compile(self, choice: Choice, where: Where, options: dict):
        cfg, args = self._step_of(choice, where)
        compiled, setup = compile_config(cfg, **args, compiler_options=options)
        return compiled, setup.state

    def trace(self, choice: Choice, where: Where):
        """The instant estimate of the step ``compile`` compiles (``StepEstimate``)."""
        cfg, args = self._step_of(choice, where)
        return trace_config(cfg, **args)

    def _step_of(self, choice: Choice, where: Where) -> tuple:
        """The config of ``choice`` at ``where`` and ``compile_config``'s keywords for it."""
        cfg = apply_overrides(self.cfg, self.overrides(choice, where.devices))
        return cfg, dict(
            num_devices=where.devices,
            remat=cfg.model.remat,
            stage=choice.stage,
            offload=choice.offload,
            update_on=choice.update_on,
            target=None if where.local else where.name,
            hosts=where.hosts,
        )

    def model_flops(self) -> float:
        """The model's FLOPs per step, the RunSpec's (as the trainer's MFU counts them)."""
        return self.spec.flops_per_token * self.spec.tokens_per_step

    def activations(self, choice: Choice, micro: int) -> tuple[float, float]:
        """``(on the device, in host memory)``: the GPT's activation bytes per device of
        ``choice`` with ``micro`` examples per device (``zeroflow.models.spec``)."""
        model, prec = self._model_of(choice), self.spec.precision
        return (
            activations(model, micro_batch=micro, precision=prec),
            offloaded_activations(model, micro_batch=micro, precision=prec),
        )

    def _model_of(self, choice: Choice):
        keys = ("remat", "attention", "remat_dtype")
        return dataclasses.replace(
            self.model, **{k: getattr(choice, k) or getattr(self.model, k) for k in keys}
        )
