"""A trainer config as the planner's problem: each plan is the config with ``section.key=value``
overrides (``overrides``), compiled as the trainer builds its step
(``zeroflow.trainer.planning.compile_config``). The overrides the planner writes are the ones it
compiled, so ``python -m zeroflow.train --config X $(cat plan.overrides)`` runs that plan."""

from __future__ import annotations

import dataclasses

from zeroflow.config.io import apply_overrides
from zeroflow.models import flops_per_token
from zeroflow.models.spec import (
    activations,
    count_gpt_params,
    offloaded_activations,
    optimizer_bytes_per_param,
    stored_frozen_bytes_per_param,
)
from zeroflow.planner.choices import Choice
from zeroflow.planner.whatif import ModelFacts
from zeroflow.planner.where import Where
from zeroflow.trainer.planning import compile_config, count_frozen_params
from zeroflow.trainer.setup import run_model_config

"Attention kernels that keep per-row softmax statistics instead of the scores."


class ConfigProblem:
    """The trainer's GPT step of ``cfg`` (the config as loaded; ``model.init_from``'s
    architecture is read from its config.json)."""

    def __init__(self, cfg, name: str = "config"):
        self.cfg = cfg
        self.name = name
        self.model = run_model_config(cfg)
        params = count_gpt_params(self.model)
        self.facts = ModelFacts(
            params=params,
            tokens_per_step=cfg.train.batch_size * cfg.model.seq_len,
            batch_size=cfg.train.batch_size,
            compute_dtype=cfg.precision.params,
            frozen_params=count_frozen_params(dataclasses.replace(cfg, model=self.model)),
            frozen_bytes_per_param=stored_frozen_bytes_per_param(self.model, cfg.precision.params),
            optimizer_bytes=optimizer_bytes_per_param(self.model, cfg.train.optimizer),
            activations=self._activations,
            offloaded_activations=self._offloaded,
        )

    @property
    def key(self) -> str:
        """What tells two problems' compiles apart: their configs (the advice compiles the
        same plan of a config with LoRA, and with LoRA on 4-bit weights)."""
        return repr(self.cfg)

    @property
    def title(self) -> str:
        c = self.cfg
        return (
            f"{self.name}: {self.facts.params:,} params, batch {c.train.batch_size} x "
            f"{c.model.seq_len} tokens, {c.precision.params}"
        )

    def overrides(self, choice: Choice, devices: int) -> list[str]:
        """The config keys that make ``choice`` on ``devices`` data devices."""
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
        if choice.attention is not None:
            out.append(f"model.attention={choice.attention}")
        return out

    def config_for(self, choice: Choice, devices: int):
        return apply_overrides(self.cfg, self.overrides(choice, devices))

    def compile(self, choice: Choice, where: Where, options: dict):
        cfg = self.config_for(choice, where.devices)
        compiled, setup = compile_config(
            cfg,
            num_devices=where.devices,
            stage=choice.stage,
            offload=choice.offload,
            update_on=choice.update_on,
            remat=cfg.model.remat,
            target=None if where.local else where.name,
            hosts=where.hosts,
            compiler_options=options,
        )
        return compiled, setup.state

    def model_flops(self) -> float:
        """The model's FLOPs per step as the trainer's MFU counts them
        (``zeroflow.models.flops_per_token``: 6 x matmul weights + attention's) x tokens."""
        return flops_per_token(self.model) * self.facts.tokens_per_step

    def _model_of(self, choice: Choice):
        return dataclasses.replace(
            self.model,
            remat=choice.remat or self.model.remat,
            attention=choice.attention or self.model.attention,
        )

    def _activations(self, choice: Choice, micro: int) -> float:
        """The formula's activations (with a flash kernel, no attention scores: the formula
        leaves them out itself)."""
        model = self._model_of(choice)
        return activations(model, micro_batch=micro, precision=self.cfg.precision.params)

    def _offloaded(self, choice: Choice, micro: int) -> float:
        model = self._model_of(choice)
        return offloaded_activations(model, micro_batch=micro, precision=self.cfg.precision.params)
