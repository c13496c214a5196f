"""LoRA in the trainer and export (model.lora.*), against transformers + peft: a tiny GPT-2
built by transformers is fine-tuned with adapters through the real entry points; its losses are
those of peft on the exported adapter folders, its base weights come out bit for bit, the merged
export and the peft folder give the adapted logits, and bad settings are one line each."""
import contextlib
import io

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from zeroflow.config.io import ConfigError, load_config, parse_cli, save_config

pytestmark = pytest.mark.slow

torch = pytest.importorskip("torch", reason="torch is in the test extra")
transformers = pytest.importorskip("transformers", reason="transformers is in the test extra")
peft = pytest.importorskip("peft", reason="peft is in the test extra")

from zeroflow.cli import export  # noqa: E402
from zeroflow.data import eval_batches, load_data, train_batch  # noqa: E402
from zeroflow.util.tree import path_str  # noqa: E402
from zeroflow.trainer import build_run, train  # noqa: E402
from zeroflow.trainer.checkpoints import RunCheckpoints  # noqa: E402

RANK, ALPHA, WIDTH, LAYERS, SEQ, BATCH = 4, 8.0, 32, 2, 32, 8


def _run_config(base, run_dir, steps):
    return load_config("configs/tiny.yaml", [
        f"model.init_from={base}", f"model.seq_len={SEQ}", f"train.batch_size={BATCH}",
        "data.max_bytes=200000", f"train.steps={steps}", "train.warmup_steps=0",
        "train.eval_every=0", "train.eval_batches=1", "train.log_every=1", "checkpoint.every=1",
        "run.progress=false", f"model.lora.rank={RANK}", f"model.lora.alpha={ALPHA}",
        "parallel.zero_stage=3", f"run.dir={run_dir}"])


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory):
    """A tiny GPT-2 made by transformers, fine-tuned 2 steps with adapters on every attention
    and MLP projection (the default targets) at ZeRO stage 3, a checkpoint per step."""
    root = tmp_path_factory.mktemp("lora-run")
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=256, n_embd=WIDTH, n_layer=LAYERS, n_head=2, n_positions=64)).eval()
    model.save_pretrained(root / "base")
    cfg = _run_config(root / "base", root / "run", steps=2)
    shown = io.StringIO()
    with contextlib.redirect_stdout(shown):
        result = train(cfg)
    return dict(cfg=cfg, result=result, banner=shown.getvalue(), root=root, base=root / "base",
                run=root / "run", base_params=sum(p.numel() for p in model.parameters()))


def _checkpoint(cfg, step):
    """The run and its parameters ({"base", "lora"}) at checkpoint ``step``."""
    run = build_run(cfg, with_data=False)
    checkpoints = RunCheckpoints(cfg.run.dir + "/checkpoints", 3, read_only=True)
    state, _ = checkpoints.read(run.abstract_state(), step)
    checkpoints.close()
    return run, state.params


def _flat(tree):
    return {path_str(p): np.asarray(x) for p, x in jax.tree_util.tree_leaves_with_path(tree)}


def _peft_model(base, folder):
    model = transformers.AutoModelForCausalLM.from_pretrained(base)
    return peft.PeftModel.from_pretrained(model, folder).eval()


def _next_token_loss(model, tokens: np.ndarray) -> float:
    with torch.no_grad():
        logits = model(torch.tensor(tokens[:, :-1], dtype=torch.long)).logits
        targets = torch.tensor(tokens[:, 1:], dtype=torch.long).reshape(-1)
        return float(torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                                       targets))


def _batch(cfg, step_index):
    data = load_data(cfg.data, cfg.model.seq_len)
    return train_batch(data.train, step_index, global_batch=BATCH, seq_len=SEQ, seed=cfg.train.seed)


def _export_peft(run_dir, out, step):
    assert export.main(["--run", str(run_dir), "--format", "peft", "--out", str(out),
                        "--step", str(step)]) == 0


def test_trainer_trains_adapters_only_and_its_loss_is_peft_on_its_checkpoint(lora_run):
    from zeroflow import hf
    cfg, result = lora_run["cfg"], lora_run["result"]
    # Adapters by hand: r * (in + out) per adapted projection and layer (GPT-2's fused c_attn
    # holds query, key and value: three of them).
    mlp = 4 * WIDTH
    per_layer = RANK * (4 * (WIDTH + WIDTH) + (WIDTH + mlp) + (mlp + WIDTH))
    assert (f"LoRA r={RANK}, {LAYERS * per_layer:,} adapter params trained, "
            f"{lora_run['base_params']:,} frozen") in lora_run["banner"]

    run, step1 = _checkpoint(cfg, 1)
    _, step2 = _checkpoint(cfg, 2)
    loaded = _flat(hf.load_params(lora_run["base"], run.model_cfg))
    for params in (step1, step2):  # frozen: bit for bit as read from the HF checkpoint
        for path, value in _flat(params["base"]).items():
            np.testing.assert_array_equal(value, loaded[path], err_msg=path)
    adapters1, adapters2 = _flat(step1["lora"]), _flat(step2["lora"])
    for path, value in adapters2.items():  # every factor trains (b starts at zero)
        assert not np.array_equal(value, adapters1[path]), path
        assert np.abs(value).max() > 0, path

    # Step 2's loss is peft's on the step-1 checkpoint's adapters, for step 2's batch.
    _export_peft(lora_run["run"], lora_run["root"] / "peft1", 1)
    reference = _next_token_loss(_peft_model(lora_run["base"], lora_run["root"] / "peft1"),
                                 _batch(cfg, 1))
    assert result.losses[2] == pytest.approx(reference, abs=1e-4)
    assert abs(result.losses[2] - result.losses[1]) > 1e-3  # the adapters moved the loss


def test_lora_run_resumes_as_if_uninterrupted(lora_run, tmp_path):
    """A LoRA run stopped after step 1 and resumed from its checkpoint (adapters, their AdamW
    state and the frozen base restored) makes step 2 exactly as the uninterrupted run did."""
    import dataclasses
    import shutil
    copy = tmp_path / "run"
    shutil.copytree(lora_run["run"], copy)
    shutil.rmtree(copy / "checkpoints" / "2")
    cfg = lora_run["cfg"]
    resumed_cfg = dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, dir=str(copy)))
    shown = io.StringIO()
    with contextlib.redirect_stdout(shown):
        result = train(resumed_cfg)
    assert "resumed from step 1" in shown.getvalue()
    assert sorted(result.losses) == [2]
    assert result.losses[2] == lora_run["result"].losses[2]
    _, resumed = _checkpoint(resumed_cfg, 2)
    _, uninterrupted = _checkpoint(cfg, 2)
    for name, value in _flat(uninterrupted).items():
        np.testing.assert_array_equal(_flat(resumed)[name], value, err_msg=name)


def test_merged_hf_export_and_peft_folder_give_our_adapted_logits(lora_run):
    import zeroflow as zf
    from zeroflow.models import GPT
    cfg = lora_run["cfg"]
    run, params = _checkpoint(cfg, 2)
    tokens = np.random.default_rng(0).integers(0, 256, (2, 9))
    model = GPT(run.model_cfg)
    lo = zf.lora(lambda p, t: model.apply({"params": p}, t), rank=RANK, alpha=ALPHA,
                 targets=cfg.model.lora.targets)
    ours = np.asarray(jax.jit(lo.loss)(params, jnp.asarray(tokens)))
    base_logits = np.asarray(model.apply({"params": params["base"]}, tokens))
    assert np.abs(ours - base_logits).max() > 1e-3  # trained adapters change the logits

    merged_dir, peft_dir = lora_run["root"] / "merged", lora_run["root"] / "peft-latest"
    assert export.main(["--run", str(lora_run["run"]), "--format", "hf",
                        "--out", str(merged_dir)]) == 0
    assert export.main(["--run", str(lora_run["run"]), "--format", "peft",
                        "--out", str(peft_dir)]) == 0
    assert {"adapter_config.json", "adapter_model.safetensors"} <= {
        p.name for p in peft_dir.iterdir()}
    merged = transformers.AutoModelForCausalLM.from_pretrained(merged_dir).eval()
    adapted = _peft_model(lora_run["base"], peft_dir)
    with torch.no_grad():
        theirs_merged = merged(torch.tensor(tokens)).logits.numpy()
        theirs_peft = adapted(torch.tensor(tokens)).logits.numpy()
    np.testing.assert_allclose(theirs_merged, ours, atol=1e-4, rtol=0)
    np.testing.assert_allclose(theirs_peft, ours, atol=1e-4, rtol=0)
    # The run's final evaluation is peft's loss on the held-out batch.
    held_out = eval_batches(load_data(cfg.data, SEQ).val, num_batches=1, global_batch=BATCH,
                            seq_len=SEQ, process_index=0, process_count=1)
    expected = np.mean([_next_token_loss(adapted, b) for b in held_out])
    assert lora_run["result"].eval["eval_loss"] == pytest.approx(expected, abs=1e-4)


def test_peft_export_of_a_run_without_lora_is_one_line(tmp_path, capsys):
    save_config(load_config("configs/tiny.yaml"), tmp_path / "config.yaml")
    code = export.main(["--run", str(tmp_path), "--format", "peft", "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "\n" not in err
    assert "model.lora.rank is 0" in err and "--format hf" in err


@pytest.mark.parametrize("overrides,match", [
    (["model.lora.rank=-1"], "model.lora.rank must be >= 0"),
    (["model.lora.alpha=0"], "model.lora.alpha must be positive"),
    (["model.lora.dropout=1"], r"model.lora.dropout must be in \[0, 1\)"),
    (["model.lora.rank=4", "model.lora.targets=("], "model.lora.targets must be a regular"),
    (["model.lora.rank=4", "train.freeze=embedding"], "LoRA already freezes every base weight"),
    (["model.lora.rnk=4"], "unknown key 'model.lora.rnk'.*did you mean 'model.lora.rank'.* "
                           "valid keys in model.lora: rank, alpha, targets, dropout"),
    (["model.lora=4"], "model.lora is a section: set its keys"),
])
def test_lora_config_errors_are_one_line(overrides, match):
    with pytest.raises(ConfigError, match=match) as info:
        load_config("configs/tiny.yaml", overrides)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("targets,match", [
    ("nothing", "matches no parameter; the model's parameters are embedding, final_norm/scale"),
    ("^embedding", "'embedding'.*cannot be adapted"),
])
def test_lora_targets_the_model_cannot_take_are_one_line(targets, match):
    cfg = load_config("configs/tiny.yaml", ["model.num_layers=1", "model.embed_dim=32",
                                            "model.lora.rank=2", f"model.lora.targets={targets}"])
    with pytest.raises(ValueError, match=match) as info:
        build_run(cfg, with_data=False)
    assert "\n" not in str(info.value)


def test_lora_keys_round_trip_through_yaml_and_the_command_line(tmp_path):
    cfg = parse_cli(["--config", "configs/tiny.yaml", "model.lora.rank=8", "model.lora.alpha=16",
                     "model.lora.targets=attn/(query|value)/kernel", "model.lora.dropout=0.1"])
    assert (cfg.model.lora.rank, cfg.model.lora.alpha, cfg.model.lora.dropout) == (8, 16.0, 0.1)
    save_config(cfg, tmp_path / "c.yaml")
    assert "lora:\n    rank: 8" in (tmp_path / "c.yaml").read_text()
    assert load_config(tmp_path / "c.yaml") == cfg
    (tmp_path / "n.yaml").write_text("model:\n  lora:\n    rank: 2\n    targets: mlp\n")
    nested = load_config(tmp_path / "n.yaml").model.lora
    assert (nested.rank, nested.targets, nested.alpha) == (2, "mlp", 8.0)  # peft's alpha


def test_tensor_parallel_rules_reach_the_frozen_base():
    """With parallel.model=2 the base's attention heads are split over ``model`` as without
    LoRA (the rules are exact paths, so they must follow the weights under ``base/``)."""
    cfg = load_config("configs/tiny.yaml", ["model.num_layers=1", "model.embed_dim=32",
                                            "model.num_heads=2", "model.mlp_dim=64",
                                            "parallel.model=2", "model.lora.rank=2"])
    state = build_run(cfg, with_data=False).abstract_state()
    specs = {path_str(p): x.sharding.spec for p, x in
             jax.tree_util.tree_leaves_with_path(state.frozen)}
    assert "model" in specs["base/layers/attn/query/kernel"]
    assert "model" in specs["base/layers/mlp/down/kernel"]
