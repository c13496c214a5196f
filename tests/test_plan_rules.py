"""Each rule between the engine's settings has one home, ``zeroflow.engine.plan``: a ``ZeroPlan``
(or train step) and a config that break it report the same message, each in its own spelling
(``stage=2`` / ``parallel.zero_stage=2``, ``'int8'`` / ``int8``)."""
import re

import optax
import pytest

import zeroflow as zf
from zeroflow.config.io import CONFIG_KEYS, ConfigError, load_config
from zeroflow.engine import plan_rules as rules
from zeroflow.engine.plan_rules import PLAN_KEYS, Keys

pytestmark = pytest.mark.fast

HPZ = ["parallel.zero_stage=3", "parallel.hierarchical=true", "precision.params=bf16"]

CASES = {  # rule: (ZeroPlan arguments, config overrides), each breaking that rule alone
    "host update needs offload": ({"stage": 1, "update_on": "host"}, ["parallel.update_on=host"]),
    "qwZ needs stage 3": ({"stage": 2, "quantize_weights": "int8"},
                          ["parallel.zero_stage=2", "parallel.quantize_weights=int8"]),
    "qgZ needs stage 3": ({"stage": 1, "quantize_grads": "int8"},
                          ["parallel.zero_stage=1", "parallel.quantize_grads=int8"]),
    "positive block": ({"stage": 3, "quantize_weights": "int8", "quantize_block": 0},
                       ["parallel.zero_stage=3", "parallel.quantize_weights=int8",
                        "parallel.quantize_block=0"]),
    "hpZ needs stage 3": ({"stage": 2, "hierarchical": True, "hosts": 2},
                          HPZ + ["parallel.zero_stage=2", "parallel.hosts=2"]),
    "hpZ stays on the device": ({"stage": 3, "hierarchical": True, "hosts": 2,
                                 "offload": "optimizer"},
                                HPZ + ["parallel.hosts=2", "parallel.offload=optimizer"]),
    "hpZ needs two hosts": ({"stage": 3, "hierarchical": True, "hosts": 1},
                            HPZ + ["parallel.hosts=1"]),
}


def _in_rule_terms(message: str, keys: Keys) -> str:
    """``message`` with each setting named as the rules name it and values unquoted, in lower
    case: what is left is the rule's own wording."""
    for name, key in sorted(keys.names.items(), key=lambda item: -len(item[1])):
        message = re.sub(rf"(?<![\w.]){re.escape(key)}(?![\w])", name, message)
    return message.replace("'", "").lower()


def _plan_error(**arguments) -> str:
    with pytest.raises(ValueError) as e:
        zf.ZeroPlan(zf.make_mesh(), **arguments)
    return str(e.value)


def _config_error(overrides) -> str:
    with pytest.raises(ConfigError) as e:
        load_config("configs/tiny.yaml", overrides)
    return str(e.value)


@pytest.mark.parametrize("rule", list(CASES))
def test_plan_and_config_give_the_rules_one_message(rule):
    arguments, overrides = CASES[rule]
    plan_message, config_message = _plan_error(**arguments), _config_error(overrides)
    assert plan_message == rules.plan_problems(**arguments)[0]
    assert "\n" not in config_message and config_message.startswith("parallel.")
    assert _in_rule_terms(config_message, CONFIG_KEYS) == _in_rule_terms(plan_message, PLAN_KEYS)


def test_one_host_read_from_the_mesh_is_the_same_rule():
    """Emulated devices all belong to one process: one host, as ``hosts=1`` says."""
    assert _plan_error(stage=3, hierarchical=True) == _plan_error(stage=3, hierarchical=True,
                                                                  hosts=1)


def test_the_trainer_names_the_config_keys_where_the_mesh_decides():
    from zeroflow.trainer.setup import build_run
    with pytest.raises(ValueError) as e:
        build_run(load_config("configs/tiny.yaml", HPZ), with_data=False)
    assert str(e.value).startswith("parallel.hierarchical=true needs a data axis spanning two")
    assert _in_rule_terms(str(e.value), CONFIG_KEYS) == _in_rule_terms(
        _plan_error(stage=3, hierarchical=True), PLAN_KEYS)


def test_config_reports_every_broken_rule():
    message = _config_error(["parallel.zero_stage=2", "parallel.quantize_weights=int8",
                             "parallel.quantize_grads=int8", "parallel.update_on=host"])
    expected = rules.plan_problems(stage=2, update_on="host", quantize_weights="int8",
                                   quantize_grads="int8", keys=CONFIG_KEYS)
    assert len(expected) == 3 and message == "; ".join(expected)


def test_valid_settings_break_no_rule():
    for stage in (0, 1, 2, 3):
        assert rules.plan_problems(stage, offload="optimizer", update_on="host") == []
    assert rules.plan_problems(3, quantize_weights="int8", quantize_grads="int8",
                               hierarchical=True, hosts=2) == []
    assert rules.batch_split_problem(16, 2, data_size=8) is None
    assert rules.batch_split_problem(16, 2) is None


def test_batch_split_config_and_trainer_name_the_keys():
    assert (_config_error(["train.batch_size=6", "parallel.grad_accum=4"])
            == "train.batch_size 6 does not divide by parallel.grad_accum 4")
    from zeroflow.trainer.setup import build_run
    cfg = load_config("configs/tiny.yaml", ["train.batch_size=24", "parallel.grad_accum=2"])
    with pytest.raises(ValueError) as e:
        build_run(cfg, with_data=False)
    assert str(e.value) == rules.batch_split_problem(24, 2, 8, CONFIG_KEYS)
    assert _in_rule_terms(str(e.value), CONFIG_KEYS) == _in_rule_terms(
        rules.batch_split_problem(24, 2, 8), PLAN_KEYS)


def test_train_step_gives_the_batch_rules_message():
    import jax.numpy as jnp
    plan, prec, tx = zf.ZeroPlan(zf.make_mesh(), stage=1), zf.Precision(), optax.sgd(0.1)
    params = {"w": jnp.ones((8, 4))}
    state = zf.init_train_state(params, tx, plan, prec)
    loss = lambda p, batch: jnp.mean((batch["x"] @ p["w"]) ** 2)  # noqa: E731
    step = zf.make_train_step(loss, tx, plan, prec, grad_accum=2)
    with pytest.raises(ValueError) as e:
        step(state, {"x": jnp.ones((24, 8))})
    assert str(e.value) == rules.batch_split_problem(24, 2, 8)


def test_hpz_without_a_compute_copy_is_one_rule():
    import jax.numpy as jnp
    plan = zf.ZeroPlan(zf.make_mesh(), stage=3, hierarchical=True, hosts=2)
    with pytest.raises(ValueError) as e:
        zf.init_train_state({"w": jnp.ones((16, 8))}, optax.sgd(0.1), plan, zf.Precision())
    config_message = _config_error(HPZ[:2] + ["parallel.hosts=2"])
    assert _in_rule_terms(config_message, CONFIG_KEYS) == _in_rule_terms(str(e.value), PLAN_KEYS)
