"""Config loading: YAML + dotted overrides, one-line errors, validation, round trip, CLI."""
import dataclasses

import pytest

from zeroflow.config.schema import CHOICES, Config, ModelConfig, ParallelConfig
from zeroflow.config.io import (ConfigError, apply_overrides, config_from_dict, config_to_dict,
                                field_docs, load_config, parse_cli, save_config)

pytestmark = pytest.mark.fast

YAML = """\
model:
  num_layers: 4
  embed_dim: 256
  norm: layernorm
train:
  steps: 50
  lr: 3e-4          # PyYAML reads this as a string; the float field takes it
  batch_size: 8
parallel:
  zero_stage: 1
precision:
  loss_scale: 1024  # a number for the str field
run:
  tensorboard: yes
"""


def write(tmp_path, text, name="cfg.yaml"):
    path = tmp_path / name
    path.write_text(text)
    return path


def error_of(overrides=(), path=None) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(path, overrides)
    message = str(info.value)
    assert "\n" not in message
    return message


def test_defaults_without_a_file():
    assert load_config(None) == Config()


def test_yaml_then_overrides(tmp_path):
    cfg = load_config(write(tmp_path, YAML), ["train.steps=100", "parallel.zero_stage=3",
                                              "precision.loss_scale=dynamic", "train.lr=1"])
    assert (cfg.model.num_layers, cfg.model.embed_dim, cfg.model.norm) == (4, 256, "layernorm")
    assert cfg.train.steps == 100 and cfg.train.batch_size == 8
    assert cfg.train.lr == 1.0 and isinstance(cfg.train.lr, float)
    assert cfg.parallel.zero_stage == 3 and cfg.precision.loss_scale == "dynamic"
    assert cfg.run.tensorboard is True
    assert cfg.data == Config().data  # untouched sections keep their defaults

    cfg = load_config(write(tmp_path, YAML))
    assert cfg.train.lr == pytest.approx(3e-4) and cfg.precision.loss_scale == "1024"


@pytest.mark.parametrize("text,expected", [
    ("true", True), ("False", False), ("1", True), ("0", False), ("yes", True), ("no", False)])
def test_bool_strings(text, expected):
    assert load_config(None, [f"run.progress={text}"]).run.progress is expected


def test_unknown_key_names_it_and_lists_valid_keys(tmp_path):
    message = error_of(["train.stpes=100"])
    assert "unknown key 'train.stpes'" in message
    assert "did you mean 'train.steps'?" in message
    assert "valid keys in train: steps, batch_size, lr," in message and "eval_batches" in message

    message = error_of(path=write(tmp_path, "model:\n  num_layer: 3\n"))
    assert "'model.num_layer'" in message and "'model.num_layers'" in message
    assert "cfg.yaml" in message


def test_unknown_section_and_missing_section():
    message = error_of(["trian.steps=1"])
    assert "unknown section 'trian'" in message and "did you mean 'train'" in message
    assert "valid sections: model, data, train, parallel, precision, checkpoint, run" in message
    assert "did you mean 'train.steps'" in error_of(["steps=1"])
    assert "unknown key 'train.steps.x'" in error_of(["train.steps.x=1"])


@pytest.mark.parametrize("override,expected", [
    ("train.steps=1.5", ["train.steps", "expected int", "'1.5'"]),
    ("train.lr=fast", ["train.lr", "expected float", "'fast'"]),
    ("run.progress=maybe", ["run.progress", "expected bool", "'maybe'"]),
    ("train.lr=nan", ["train.lr", "finite float"]),
])
def test_wrong_type_from_override(override, expected):
    message = error_of([override])
    assert all(part in message for part in expected), message


def test_wrong_type_from_yaml(tmp_path):
    message = error_of(path=write(tmp_path, "train:\n  steps: 10.0\n"))
    assert "train.steps: expected int, got 10.0 (float)" in message
    message = error_of(path=write(tmp_path, "model:\n  norm: [rmsnorm]\n"))
    assert "model.norm: expected str" in message
    assert "section 'train' must be a mapping" in error_of(path=write(tmp_path, "train: 3\n"))
    assert "cannot parse" in error_of(path=write(tmp_path, "train:\n  steps: [1\n"))


def test_bad_choices():
    message = error_of(["model.norm=batchnorm"])
    assert "model.norm must be one of rmsnorm, layernorm; got 'batchnorm'" in message
    message = error_of(["parallel.zero_stage=4"])
    assert "parallel.zero_stage must be one of 0, 1, 2, 3; got 4" in message
    assert "did you mean 'optimizer+params'" in error_of(["parallel.offload=optimizer+param"])
    for bad in ("static", "-1", "0", "inf"):
        assert "precision.loss_scale" in error_of([f"precision.loss_scale={bad}"])
    assert load_config(None, ["precision.loss_scale=65536.0"]).precision.loss_scale == "65536.0"


def test_choices_live_in_field_metadata():
    choices = {f.name: f.metadata.get(CHOICES) for f in dataclasses.fields(ModelConfig)}
    assert choices["remat"] == ("none", "full", "save_dots", "offload_dots", "offload_input")
    assert choices["attention"] == ("xla", "cudnn", "pallas")
    offload = {f.name: f for f in dataclasses.fields(ParallelConfig)}["offload"]
    assert offload.metadata[CHOICES] == ("none", "optimizer", "optimizer+params")
    assert offload.default == "none"


def test_config_choices_are_the_engines_and_the_models():
    from zeroflow.autocast import precision
    from zeroflow.engine import plan
    from zeroflow.config.schema import PrecisionConfig, choices_of
    from zeroflow.models import gpt
    assert choices_of(ParallelConfig) == {"zero_stage": plan.ZERO_STAGES,
                                          "offload": plan.OFFLOAD_CHOICES,
                                          "update_on": plan.UPDATE_ON_CHOICES,
                                          "quantize_weights": ("none", "int8", "fp8"),
                                          "quantize_grads": ("none", "int8")}
    assert plan.QUANTIZE_WEIGHTS_CHOICES == (None, "int8", "fp8")  # 'none' in a config is None
    assert plan.QUANTIZE_GRADS_CHOICES == (None, "int8")
    assert choices_of(PrecisionConfig) == {"params": tuple(precision.DTYPES),
                                           "master": precision.MASTER_DTYPES,
                                           "autocast": precision.AUTOCAST,
                                           "reduce": tuple(precision.DTYPES),
                                           "fp8_scaling": ("tensor", "row", "delayed"),
                                           "fp8_select": precision.FP8_SELECT}
    assert gpt._CHOICES == choices_of(ModelConfig)


def test_precision_is_built_from_the_precision_section():
    import zeroflow as zf
    from zeroflow.config.schema import PrecisionConfig
    assert ({f.name for f in dataclasses.fields(PrecisionConfig)}
            == {f.name for f in dataclasses.fields(zf.Precision)})
    cfg = load_config(None, ["precision.loss_scale=1024", "precision.autocast=bf16",
                             "precision.growth_interval=7"]).precision
    prec = zf.Precision.from_config(cfg)
    assert (prec.loss_scale, prec.autocast, prec.growth_interval) == (1024.0, "bf16", 7)
    assert prec == zf.Precision(loss_scale=1024.0, autocast="bf16", growth_interval=7)
    assert prec.summary == "autocast bf16 (weights fp32)"
    assert zf.Precision(params="bf16").summary == "bf16"


def test_update_on_host_needs_offload():
    message = error_of(["parallel.update_on=host"])
    assert "parallel.update_on=host needs parallel.offload 'optimizer' or 'optimizer+params'" in message


def test_8bit_state_is_not_updated_on_the_host():
    message = error_of(["train.optimizer=adamw_8bit", "parallel.offload=optimizer",
                        "parallel.update_on=host"])
    assert "train.optimizer=adamw_8bit is updated on the device" in message
    load_config(None, ["train.optimizer=adamw_8bit", "parallel.offload=optimizer",
                       "parallel.update_on=device"])  # streamed through the device: accepted


@pytest.mark.parametrize("overrides,expected", [
    (["train.steps=0"], "train.steps must be positive"),
    (["train.batch_size=-2"], "train.batch_size must be positive"),
    (["model.seq_len=0"], "model.seq_len must be positive"),
    (["data.val_fraction=1"], "data.val_fraction must be in [0, 1)"),
    (["data.val_fraction=-0.1"], "data.val_fraction must be in [0, 1)"),
    (["model.num_heads=3"], "model.num_heads (3) must divide model.embed_dim (128)"),
    (["model.num_kv_heads=3"], "model.num_kv_heads (3) must divide model.num_heads (4)"),
    (["train.batch_size=6", "parallel.grad_accum=4"],
     "train.batch_size 6 does not divide by parallel.grad_accum 4"),
    (["model.sliding_window=-1"], "model.sliding_window must be >= 0"),
    (["model.norm_eps=0"], "model.norm_eps must be positive"),
    (["model.max_positions=-5"], "model.max_positions must be >= 0"),
    (["model.rope_low_freq_factor=4", "model.rope_high_freq_factor=1"],
     "0 < model.rope_low_freq_factor < model.rope_high_freq_factor"),
    (["model.positions=alibi"], "model.positions must be one of rope, learned"),
    (["model.attn_bias=out"], "model.attn_bias must be one of none, qkv, all"),
])
def test_sanity_checks(overrides, expected):
    assert expected in error_of(overrides)


def test_head_dim_lifts_the_divisibility_rule():
    cfg = load_config(None, ["model.num_heads=3", "model.head_dim=32", "model.num_kv_heads=1"])
    assert cfg.model.num_heads == 3


def test_override_without_equals_and_missing_file(tmp_path):
    assert "not of the form section.key=value" in error_of(["train.steps"])
    assert "config file not found: " in error_of(path=tmp_path / "nope.yaml")


def test_save_load_round_trip(tmp_path):
    cfg = load_config(None, ["train.lr=3e-4", "model.remat=save_dots", "precision.params=bf16",
                             "precision.loss_scale=dynamic", "run.dir=runs/x y", "data.max_bytes=7",
                             "parallel.offload=optimizer", "parallel.update_on=host"])
    save_config(cfg, tmp_path / "sub" / "resolved.yaml")
    assert load_config(tmp_path / "sub" / "resolved.yaml") == cfg
    assert config_from_dict(config_to_dict(cfg)) == cfg


def test_apply_overrides_copies():
    base = Config()
    cfg = apply_overrides(base, ["train.steps=5"])
    assert cfg.train.steps == 5 and base.train.steps == Config().train.steps


def test_parse_cli(tmp_path, capsys):
    path = write(tmp_path, YAML)
    cfg = parse_cli(["--config", str(path), "train.steps=7", "model.remat=full"])
    assert cfg.train.steps == 7 and cfg.model.remat == "full" and cfg.model.num_layers == 4
    assert parse_cli(["train.steps=9"]).train.steps == 9
    assert parse_cli([]) == Config()
    with pytest.raises(SystemExit) as info:
        parse_cli(["train.stpes=7"])
    assert info.value.code == 2
    assert "did you mean 'train.steps'" in capsys.readouterr().err


def test_every_field_has_a_doc():
    docs = field_docs()
    assert docs["train.steps"] == "Number of optimizer steps."
    assert [key for key, doc in docs.items() if not doc] == []


@pytest.mark.parametrize("key", ["shared_dim", "adapter_hidden", "adapter_layers",
                                 "adapter_expansion"])
def test_fusemix_adapter_sizes_must_be_positive(key):
    with pytest.raises(ConfigError, match=f"fusemix.{key} must be positive"):
        load_config("configs/fusemix.yaml", [f"fusemix.{key}=0"])
