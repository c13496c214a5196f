"""Memory planning: the ZeRO paper's figures, estimate vs the real sharded state, XLA's
memory analysis, the activation formula, the command line and its errors."""
import dataclasses
import json

import jax
import jax.numpy as jnp
import optax
import pytest

import zeroflow as zf
from zeroflow import memory
from zeroflow.config.schema import Config
from zeroflow.cli.memory import main
from zeroflow.trainer.planning import abstract_setup

pytestmark = pytest.mark.fast

GB = 1e9

# ZeRO paper (Rajbhandari et al. 2020), Table 1: per-device model-state memory in GB for
# P_os, P_os+g, P_os+g+p (stages 1, 2, 3) by data-parallel degree; row "1" is stage 0.
PAPER_TABLE_1 = {
    7.5e9: {1: (120, 120, 120), 4: (52.5, 41.3, 30), 16: (35.6, 21.6, 7.5), 64: (31.4, 16.6, 1.88),
            256: (30.4, 15.4, 0.47), 1024: (30.1, 15.1, 0.12)},
    128e9: {1: (2048, 2048, 2048), 4: (896, 704, 512), 16: (608, 368, 128), 64: (536, 284, 32),
            256: (518, 263, 8), 1024: (513, 257, 2)},
    1e12: {1: (16000, 16000, 16000), 4: (7000, 5500, 4000), 16: (4750, 2875, 1000),
           64: (4187, 2218, 250), 256: (4046, 2054, 62.5), 1024: (4011, 2013, 15.6)},
}


def test_paper_figure_1():
    """7.5B parameters on 64 devices: 120 / 31.4 / 16.6 / 1.9 GB for stages 0-3."""
    got = [memory.estimate(num_params=7.5e9, num_devices=64, stage=s).device_bytes / GB for s in range(4)]
    assert got[0] == pytest.approx(120, rel=0.01)
    assert got[1] == pytest.approx(31.4, rel=0.01)
    assert got[2] == pytest.approx(16.6, rel=0.01)
    assert got[3] == pytest.approx(1.88, rel=0.01)  # Table 1's value; Figure 1 rounds it to 1.9
    assert round(got[3], 1) == 1.9


@pytest.mark.parametrize("num_params", sorted(PAPER_TABLE_1))
def test_paper_table_1(num_params):
    for devices, expected in PAPER_TABLE_1[num_params].items():
        for stage, want in zip((1, 2, 3), expected):
            got = memory.estimate(num_params=num_params, num_devices=devices, stage=stage,
                                  precision=zf.Precision(params="fp16"))
            # The paper prints 2-3 significant digits (0.12 for 0.117): allow for its rounding.
            assert got.device_bytes / GB == pytest.approx(want, rel=0.01, abs=0.005), (devices, stage)


def test_breakdown_and_fp32_accounting():
    est = memory.estimate(num_params=1000, num_devices=4, stage=1, precision="bf16")
    assert est.device == memory.ModelStates(compute_weights=2000, gradients=2000, master=1000, optimizer=2000)
    fp32 = [memory.estimate(num_params=1000, num_devices=4, stage=s, precision="fp32") for s in range(4)]
    assert fp32[0].device_bytes == 16 * 1000  # 4 weights (= master) + 4 grads + 8 moments
    assert fp32[0].device.master == 0 and fp32[0].between_steps_bytes == 12 * 1000
    assert fp32[1].device == memory.ModelStates(4000, 4000, 1000, 2000)  # weights gathered per step
    assert fp32[1].between_steps_bytes == 3000  # only the master and moment shards persist
    assert fp32[3].device_bytes == 16 * 1000 / 4


def test_offload_moves_master_and_optimizer_to_host():
    kw = dict(num_params=8e9, num_devices=8, stage=3, devices_per_process=8)
    plain = memory.estimate(**kw)
    host = memory.estimate(**kw, offload="optimizer", update_on="host")
    device = memory.estimate(**kw, offload="optimizer", update_on="device")
    params = memory.estimate(**kw, offload="optimizer+params", update_on="host")
    assert host.host_bytes == pytest.approx(12 * 8e9)  # 8 devices x 12 bytes x P / 8
    assert host.device_bytes == pytest.approx(4 * 8e9 / 8)  # compute weights + gradients
    assert device.update_bytes == pytest.approx(plain.device_bytes)  # streamed in for the update
    assert params.host_bytes == pytest.approx(14 * 8e9)
    assert params.between_steps_bytes == 0


def test_streamed_layers_leave_only_layers_in_flight_on_the_device():
    """optimizer+params: the device holds the weights outside the layer stack plus two layers
    (the one running, the next coming in); "optimizer" still holds every weight."""
    kw = dict(num_params=1000, num_devices=1, stage=0, update_on="host")
    streamed = memory.estimate(**kw, offload="optimizer+params", resident_params=100)
    assert streamed.device.compute_weights == 2 * 100
    assert streamed.update_bytes == 2 * 1000  # gradients only: the update runs on the host
    assert memory.estimate(**kw, offload="optimizer", resident_params=100).device.compute_weights == 2 * 1000

    cfg = _small_config(num_layers=12, embed_dim=64, mlp_dim=256, vocab_size=256)
    total = memory.count_gpt_params(cfg.model)
    rest = 256 * 64 + 64  # embedding + final norm (tied head)
    block = (total - rest) // 12
    est = memory.estimate_config(cfg, num_devices=1, stage=0, offload="optimizer+params")
    assert est.device.compute_weights == 2 * (rest + 2 * block)


@pytest.mark.parametrize("kwargs,message", [
    (dict(resident_params=-1), "resident_params must be an int >= 0, got -1"),
    (dict(stage=4), "unknown ZeRO stage 4"),
    (dict(num_params=-1), "num_params must be a number >= 0"),
    (dict(num_devices=0), "num_devices must be an int >= 1"),
    (dict(offload="gpu"), "unknown offload 'gpu'"),
    (dict(update_on="host"), "update_on='host' needs offload"),
    (dict(precision="fp8"), "unknown precision 'fp8'"),
])
def test_estimate_rejects_bad_input(kwargs, message):
    args = dict(num_params=1e9, num_devices=8, stage=1) | kwargs
    with pytest.raises(ValueError, match=message):
        memory.estimate(**args)


def test_parse_bytes():
    assert memory.parse_bytes("80GB") == 80 * 10**9
    assert memory.parse_bytes("80GiB") == 80 * 2**30
    assert memory.parse_bytes("1.5 TB") == 1.5e12
    for bad in ("80XB", "GB", "-3GB", ""):
        with pytest.raises(ValueError, match="bad memory size"):
            memory.parse_bytes(bad)


# --------------------------------------------------------------------------- activations
def _small_config(**model):
    cfg = Config()
    cfg.model = dataclasses.replace(cfg.model, **model)
    cfg.precision.params = "bf16"
    return cfg


def test_a_flash_kernel_keeps_no_attention_scores():
    """With cudnn or pallas attention the formula holds each layer's fp32 softmax statistics
    (b x heads x s) where XLA's attention keeps the scores: fp32 softmax + bf16 probabilities
    (b x heads x s x s x 6 bytes), for every layer without remat."""
    base = _small_config(num_layers=3, seq_len=512, num_heads=4).model
    b = 2
    plain = memory.activations(base, micro_batch=b, remat="none", precision="bf16")
    for kind in ("cudnn", "pallas"):
        flash = dataclasses.replace(base, attention=kind)
        got = memory.activations(flash, micro_batch=b, remat="none", precision="bf16")
        assert plain - got == 3 * b * 4 * 512 * (512 * 6 - 4)


def test_activation_formula_orders_remat_policies():
    model = _small_config(num_layers=8).model
    none, dots, full = (memory.activations(model, micro_batch=4, remat=r, precision="bf16")
                        for r in ("none", "save_dots", "full"))
    assert full < dots < none
    # Linear in the micro-batch.
    assert memory.activations(model, micro_batch=8, remat="none") == pytest.approx(
        2 * memory.activations(model, micro_batch=4, remat="none"))
    with pytest.raises(ValueError, match="unknown remat policy 'some'"):
        memory.activations(model, micro_batch=1, remat="some")


SPEC_MODELS = [{}, dict(mlp_activation="gelu", norm="layernorm", tie_embeddings=False,
                       num_kv_heads=2, attn_bias="all", mlp_bias=True, positions="learned",
                       qk_norm=True, post_norms=True)]


@pytest.mark.parametrize("model", SPEC_MODELS)
def test_run_spec_params_are_the_models_real_init(model):
    """``run_spec``'s parameters are the GPT's: the same tree, shapes and dtypes as the arrays
    its init allocates, and the counts the ZeRO formula reads are those arrays' sizes."""
    from zeroflow.models import init_params
    from zeroflow.models.spec import run_spec
    cfg = _small_config(num_layers=3, embed_dim=32, mlp_dim=64, num_heads=4, vocab_size=64,
                        seq_len=16, **model)
    spec = run_spec(cfg, num_devices=1)
    real, _ = init_params(cfg.model, jax.random.key(0))
    described = jax.tree.map(lambda x: (tuple(x.shape), jnp.dtype(x.dtype)), spec.params)
    assert described == jax.tree.map(lambda x: (x.shape, x.dtype), real)
    sizes = lambda tree: sum(x.size for x in jax.tree.leaves(tree))  # noqa: E731
    assert spec.num_params == sizes(real) == memory.count_gpt_params(cfg.model)
    # Streamed (optimizer+params): all but the layer stack, and two of its three layers.
    outside = sizes({k: v for k, v in real.items() if k != "layers"})
    assert spec.resident_params == outside + 2 * sizes(real["layers"]) // 3
    assert spec.flops_per_token > 0 and spec.target is None
    assert run_spec(cfg, num_devices=1, target="h100").peak_flops == 989e12
    with pytest.raises(ValueError, match="unknown target 'h1000'"):
        run_spec(cfg, num_devices=1, target="h1000")


# ------------------------------------------------------------------ estimate vs the real state
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_estimate_matches_sharded_gpt_state(stage):
    """Model states per device: the estimate against the shard bytes of the GPT's abstract
    sharded TrainState (shardings from ZeroPlan, shapes from eval_shape: nothing allocated)."""
    cfg = _small_config(num_layers=2, embed_dim=64, mlp_dim=256, vocab_size=256)
    for offload in ("none", "optimizer", "optimizer+params"):
        setup = abstract_setup(cfg, num_devices=8, stage=stage, offload=offload,
                               update_on="device", remat="none")
        got = memory.state_bytes(setup.state)
        est = memory.estimate_config(cfg, num_devices=8, stage=stage, offload=offload)
        assert est.num_params == setup.num_params
        # abs: the state's scalars (step counter, Adam's count) are not model states.
        assert got.get("device", 0) == pytest.approx(est.between_steps_bytes, rel=0.05, abs=64), offload
        assert got.get("pinned_host", 0) == pytest.approx(est.host_bytes / 8, rel=0.05, abs=64), offload


def test_measure_reports_xla_memory_analysis():
    """argument bytes per device = the state's shard bytes + the batch's (CPU counts the
    pinned_host arrays as arguments too)."""
    plan = zf.ZeroPlan(zf.make_mesh(), stage=3, offload="optimizer", update_on="device")
    prec = zf.Precision(params="bf16")
    tx = optax.adam(1e-3)
    params = {"w": jnp.ones((64, 128), jnp.float32), "v": jnp.ones((128, 16), jnp.float32)}
    state = zf.init_train_state(params, tx, plan, prec)
    step = zf.make_train_step(lambda p, b: jnp.mean((b["x"].astype(jnp.bfloat16) @ p["w"] @ p["v"]) ** 2),
                              tx, plan, prec)
    batch = {"x": jax.ShapeDtypeStruct((16, 64), jnp.float32, sharding=plan.batch_sharding())}
    got = memory.measure(step, state, batch)
    kinds = memory.state_bytes(state)
    assert set(kinds) == {"device", "pinned_host"}
    assert got.argument_bytes == pytest.approx(sum(kinds.values()) + 16 * 64 * 4 / 8, rel=0.05)
    assert got.total_bytes == got.argument_bytes + got.output_bytes + got.temp_bytes - got.alias_bytes
    assert got.temp_bytes > 0 and got.alias_bytes > 0  # the donated state is written in place


# --------------------------------------------------------------------------- command line
def test_cli_prints_table_and_cheapest_fit(capsys):
    assert main(["--devices", "8", "--device-memory", "10MB", "--measure", "never", "--all",
                 "precision.params=bf16"]) == 0
    out = capsys.readouterr().out
    assert "optimizer+params" in out and "save_dots" in out
    # The documented order: no offload first, then remat none < save_dots < offload_dots < full
    # < offload_input, then stage.
    assert main(["--devices", "8", "--measure", "never", "--json",
                 "precision.params=bf16"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    fitting = [r for r in rows if r["estimated_peak_bytes"] <= 10e6]
    best = min(fitting, key=lambda r: (["none", "optimizer", "optimizer+params"].index(r["offload"]),
                                       ["none", "save_dots", "offload_dots", "full",
                                        "offload_input"].index(r["remat"]),
                                       r["stage"]))
    assert 1 < len(fitting) < len(rows)  # the limit decides something
    assert (f"Cheapest choice that fits in 10.00 MB: parallel.zero_stage={best['stage']} "
            f"parallel.offload={best['offload']} model.remat={best['remat']}") in out


def test_cli_without_compiling_gives_the_zero_formula(capsys):
    """``--measure never``: each row is the ZeRO formula of the trainer's config (model states,
    fp32 gradients, and the GPT's activation formula), and the title says what measures."""
    cfg = _small_config()
    argv = ["--devices", "8", "--measure", "never", "--remats", "none,full",
            "precision.params=bf16"]
    assert main(argv) == 0
    assert "8 devices (measured: XLA:CPU of this machine)" in capsys.readouterr().out
    assert main([*argv, "--json"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert len(rows) == 4 * 3 * 2
    for row in rows:
        want = memory.estimate_config(cfg, num_devices=8, stage=row["stage"],
                                      offload=row["offload"], remat=row["remat"])
        assert row["estimated_peak_bytes"] == round(want.device_bytes)
        assert row["measured_peak_bytes"] is None
        assert row["host_bytes_per_process"] == round(want.host_bytes)


def test_cli_instant_column_is_the_traced_step_near_xlas_peak(capsys):
    """Where the table can trace (8 emulated devices here), its first figure is the step's
    instant estimate, within 10% of XLA's compiled peak of the same row (the reference), where
    the formula alone was 0.59x at stage 3 without remat."""
    argv = ["--devices", "8", "--measure", "always", "--stages", "0,3", "--offloads", "none",
            "--remats", "none,full", "precision.params=fp32", "model.embed_dim=256",
            "model.mlp_dim=1024", "model.num_layers=4", "train.batch_size=8"]
    assert main([*argv, "--json"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert len(rows) == 4
    for row in rows:
        ratio = row["instant_peak_bytes"] / row["measured_peak_bytes"]
        assert abs(ratio - 1) <= 0.1, row
    assert main(argv) == 0
    assert "instant/dev" in capsys.readouterr().out


def test_cli_without_a_compile_the_traced_step_decides_what_fits(capsys, monkeypatch):
    """A model too big to compile here (``--measure auto`` over its limit) is still traced: the
    row's need is the traced step's peak, not the formula's, and decides the cheapest fit."""
    from zeroflow.planner import memory_table

    monkeypatch.setattr(memory_table, "MEASURE_MAX_PARAMS", 0)
    argv = ["--devices", "8", "--stages", "3", "--offloads", "none", "--remats", "none,full",
            "precision.params=fp32", "--json"]
    assert main(argv) == 0
    rows = {r["remat"]: r for r in map(json.loads, capsys.readouterr().out.splitlines())}
    assert all(r["measured_peak_bytes"] is None for r in rows.values())
    none, full = rows["none"], rows["full"]
    assert none["instant_peak_bytes"] > full["instant_peak_bytes"]
    # A memory between the two traced peaks: only full remat fits, whatever the formula says.
    memory_size = (none["instant_peak_bytes"] + full["instant_peak_bytes"]) // 2
    assert main([*argv[:-1], "--device-memory", str(memory_size)]) == 0
    out = capsys.readouterr().out
    assert "model.remat=full" in out.splitlines()[-1]
    assert f"needs {memory.format_bytes(full['instant_peak_bytes'])}" in out


def test_cli_nothing_fits(capsys):
    main(["--devices", "8", "--device-memory", "1KB", "--measure", "never"])
    assert "Nothing fits in 1.00 KB" in capsys.readouterr().out


@pytest.mark.parametrize("argv,message", [
    (["--device-memory", "80XB"], "argument --device-memory: bad memory size '80XB'"),
    (["--stages", "5"], "argument --stages: takes ZeRO stages among 0,1,2,3, got '5'"),
    (["--remats", "sometimes"], "argument --remats: takes remat policies among none,full,"),
    (["parallel.zero_stage=7"], "parallel.zero_stage must be one of 0, 1, 2, 3"),
    (["--devices", "-2"], "argument --devices: must be at least 1, got -2"),
])
def test_cli_errors_are_one_line(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--measure", "never", *argv])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert message in err and err.startswith("zeroflow.memory: error:")


def _stored_base_bytes(model, kind, width=2):
    """Bytes of the GPT base as a QLoRA run stores it: ``zf.quantize_frozen``'s packed leaves
    (their actual array sizes), every other leaf in the compute dtype (``width`` bytes)."""
    from zeroflow.models import abstract_params
    shapes, _ = abstract_params(model)
    both = {"base": shapes, "lora": jax.ShapeDtypeStruct((4,), jnp.float32)}  # one to train
    packed = jax.eval_shape(lambda p: zf.quantize_frozen(
        p, lambda path, x: "lora" in str(path), kind, stacked="base/layers")[0], both)["base"]
    return sum(x.size * (1 if x.dtype == jnp.uint8 else width) for x in jax.tree.leaves(packed))


@pytest.mark.parametrize("kind", ["nf4", "int8"])
def test_estimate_counts_a_quantized_base_at_its_stored_bytes(kind):
    """With ``model.lora.quantize`` the formula's frozen weights are the packed base's bytes
    split over the devices at stage 3 (the adapters, not counted, are the only trained
    parameters), not 2 bytes each."""
    from zeroflow.trainer.planning import count_frozen_params
    cfg = _small_config(num_layers=2, embed_dim=64, mlp_dim=128, vocab_size=256)
    cfg.model = dataclasses.replace(
        cfg.model, lora=dataclasses.replace(cfg.model.lora, rank=4, quantize=kind))
    frozen = count_frozen_params(cfg)
    est = memory.estimate_config(cfg, num_devices=4, stage=3, frozen_params=frozen)
    stored = _stored_base_bytes(cfg.model, kind)
    assert stored < frozen * (0.6 if kind == "nf4" else 1.1)  # the layout is 4 or 8 bits
    assert est.device.compute_weights == pytest.approx(stored / 4, rel=1e-12)
    assert est.device.gradients == est.device.master == est.device.optimizer == 0
    # The planner's instant what-if reads the same stored bytes.
    from zeroflow.planner.problems import ConfigProblem
    spec = ConfigProblem(cfg).spec
    assert spec.frozen_bytes_per_param * spec.frozen_params == pytest.approx(stored, rel=1e-12)


def test_planner_counts_a_quantize_frozen_tree_at_its_packed_bytes():
    """``zf.plan``'s what-if of a tree from ``zf.quantize_frozen``: the frozen leaves' stored
    bytes are the packed arrays' sizes plus the unquantized vectors in the compute dtype."""
    from zeroflow.planner.problems import ModelProblem
    params = {"w": jnp.ones((64, 128)), "b": jnp.ones((128,)), "a": jnp.ones((4,))}
    qparams, qmask = zf.quantize_frozen(params, {"w": False, "b": False, "a": True}, "nf4")
    batch = {"x": jax.ShapeDtypeStruct((8, 4), jnp.float32)}
    problem = ModelProblem(lambda p, b: 0.0, qparams, batch, optax.adam(1e-3),
                           zf.Precision(params="bf16"), trainable=qmask)
    stored = qparams["w"].data.size * 1 + 128 * 2  # uint8 bytes, the bias in bf16
    spec = problem.spec
    assert spec.frozen_bytes_per_param * spec.frozen_params == stored


def test_cli_estimate_of_qlora_tiny_drops_by_the_packed_base(tmp_path, capsys):
    """configs/qlora-tiny.yaml's formula column (its base's config.json as
    scripts/make_tiny_hf.py writes it): NF4 storage takes the bf16 base's bytes less its packed
    ones, over the 2 devices of stage 3, off the estimated peak (it trains in fp32: 4 bytes
    a weight unquantized)."""
    from pathlib import Path

    from zeroflow.config.io import load_config
    from zeroflow.trainer.setup import run_model_config
    (tmp_path / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 512,
        "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256,
        "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False}))
    config = str(Path(__file__).resolve().parents[1] / "configs/qlora-tiny.yaml")
    argv = ["--config", config, "--devices", "2", "--measure", "never", "--stages", "3",
            "--offloads", "none", "--remats", "full", "--json", f"model.init_from={tmp_path}"]
    peaks = {}
    for kind in ("nf4", "none"):
        assert main([*argv, f"model.lora.quantize={kind}"]) == 0
        (row,) = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
        peaks[kind] = row["estimated_peak_bytes"]
    cfg = load_config(config, [f"model.init_from={tmp_path}"])
    assert cfg.precision.params == "fp32"
    model = run_model_config(cfg)
    params = memory.count_gpt_params(model)
    drop = (4 * params - _stored_base_bytes(model, "nf4", width=4)) / 2
    assert abs(peaks["none"] - peaks["nf4"] - drop) <= 1  # each peak rounded to a byte
