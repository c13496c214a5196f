"""Everything a run needs, built from a Config: data, model, mesh, plan, optimizer, state.
With ``model.lora.rank > 0`` the parameters are ``{"base", "lora"}`` (``trainer.adapters``);
with ``model.lora.quantize`` the base's matrices are ``zf.QuantizedArray`` leaves."""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import jax
import numpy as np
import optax

from zeroflow import backend
from zeroflow.autocast.precision import Precision
from zeroflow.config.io import CONFIG_KEYS
from zeroflow.config.schema import Config, ModelConfig
from zeroflow.data import RecordData, TokenData, load_data
from zeroflow.engine.grads.dequantized import dequantized_on_use
from zeroflow.engine.plan import ZeroPlan
from zeroflow.engine.plan_rules import batch_split_problem
from zeroflow.engine.quantized import quantize_frozen
from zeroflow.engine.state import TrainState, init_train_state, state_shardings
from zeroflow.engine.step import make_train_step
from zeroflow.lora import LoRA
from zeroflow.models import (
    LAYER_STACK,
    abstract_params,
    decay_mask,
    make_layerwise_loss_fn,
    param_init_fn,
)
from zeroflow.models.context import context_batch
from zeroflow.models.rules import gpt_tensor_rules
from zeroflow.trainer import adapters
from zeroflow.trainer.optim import make_optimizer
from zeroflow.trainer.parallel import mesh_of, plan_of
from zeroflow.util.tree import path_str


@dataclasses.dataclass
class Run:
    cfg: Config
    model_cfg: ModelConfig
    data: TokenData | RecordData | None
    plan: ZeroPlan
    prec: Precision
    tx: optax.GradientTransformation
    loss_fn: Any
    trainable: Any = None
    "``trainable=`` of ``zf.init_train_state`` from ``train.freeze`` (None: all train)."
    lora: LoRA | None = None
    "With ``model.lora.rank > 0``: ``loss_fn`` is its adapted loss, the base weights frozen."
    adapter_sites: Any = None
    "Where the adapted weights are read (``LoRA.sites``), found once when the run is built."
    decay_mask: Any = None
    "The optimizer's weight-decay mask (``make_optimizer``), kept to rebuild it at another rate."
    lr_factor: float = 1.0
    "What ``tx``'s learning-rate schedule is multiplied by (rollbacks lower it)."

    def with_lr_factor(self, factor: float) -> Run:
        """This run with its optimizer's schedule multiplied by ``factor`` (the state's layout
        is unchanged: a checkpoint of the run restores into it)."""
        if factor == self.lr_factor:
            return self
        tx = make_optimizer(self.cfg.train, self.decay_mask, lr_factor=factor)
        return dataclasses.replace(self, tx=tx, lr_factor=factor)

    @property
    def gather_per_layer(self) -> str | None:
        """The engine's ``gather_per_layer``: the GPT's layer stack (the model gathers each
        scanned layer itself, ``gather_layer``), or None: stage 3 fetches each weight on use
        (``zeroflow.engine.grads.gather_on_use``, which replays the layer scan one layer at a
        time). None with LoRA (the stack is no top-level key of the parameters) and where
        ``fp8_gathers_on_use`` holds."""
        if self.lora is not None or fp8_gathers_on_use(self.cfg):
            return None
        return LAYER_STACK

    def abstract_params(self):
        """Shapes of the parameters the engine trains (nothing allocated)."""
        shapes = abstract_params(self.model_cfg)[0]
        if self.lora is None:
            return shapes
        both = {adapters.BASE: shapes, adapters.ADAPTERS: jax.eval_shape(self._adapters)}
        return jax.eval_shape(self._quantized, both)

    def _quantized(self, params):
        """``params`` (or a function making them) with the frozen base quantized as
        ``model.lora.quantize`` says; as they are with ``none``."""
        kind = self.model_cfg.lora.quantize
        if self.lora is None or kind == "none":
            return params
        stack = f"{adapters.BASE}/{LAYER_STACK}"  # scanned: quantized and dequantized per layer
        return quantize_frozen(params, self.trainable, kind, stacked=stack)[0]

    def _adapters(self):
        return adapters.init_adapters(self.lora, self.adapter_sites, self.cfg.train.seed)

    def _with_adapters(self, base):
        if self.lora is None:
            return base
        return {adapters.BASE: base, adapters.ADAPTERS: self._adapters()}

    @property
    def _quantizes_base(self) -> bool:
        return self.lora is not None and self.model_cfg.lora.quantize != "none"

    def _read_base(self):
        """The weights of ``model.init_from``, each leaf read straight into its shards; with
        ``model.lora.quantize`` each matrix quantized as it is read, one tensor at a time, so
        the model in fp32 is never whole (``zeroflow.hf.quantized_load``)."""
        from zeroflow import hf

        path = self.model_cfg.init_from
        if self._quantizes_base:
            shardings = self.plan.compute_shardings(self.abstract_params()[adapters.BASE])
            kind = self.model_cfg.lora.quantize
            return hf.load_params(path, self.model_cfg, shardings=shardings, quantize=kind)
        # Shardings for the parameters' own shapes (a leaf ZeRO pads is read whole and padded
        # by init_train_state).
        shardings = self.plan.storage_shardings(abstract_params(self.model_cfg)[0])
        return hf.load_params(path, self.model_cfg, shardings=shardings)

    def init_state(self) -> TrainState:
        """A fresh sharded state; parameters are created (or, with ``model.init_from``, read
        from the Hugging Face checkpoint) directly in their shards. Under delayed FP8 scaling
        it carries the first step's amax histories (a restore target reads the saved ones)."""
        return self._with_fp8(self._fresh_params_state())

    def _with_fp8(self, state: TrainState) -> TrainState:
        """``state`` with the FP8 state of this run's step (``fp8_scaling=delayed``), whose
        sites are found by tracing the step on the batch's shapes; else ``state``."""
        if not self.prec.delayed_fp8:
            return state
        batch = abstract_batch(self.cfg, self.plan.batch_sharding)
        return self.make_step().with_fp8_state(state, batch)

    def _fresh_params_state(self) -> TrainState:
        if self.model_cfg.init_from:
            params = self._read_base()
            if self.lora is not None:  # the adapters made apart: the base is not copied
                params = {adapters.BASE: params, adapters.ADAPTERS: jax.jit(self._adapters)()}
            return init_train_state(
                params if self._quantizes_base else self._quantized(params),
                self.tx,
                self.plan,
                self.prec,
                rng=self.dropout_key(),
                trainable=self.trainable,
            )
        return self._random_state()

    def dropout_key(self) -> jax.Array | None:
        """The state's rng when the model (or its LoRA adapters) has dropout: the engine
        derives every step's, device's and micro-batch's key from it, so a resumed run draws
        what it would have."""
        lora = self.model_cfg.lora
        if self.model_cfg.dropout <= 0 and (lora.rank == 0 or lora.dropout <= 0):
            return None
        return jax.random.fold_in(jax.random.key(self.cfg.train.seed), DROPOUT_STREAM)

    def _random_state(self) -> TrainState:
        init = param_init_fn(self.model_cfg)
        rng = jax.random.key(self.cfg.train.seed)
        return init_train_state(
            self._quantized(lambda: self._with_adapters(init(rng))),
            self.tx,
            self.plan,
            self.prec,
            rng=self.dropout_key(),
            trainable=self.trainable,
        )

    def abstract_state(self) -> TrainState:
        """Shapes and shardings of the state, with nothing allocated (restore targets)."""
        shapes = jax.eval_shape(self._random_state)
        shardings = state_shardings(
            self.abstract_params(),
            self.tx,
            self.plan,
            self.prec,
            rng=self.dropout_key(),
            trainable=self.trainable,
        )
        state = jax.tree.map(
            lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), shapes, shardings
        )
        state = self._with_fp8(state)
        if state.fp8 is None:
            return state
        fp8 = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state.fp8
        )
        return dataclasses.replace(state, fp8=fp8)

    def make_step(self, compiler_options: dict | None = None):
        """The train step; ``compiler_options``: XLA options over the backend's own (a planner
        compiling many plans for one GPU target passes it a shared kernel cache)."""
        return make_train_step(
            self.loss_fn,
            self.tx,
            self.plan,
            self.prec,
            grad_accum=self.cfg.parallel.grad_accum,
            gather_per_layer=self.gather_per_layer,
            compiler_options=compiler_options,
        )

    def global_batch(
        self, local: np.ndarray | dict[str, np.ndarray], *, balanced: bool = True
    ) -> dict[str, jax.Array]:
        """This process's rows of the batch (token windows, or a packed batch's dict) -> global
        arrays sharded over ``data`` (and their sequence over ``context``, as the step takes
        them: ``context_batch``; ``balanced=False`` keeps the tokens in order, for a loss
        computed outside the step)."""
        local = local if isinstance(local, dict) else {"tokens": local}
        if self.plan.context_size > 1:
            strategy = self.model_cfg.context_attention
            local = context_batch(local, self.plan.context_size, strategy, balanced=balanced)
        return {
            k: jax.make_array_from_process_local_data(self.plan.batch_sharding(np.ndim(v)), v)
            for k, v in local.items()
        }


PACKED_FIELDS = ("tokens", "targets", "loss_mask", "segment_ids", "positions")
"A packed batch's arrays (``zeroflow.data.packing.model_batch``), each int32 [batch, seq_len]."


def abstract_batch(cfg: Config, sharding=None) -> dict[str, jax.ShapeDtypeStruct]:
    """Shapes of one global training batch of ``cfg``: token windows [B, S + 1], or with a
    records ``data.format`` or a context axis (``context_batch``) the packed arrays [B, S]
    (what memory estimates compile with). ``sharding``: one for all, or a function of a
    leaf's number of dimensions (``ZeroPlan.batch_sharding``)."""
    b, s = cfg.train.batch_size, cfg.model.seq_len
    if callable(sharding):
        return {
            k: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding(len(x.shape)))
            for k, x in abstract_batch(cfg).items()
        }
    if cfg.data.format == "stream" and cfg.parallel.context <= 1:
        return {"tokens": jax.ShapeDtypeStruct((b, s + 1), np.int32, sharding=sharding)}
    return {k: jax.ShapeDtypeStruct((b, s), np.int32, sharding=sharding) for k in PACKED_FIELDS}


def fp8_gathers_on_use(cfg: Config) -> bool:
    """Whether the GPT's stage-3 weights are fetched on use because its FP8 matmuls can then
    read the all-gathered e4m3 weights directly (``zeroflow.engine.zeropp.fp8_dot``: no
    elementwise dequantize and cast again of each gathered weight, forward and backward):
    ``parallel.quantize_weights=fp8`` with ``precision.autocast=fp8`` (tensor or delayed
    scaling), ``model.remat=full`` (its layer inputs in the compute dtype, no layer or MLP
    chunks), no offload, hpZ, tensor or context axis.

    Limited to what was compiled for 8 x H100 (XLA:GPU's estimate, experiments/results/fp8.md,
    "The trainer's GPT"): gpt-1b and a Llama-3.1-8B-shaped config with remat full take
    2.6-8.2% less estimated step time at a peak within 0.4%. Under ``save_dots`` the step is
    faster too, but with delayed scaling and 2 micro-batches gpt-1b's peak grew 40%; with the
    optimizer offloaded 3.2% (delayed scaling) for a 1.3% shorter step. The other settings
    were not measured and keep the per-layer route."""
    par, prec = cfg.parallel, cfg.precision
    return (
        par.zero_stage == 3
        and par.quantize_weights == "fp8"
        and prec.autocast == "fp8"
        and prec.fp8_scaling in ("tensor", "delayed")
        and cfg.model.remat == "full"
        and cfg.model.remat_dtype == "compute"
        and cfg.model.layer_chunk == 0
        and cfg.model.mlp_chunk == 0
        and par.offload == "none"
        and not par.hierarchical
        and par.model == 1
        and par.context == 1
    )


DROPOUT_STREAM = 1
"Folded into the seed's key for the dropout key, apart from the parameter initialisation's."


def lm_loss_fn(model_cfg: ModelConfig):
    """The engine's ``loss_fn(params, batch, gather_layer=None, *, rng=None)``;
    ``gather_layer`` lets ZeRO-3 gather one scanned layer at a time. The engine passes ``rng``
    (one key per step, device and micro-batch) when the state carries one, i.e. with dropout;
    evaluation passes none and so runs without dropout."""
    loss = make_layerwise_loss_fn(model_cfg)

    def lm_loss(params, batch, gather_layer=None, *, rng=None):
        return loss(params, batch, gather_layer, rng)

    return lm_loss


def run_model_config(cfg: Config) -> ModelConfig:
    """``cfg.model``, or with ``model.init_from`` the checkpoint's architecture (config.json)
    with this run's seq_len, remat, attention, dropout, loss and MLP chunks and LoRA adapters."""
    if not cfg.model.init_from:
        return cfg.model
    from zeroflow import hf

    architecture = hf.with_run_fields(hf.read_config(cfg.model.init_from).model, cfg.model)
    return dataclasses.replace(architecture, lora=cfg.model.lora)


def _load_data(cfg: Config):
    """The run's data; a file or folder the OS refuses (another user's) named with what to do."""
    try:
        return load_data(cfg.data, cfg.model.seq_len)
    except PermissionError as e:
        if not e.filename:
            raise
        raise PermissionError(
            f"data.source {cfg.data.source}: {e.filename} cannot be read ({e.strerror}); "
            "check its permissions, or copy the data somewhere this user can read"
        ) from None


def build_run(cfg: Config, *, with_data: bool = True, devices=None, mesh=None, traits=None) -> Run:
    """``devices``: the devices the mesh spans (default: all); ``mesh``: a mesh to plan on
    instead (``zf.planning_mesh`` for memory estimates, ``zf.target_mesh`` to compile for GPUs
    this machine has not); ``traits``: the backend the plan shapes the step for, when not the
    mesh's own (``zeroflow.memory.on_target``)."""
    model_cfg = run_model_config(cfg)
    data = _load_data(cfg) if with_data else None
    if data is not None and model_cfg.init_from:
        from zeroflow import hf

        hf.check_tokenizer(
            data.tokenizer, model_cfg.vocab_size, model_cfg.init_from, "data.tokenizer"
        )
    if data is not None and data.vocab_size != model_cfg.vocab_size and not model_cfg.init_from:
        model_cfg = dataclasses.replace(model_cfg, vocab_size=data.vocab_size)
    par = cfg.parallel
    mesh = mesh if mesh is not None else mesh_of(par, devices)
    rules = gpt_tensor_rules(model_cfg, mesh.shape["model"]) if mesh.shape["model"] > 1 else ()
    if model_cfg.lora.rank > 0:
        rules = adapters.base_rules(rules)
    plan = plan_of(par, mesh, tensor_rules=rules, traits=traits)
    prec = Precision.from_config(cfg.precision)
    batch_problem = batch_split_problem(
        cfg.train.batch_size, par.grad_accum, plan.batch_split, CONFIG_KEYS
    )
    if batch_problem:
        raise ValueError(batch_problem)
    shapes, _ = abstract_params(model_cfg)
    loss_fn = lm_loss_fn(model_cfg)
    lora = adapters.make_lora(loss_fn, model_cfg.lora, shapes)
    sites = None
    if lora is None:
        trainable = freeze_rule(cfg.train.freeze, shapes)
    else:  # train.freeze is refused with LoRA (config_io): the adapters alone train
        trainable, loss_fn = adapters.trains_adapters, lora.loss
        # Traced for the plan's devices (abstract GPUs in a plan for a target), as the step is:
        # the attention's own checks (cuDNN needs a GPU) ask the traits of the devices traced for.
        with backend.tracing_for(plan.traits):
            sites = adapters.adapter_sites(lora, shapes, abstract_batch(cfg), prec.compute_dtype)
        if model_cfg.lora.quantize != "none":  # evaluation reads the quantized base too
            loss_fn = dequantized_on_use(loss_fn, prec.compute_dtype)
    # With frozen leaves the optimizer sees the trainable ones only: the decay mask is then
    # computed from what it is given.
    mask = decay_mask if trainable else decay_mask(shapes)
    tx = make_optimizer(cfg.train, mask)
    return Run(
        cfg=cfg,
        model_cfg=model_cfg,
        data=data,
        plan=plan,
        prec=prec,
        tx=tx,
        loss_fn=loss_fn,
        trainable=trainable,
        lora=lora,
        adapter_sites=sites,
        decay_mask=mask,
    )


def freeze_rule(pattern: str, shapes):
    """``trainable=`` for ``train.freeze``: a leaf whose path matches ``pattern`` is frozen;
    None when nothing is to be frozen. A pattern that matches no parameter, or every one, is
    a ValueError naming some paths."""
    if not pattern:
        return None
    paths = [path_str(p) for p, _ in jax.tree_util.tree_leaves_with_path(shapes)]
    hits = [p for p in paths if re.search(pattern, p)]
    if not hits:
        raise ValueError(
            f"train.freeze={pattern!r} matches no parameter; paths look like {', '.join(paths[:4])}"
        )
    if len(hits) == len(paths):
        raise ValueError(
            f"train.freeze={pattern!r} matches every parameter: nothing would "
            f"train; paths look like {', '.join(paths[:4])}"
        )
    return lambda path, _leaf: re.search(pattern, path) is None
