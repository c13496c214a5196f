"""Load, override, validate and save the run configuration.

    cfg = load_config("configs/tiny.yaml", ["train.steps=100", "parallel.zero_stage=3"])

A YAML file fills the nested dataclasses of ``zeroflow.config``; ``section.key=value`` overrides
are applied on top; the result is validated. Any problem raises ``ConfigError`` with one readable
line that names the key, and for unknown keys lists the valid ones. Values are coerced from the
field's type, never guessed from the text: YAML reads ``3e-4`` as a string, and that is fine
for a float field; a float is refused for an int field.
"""

from __future__ import annotations

import argparse
import ast
import copy
import dataclasses
import difflib
import functools
import inspect
import math
import os
import re
import typing
from collections.abc import Mapping, Sequence
from typing import Any

import yaml

from zeroflow.config import schema as config_module
from zeroflow.config.schema import CHOICES, Config, ParallelConfig
from zeroflow.engine.plan_rules import (
    CONTEXT_CHUNKS,
    MODEL_KEYS,
    Keys,
    batch_split_problem,
    context_attention_problem,
    hierarchical_copy_problem,
    plan_problems,
    sequence_split_problem,
)
from zeroflow.util.limits import INT_LIMIT, SEED_MAX, STEP_MAX
from zeroflow.util.settings import FP8_REMATS, check_precision, parse_loss_scale

_TRUE = ("true", "1", "yes", "on")
_FALSE = ("false", "0", "no", "off")


class ConfigError(ValueError):
    """A configuration problem, described in one line."""

    def __init__(self, message: str):
        super().__init__(" ".join(str(message).splitlines()))


# --- schema -------------------------------------------------------------------------------------


def _sections() -> dict[str, type]:
    return {f.name: _hints(Config)[f.name] for f in dataclasses.fields(Config)}


@functools.cache
def _hints(cls: type) -> dict[str, type]:
    return typing.get_type_hints(cls)


def _fields(section_cls: type) -> dict[str, dataclasses.Field]:
    return {f.name: f for f in dataclasses.fields(section_cls)}


@functools.cache
def field_docs() -> dict[str, str]:
    """``{"train.steps": "Number of optimizer steps.", ...}``, from the docstrings in config.py."""
    tree = ast.parse(inspect.getsource(config_module))
    class_docs: dict[str, dict[str, str]] = {}
    for node in tree.body:
        if isinstance(node, ast.ClassDef):
            docs = class_docs.setdefault(node.name, {})
            for stmt, nxt in zip(node.body, node.body[1:]):
                if (
                    isinstance(stmt, ast.AnnAssign)
                    and isinstance(stmt.target, ast.Name)
                    and isinstance(nxt, ast.Expr)
                    and isinstance(nxt.value, ast.Constant)
                    and isinstance(nxt.value.value, str)
                ):
                    docs[stmt.target.id] = nxt.value.value
    return {key: class_docs.get(cls.__name__, {}).get(f.name, "") for key, cls, f in _leaves()}


def _is_section(typ) -> bool:
    """A nested section (``model.lora``): a field whose type is itself a config dataclass."""
    return isinstance(typ, type) and dataclasses.is_dataclass(typ)


def _leaves(cls: type = Config, prefix: str = ""):
    """``(dotted key, owning class, field)`` of every settable key, nested sections entered."""
    for f in dataclasses.fields(cls):
        key = f"{prefix}.{f.name}" if prefix else f.name
        typ = _hints(cls)[f.name]
        if _is_section(typ):
            yield from _leaves(typ, key)
        elif prefix:  # the top level holds sections only
            yield key, cls, f


def _get(cfg: Config, dotted: str) -> Any:
    for name in dotted.split("."):
        cfg = getattr(cfg, name)
    return cfg


def describe_config(cfg: Config | None = None) -> str:
    """Every key with its type, current value and doc, one per line (used by ``--help``)."""
    cfg = cfg or Config()
    lines = []
    for key, cls, f in _leaves():
        choices = f.metadata.get(CHOICES)
        kind = "|".join(map(str, choices)) if choices else _hints(cls)[f.name].__name__
        lines.append(f"  {f'{key}={_get(cfg, key)}':<32} ({kind}) {field_docs()[key]}")
    return "\n".join(lines)


def _unknown(
    what: str, name: str, valid: Sequence[str], *, section: str = "", where: str = ""
) -> ConfigError:
    prefix = f"{section}." if section else ""
    close = difflib.get_close_matches(name, valid, n=1)
    hint = f"; did you mean '{prefix}{close[0]}'?" if close else ";"
    scope = f"keys in {section}" if section else "sections"
    return ConfigError(
        f"unknown {what} '{prefix}{name}'{where}{hint} valid {scope}: {', '.join(valid)}"
    )


# --- coercion -----------------------------------------------------------------------------------


def _coerce(key: str, value: Any, typ: type, where: str) -> Any:
    """Turn a YAML value or a command-line string into ``typ``, or raise ConfigError."""

    def bad() -> ConfigError:
        shown = f"{value!r}" if isinstance(value, str) else f"{value!r} ({type(value).__name__})"
        hint = " (quote it in YAML)" if typ is str and isinstance(value, bool) else ""
        return ConfigError(f"{key}: expected {typ.__name__}, got {shown}{hint}{where}")

    if typ is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, int) and value in (0, 1):
            return bool(value)
        if isinstance(value, str) and value.strip().lower() in _TRUE + _FALSE:
            return value.strip().lower() in _TRUE
        raise bad()
    if typ is int:
        whole = None
        if isinstance(value, int) and not isinstance(value, bool):
            whole = value
        elif isinstance(value, str):
            try:
                whole = int(value.strip(), 10)
            except ValueError:
                pass
        if whole is None:
            raise bad()
        if not -INT_LIMIT <= whole < INT_LIMIT:
            raise ConfigError(
                f"{key}: {whole} is out of range: integers are 64-bit (at most "
                f"{INT_LIMIT - 1:,}){where}"
            )
        return whole
    if typ is float:
        if isinstance(value, bool):
            raise bad()
        if isinstance(value, (int, float)):
            number = float(value)
        elif isinstance(value, str):
            try:
                number = float(value.strip())
            except ValueError:
                raise bad() from None
        else:
            raise bad()
        if not math.isfinite(number):
            raise ConfigError(f"{key}: expected a finite float, got {value!r}{where}")
        return number
    if typ is str:
        if isinstance(value, str):
            return value
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return str(value)  # e.g. ``loss_scale: 1024`` in YAML
        raise bad()
    raise TypeError(f"config field {key} has unsupported type {typ!r}")


def _set(cfg: Config, dotted: str, value: Any, where: str) -> None:
    section, _, name = dotted.partition(".")
    sections = _sections()
    if section not in sections:
        bare = [k for k in field_docs() if k.endswith("." + section)] if not name else []
        if bare:  # ``steps=100``: point at ``train.steps``
            raise ConfigError(f"key '{dotted}'{where} needs its section; did you mean '{bare[0]}'?")
        raise _unknown("section", section, list(sections), where=where)
    _set_in(getattr(cfg, section), sections[section], section, name, value, where)


def _set_in(obj, cls: type, prefix: str, name: str, value: Any, where: str) -> None:
    """Set ``name`` (dotted below ``prefix``) of the section ``obj``; a nested section takes
    a mapping of its keys (YAML) or its own dotted keys (``model.lora.rank=8``)."""
    head, _, rest = name.partition(".")
    fields = _fields(cls)
    typ = _hints(cls)[head] if head in fields else None
    if typ is None or (rest and not _is_section(typ)):
        raise _unknown("key", name, list(fields), section=prefix, where=where)
    key = f"{prefix}.{head}"
    if not _is_section(typ):
        setattr(obj, head, _coerce(key, value, typ, where))
        return
    if rest:
        _set_in(getattr(obj, head), typ, key, rest, value, where)
    elif isinstance(value, Mapping):
        for sub, sub_value in value.items():
            _set_in(getattr(obj, head), typ, key, str(sub), sub_value, where)
    elif value is not None:
        keys = ", ".join(f"{key}.{k}" for k in _fields(typ))
        raise ConfigError(f"{key} is a section: set its keys ({keys}), got {value!r}{where}")


# --- building a Config --------------------------------------------------------------------------


def config_to_dict(cfg: Config) -> dict[str, dict[str, Any]]:
    """Nested plain dict of ``cfg`` (sections -> keys -> values), in field order."""
    return dataclasses.asdict(cfg)


def config_from_dict(
    data: Mapping[str, Any] | None, overrides: Sequence[str] = (), *, where: str = ""
) -> Config:
    """Build and validate a Config from nested ``{section: {key: value}}`` plus overrides."""
    cfg = Config()
    where_text = f" (in {where})" if where else ""
    if data is None:
        data = {}
    if not isinstance(data, Mapping):
        raise ConfigError(
            f"expected a mapping of sections at the top level{where_text}, "
            f"got {type(data).__name__}"
        )
    for section, values in data.items():
        if str(section) not in _sections():
            raise _unknown("section", str(section), list(_sections()), where=where_text)
        if values is None:
            continue
        if not isinstance(values, Mapping):
            raise ConfigError(
                f"section '{section}' must be a mapping of keys{where_text}, got {values!r}"
            )
        for name, value in values.items():
            _set(cfg, f"{section}.{name}", value, where_text)
    return validate_config(apply_overrides(cfg, overrides, validate=False))


def apply_overrides(cfg: Config, overrides: Sequence[str], *, validate: bool = True) -> Config:
    """A copy of ``cfg`` with ``section.key=value`` overrides applied (later ones win)."""
    if isinstance(overrides, str):
        overrides = [overrides]
    cfg = copy.deepcopy(cfg)
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep:
            raise ConfigError(
                f"override '{item}' is not of the form section.key=value (e.g. train.steps=100)"
            )
        _set(cfg, key.strip(), value, f" (in override '{item}')")
    return validate_config(cfg) if validate else cfg


def load_config(path: str | os.PathLike | None, overrides: Sequence[str] = ()) -> Config:
    """Read a YAML config (None = dataclass defaults), apply overrides, validate."""
    data: Any = None
    where = ""
    if path is not None:
        where = os.fspath(path)
        if not os.path.isfile(path):
            raise ConfigError(f"config file not found: {where}")
        try:
            with open(path, encoding="utf-8") as f:
                data = yaml.safe_load(f)
        except UnicodeDecodeError as e:
            raise ConfigError(
                f"config file {where} is not UTF-8 text (byte {e.start}); give a YAML file"
            ) from None
        except yaml.YAMLError as e:
            mark = getattr(e, "problem_mark", None)
            at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
            problem = getattr(e, "problem", None) or str(e)
            raise ConfigError(f"cannot parse {where}: {problem}{at}") from None
    return config_from_dict(data, overrides, where=where)


def save_config(cfg: Config, path: str | os.PathLike) -> None:
    """Write the resolved config as YAML; ``load_config(path)`` gives it back. Written to a
    temporary file and renamed, so a process killed meanwhile leaves the old file whole."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = os.fspath(path) + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write("# Resolved zeroflow config; rerun with: --config " + os.fspath(path) + "\n")
        yaml.safe_dump(config_to_dict(cfg), f, sort_keys=False, default_flow_style=False)
    os.replace(tmp, path)


# --- validation ---------------------------------------------------------------------------------
# One function per section, each returning its one-line problems. The rules that tie the
# engine's settings together are the engine's own (``zeroflow.engine.plan``), spelled with the
# config's keys.

CONFIG_KEYS = Keys(
    {name: f"parallel.{name}" for name in ParallelConfig().plan_settings()}
    | {
        "stage": "parallel.zero_stage",
        "context": "parallel.context",
        "seq_len": "model.seq_len",
        "grad_accum": "parallel.grad_accum",
        "batch_size": "train.batch_size",
        "params": "precision.params",
    },
    python=False,
)
"How the engine's rules name the settings in a config's messages."


def _layer_chunk_autocast(cfg: Config) -> list[str]:
    """Autocast leaves a custom_vjp's matmuls in their declared dtype, and each layer of
    model.layer_chunk is one: under autocast its matmuls would silently stay in
    precision.params."""
    autocast = cfg.precision.autocast
    ok = not (cfg.model.layer_chunk and autocast != "none")
    return _failed(
        [
            (
                ok,
                (
                    f"precision.autocast={autocast} does not reach the layers of model.layer_chunk (each "
                    "runs as one custom_vjp, whose matmuls autocast leaves as declared): their matmuls "
                    "would stay in precision.params; set one of the two"
                ),
            )
        ]
    )


def validate_config(cfg: Config) -> Config:
    """Check choices, ranges and cross-field rules; return ``cfg`` or raise ConfigError."""
    problems = (
        _choice_problems(cfg)
        + _model_problems(cfg.model)
        + _lora_problems(cfg.model.lora, cfg.train.freeze)
        + _data_problems(cfg.data)
        + _train_problems(cfg.train)
        + _parallel_problems(cfg)
        + _precision_problems(cfg.precision)
        + _layer_chunk_autocast(cfg)
        + _checkpoint_problems(cfg.checkpoint)
        + _fusemix_problems(cfg.fusemix)
        + _run_problems(cfg.run)
    )
    if problems:
        raise ConfigError("; ".join(problems))
    return cfg


def _failed(rules: Sequence[tuple[bool, str]]) -> list[str]:
    """The messages of the ``(holds, message)`` rules that do not hold."""
    return [message for holds, message in rules if not holds]


def _choice_problems(cfg: Config) -> list[str]:
    problems = []
    for key, _, f in _leaves():
        choices = f.metadata.get(CHOICES)
        value = _get(cfg, key)
        if choices and value not in choices:
            close = difflib.get_close_matches(str(value), [str(c) for c in choices], n=1)
            hint = f" (did you mean '{close[0]}'?)" if close else ""
            problems.append(
                f"{key} must be one of {', '.join(map(str, choices))}; got {value!r}{hint}"
            )
    return problems


def _model_problems(m) -> list[str]:
    problems = _failed(
        [
            (m.vocab_size > 0, "model.vocab_size must be positive"),
            (m.seq_len > 0, "model.seq_len must be positive"),
            (m.num_layers > 0, "model.num_layers must be positive"),
            (m.embed_dim > 0, "model.embed_dim must be positive"),
            (m.num_heads > 0, "model.num_heads must be positive"),
            (m.num_kv_heads >= 0, "model.num_kv_heads must be >= 0 (0 = num_heads)"),
            (m.head_dim >= 0, "model.head_dim must be >= 0 (0 = embed_dim // num_heads)"),
            (m.mlp_dim > 0, "model.mlp_dim must be positive"),
            (m.rope_base > 0, "model.rope_base must be positive"),
            (0 < m.mlp_density <= 1, f"model.mlp_density must be in (0, 1]; got {m.mlp_density}"),
            (
                m.mlp_block_size in (32, 64, 128),  # pallas_kernels.block_sparse.BLOCK_SIZES
                f"model.mlp_block_size must be 32, 64 or 128 (the block-sparse kernels' block "
                f"sizes); got {m.mlp_block_size}",
            ),
            (0 <= m.dropout < 1, f"model.dropout must be in [0, 1); got {m.dropout}"),
            (m.max_positions >= 0, "model.max_positions must be >= 0 (0 = seq_len)"),
            (m.norm_eps > 0, "model.norm_eps must be positive"),
            (m.sliding_window >= 0, "model.sliding_window must be >= 0 (0 = attend to all)"),
            (m.loss_chunk >= 0, "model.loss_chunk must be >= 0 (0 = the plain loss)"),
            (m.loss_vocab_chunk > 0, "model.loss_vocab_chunk must be positive"),
            (m.mlp_chunk >= 0, "model.mlp_chunk must be >= 0 (0 = untiled)"),
            (m.layer_chunk >= 0, "model.layer_chunk must be >= 0 (0 = one piece)"),
            (
                m.remat_dtype != "fp8" or m.remat in FP8_REMATS,
                f"model.remat_dtype='fp8' keeps saved activations in FP8: it needs a "
                f"model.remat that saves some ({', '.join(FP8_REMATS)}); got {m.remat!r}",
            ),
            (m.attn_softcap >= 0, "model.attn_softcap must be >= 0 (0 = off)"),
            (m.logit_softcap >= 0, "model.logit_softcap must be >= 0 (0 = off)"),
            (m.query_pre_attn_scalar >= 0, "model.query_pre_attn_scalar must be >= 0 (0 = off)"),
            (m.local_rope_base >= 0, "model.local_rope_base must be >= 0 (0 = rope_base)"),
            (m.global_every >= 0, "model.global_every must be >= 0 (0 = the window everywhere)"),
            (0 <= m.norm_offset <= 1, f"model.norm_offset must be in [0, 1]; got {m.norm_offset}"),
            (
                m.rope_scaling_factor > 0
                and m.rope_original_max_positions > 0
                and 0 < m.rope_low_freq_factor < m.rope_high_freq_factor,
                "model.rope_scaling_factor and model.rope_original_max_positions must be positive and "
                "0 < model.rope_low_freq_factor < model.rope_high_freq_factor",
            ),
        ]
    )
    return problems + _head_problems(m)


def _head_problems(m) -> list[str]:
    """The heads split the embedding, and the key/value heads the query heads."""
    if m.num_heads <= 0:
        return []  # reported on its own
    return _failed(
        [
            (
                m.head_dim != 0 or m.embed_dim % m.num_heads == 0,
                f"model.num_heads ({m.num_heads}) must divide model.embed_dim ({m.embed_dim}) when "
                f"model.head_dim is 0",
            ),
            (
                m.num_kv_heads <= 0 or m.num_heads % m.num_kv_heads == 0,
                f"model.num_kv_heads ({m.num_kv_heads}) must divide model.num_heads ({m.num_heads})",
            ),
        ]
    )


def _data_problems(d) -> list[str]:
    return _failed(
        [
            (bool(d.source), "data.source must not be empty"),
            (0 <= d.val_fraction < 1, f"data.val_fraction must be in [0, 1); got {d.val_fraction}"),
            (d.max_bytes >= 0, "data.max_bytes must be >= 0 (0 = no cap)"),
            (d.packing_bins > 0, "data.packing_bins must be positive"),
            (
                bool(d.tokenizer),
                "data.tokenizer must be 'byte', a SentencePiece .model path or a "
                "Hugging Face tokenizer.json (or its folder)",
            ),
        ]
    )


def _train_problems(t) -> list[str]:
    problems = _failed(
        [
            (t.steps > 0, f"train.steps must be positive; got {t.steps}"),
            (
                t.steps <= STEP_MAX,
                f"train.steps must be at most {STEP_MAX:,} (the step counter is a 32-bit "
                f"integer); got {t.steps}",
            ),
            (t.batch_size > 0, f"train.batch_size must be positive; got {t.batch_size}"),
            (t.lr >= 0, "train.lr must be >= 0"),
            (0 <= t.min_lr_ratio <= 1, "train.min_lr_ratio must be in [0, 1]"),
            (t.warmup_steps >= 0, "train.warmup_steps must be >= 0"),
            (t.weight_decay >= 0, "train.weight_decay must be >= 0"),
            (0 <= t.b1 < 1 and 0 <= t.b2 < 1, "train.b1 and train.b2 must be in [0, 1)"),
            (t.grad_clip >= 0, "train.grad_clip must be >= 0 (0 disables it)"),
            (
                0 <= t.seed <= SEED_MAX,
                f"train.seed must be in [0, {SEED_MAX}] (a JAX key holds 32 bits of it: a larger "
                f"seed would repeat a smaller one's draws); got {t.seed}",
            ),
            (t.log_every > 0, "train.log_every must be positive"),
            (t.eval_every >= 0, "train.eval_every must be >= 0 (0 = only at the end)"),
            (t.eval_batches >= 0, "train.eval_batches must be >= 0"),
            (
                t.spike_factor == 0 or t.spike_factor > 1,
                f"train.spike_factor must be 0 (off) or above 1; got {t.spike_factor}",
            ),
            (t.spike_window > 0, f"train.spike_window must be positive; got {t.spike_window}"),
            (t.max_grad_norm >= 0, "train.max_grad_norm must be >= 0 (0 = no bound)"),
            (
                0 < t.rollback_lr_factor <= 1,
                f"train.rollback_lr_factor must be in (0, 1]; got {t.rollback_lr_factor}",
            ),
            (t.max_rollbacks >= 0, f"train.max_rollbacks must be >= 0; got {t.max_rollbacks}"),
        ]
    )
    if t.freeze:
        try:
            re.compile(t.freeze)
        except re.error as e:
            problems.append(f"train.freeze must be a regular expression; {t.freeze!r}: {e}")
    return problems


def _parallel_problems(cfg: Config) -> list[str]:
    """The section's own ranges, then the engine's rules between its settings (and the batch
    size, the optimizer and the precision they constrain)."""
    p = cfg.parallel
    problems = _failed(
        [
            (p.data == -1 or p.data > 0, "parallel.data must be -1 (all remaining) or positive"),
            (p.model > 0, "parallel.model must be positive"),
            (p.context > 0, "parallel.context must be positive"),
            (p.grad_accum > 0, "parallel.grad_accum must be positive"),
            (p.hosts >= 0, "parallel.hosts must be >= 0 (0: each device's own host)"),
            # XLA:GPU stops with a check failure compiling the 8-bit update as host code (an
            # asynchronous op XLA:CPU cannot emit); streamed through the device it compiles.
            (
                p.update_on != "host" or cfg.train.optimizer != "adamw_8bit",
                "train.optimizer=adamw_8bit is updated on the device: use parallel.update_on=device "
                "with parallel.offload (the state streams through the device one parameter at a time)",
            ),
        ]
    )
    problems += plan_problems(**p.plan_settings(), keys=CONFIG_KEYS)
    more = [
        hierarchical_copy_problem(p.hierarchical, cfg.precision.params, CONFIG_KEYS),
        batch_split_problem(cfg.train.batch_size, p.grad_accum, keys=CONFIG_KEYS),
        *_context_problems(cfg),
    ]
    return problems + [problem for problem in more if problem]


def _context_problems(cfg: Config) -> list[str | None]:
    """The sequence splits into the parts (ring: twice as many chunks) the context devices hold,
    and the attention implementation runs the chosen strategy."""
    p, m = cfg.parallel, cfg.model
    if p.context <= 1:
        return []
    chunks = CONTEXT_CHUNKS.get(m.context_attention, 1)
    return [
        sequence_split_problem(m.seq_len, p.context, chunks, CONFIG_KEYS),
        context_attention_problem(m.context_attention, m.attention, m.sliding_window, MODEL_KEYS),
    ]


def _precision_problems(prec) -> list[str]:
    problems = _failed(
        [
            (prec.init_scale > 0, f"precision.init_scale must be positive; got {prec.init_scale}"),
            (
                prec.growth_interval > 0,
                f"precision.growth_interval must be positive; got {prec.growth_interval}",
            ),
            (prec.min_scale > 0, f"precision.min_scale must be positive; got {prec.min_scale}"),
            (
                prec.min_scale <= prec.init_scale,
                f"precision.min_scale ({prec.min_scale:g}) must not exceed "
                f"precision.init_scale ({prec.init_scale:g})",
            ),
            (
                prec.max_consecutive_skips > 0,
                f"precision.max_consecutive_skips must be positive; got {prec.max_consecutive_skips}",
            ),
            (
                prec.fp8_history > 0,
                f"precision.fp8_history must be positive; got {prec.fp8_history}",
            ),
            (
                prec.fp8_margin >= 0,
                f"precision.fp8_margin must be 0 or more; got {prec.fp8_margin}",
            ),
        ]
    )
    try:
        parse_loss_scale(prec.loss_scale)
    except ValueError:
        problems.append(
            f"precision.loss_scale must be 'none', 'dynamic' or a positive number; "
            f"got {prec.loss_scale!r}"
        )
    if not problems:  # the rules between the keys are the engine's own
        try:
            check_precision(**dataclasses.asdict(prec))
        except ValueError as e:
            problems.append(f"precision: {e}")
    return problems


def _fusemix_problems(f) -> list[str]:
    return _failed(
        [
            (f.shared_dim > 0, "fusemix.shared_dim must be positive"),
            (f.adapter_hidden > 0, "fusemix.adapter_hidden must be positive"),
            (f.adapter_layers > 0, "fusemix.adapter_layers must be positive"),
            (f.adapter_expansion > 0, "fusemix.adapter_expansion must be positive"),
            (f.max_text_len > 0, f"fusemix.max_text_len must be positive; got {f.max_text_len}"),
            (f.encode_batch > 0, f"fusemix.encode_batch must be positive; got {f.encode_batch}"),
            (f.val_pairs > 0, f"fusemix.val_pairs must be positive; got {f.val_pairs}"),
            (f.temperature > 0, f"fusemix.temperature must be positive; got {f.temperature}"),
            (
                f.mixup_alpha >= 0,
                f"fusemix.mixup_alpha must be >= 0 (0 = no mixup); got {f.mixup_alpha}",
            ),
            (f.prefetch >= 0, f"fusemix.prefetch must be >= 0; got {f.prefetch}"),
        ]
    )


def _run_problems(r) -> list[str]:
    return _failed(
        [
            (
                bool(r.dir.strip()),
                "run.dir must not be empty: give the run its own folder (e.g. runs/tiny; it is "
                "created when missing)",
            ),
        ]
    )


def _checkpoint_problems(c) -> list[str]:
    return _failed(
        [
            (c.every >= 0, "checkpoint.every must be >= 0"),
            (c.keep > 0, f"checkpoint.keep must be at least 1; got {c.keep}"),
            (
                c.keep_every >= 0,
                f"checkpoint.keep_every must be >= 0 (0 = off); got {c.keep_every}",
            ),
            (
                c.keep_every <= 0 or (c.every > 0 and c.keep_every % c.every == 0),
                f"checkpoint.keep_every ({c.keep_every}) must be a multiple of checkpoint.every "
                f"({c.every}): only the steps that are saved can be kept",
            ),
        ]
    )


def _lora_problems(lora, freeze: str) -> list[str]:
    """What is wrong with ``model.lora``; whether its targets match a weight of the model is
    checked when the run is built (``zeroflow.trainer.adapters``), where the model is known."""
    out = []
    if lora.rank < 0:
        out.append(f"model.lora.rank must be >= 0 (0 = off); got {lora.rank}")
    if not lora.alpha > 0:
        out.append(f"model.lora.alpha must be positive; got {lora.alpha}")
    if not 0 <= lora.dropout < 1:
        out.append(f"model.lora.dropout must be in [0, 1); got {lora.dropout}")
    if lora.quantize != "none" and lora.rank == 0:
        out.append(
            f"model.lora.quantize={lora.quantize} needs model.lora.rank > 0: it quantizes the "
            "frozen base weights of a LoRA run"
        )
    if lora.rank > 0:
        try:
            re.compile(lora.targets or "(?!)")
        except re.error as e:
            out.append(f"model.lora.targets must be a regular expression; {lora.targets!r}: {e}")
        if not lora.targets:
            out.append(
                "model.lora.targets must not be empty: a regex on parameter paths such "
                "as '(attn|mlp)/\\w+/kernel'"
            )
        if freeze:
            out.append(
                f"train.freeze={freeze!r} with model.lora.rank={lora.rank}: LoRA already "
                "freezes every base weight and trains the adapters only; narrow "
                "model.lora.targets instead (or set train.freeze='')"
            )
    return out


# --- command line -------------------------------------------------------------------------------


def add_config_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add ``--config FILE`` and ``key=value`` overrides to ``parser``; keys listed in --help."""
    parser.add_argument(
        "--config",
        metavar="FILE",
        default=None,
        help="YAML config file (default: the dataclass defaults)",
    )
    parser.add_argument(
        "overrides",
        nargs="*",
        metavar="section.key=value",
        help="dotted overrides applied after the file, e.g. train.steps=100",
    )
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.epilog = (
        (parser.epilog or "") + "\nconfig keys (section.key=default):\n" + describe_config()
    )
    return parser


def config_from_args(args: argparse.Namespace) -> Config:
    return load_config(args.config, args.overrides)


def parse_cli(
    argv: Sequence[str], *, prog: str | None = None, description: str | None = None
) -> Config:
    """``--config FILE [key=value ...]`` -> Config. A bad config exits with usage and one line."""
    parser = add_config_arguments(argparse.ArgumentParser(prog=prog, description=description))
    args = parser.parse_intermixed_args(list(argv))
    try:
        return config_from_args(args)
    except ConfigError as e:
        parser.error(str(e))
