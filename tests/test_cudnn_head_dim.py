"""cuDNN flash attention's head-dim rule, checked against jax's own
(``check_is_flash_attention``), and its one-line refusal while a step is traced for GPUs
before Hopper (A100, L4: head dims up to 128; Gemma 2/3's 256 needs an H100), which the
planner's row then reports instead of jax's error from inside its cuDNN call."""
import jax
import jax.numpy as jnp
import pytest

from helpers import require_cuda_plugin

pytestmark = pytest.mark.fast


def _jax_refuses(head_dim: int, capability: tuple[int, int], monkeypatch) -> bool:
    """jax's own rule (``check_is_flash_attention``, bf16 training), asked as a GPU of
    ``capability`` would answer it."""
    from jax._src.cudnn import fused_attention_stablehlo as fused
    monkeypatch.setattr(fused, "check_compute_capability",
                        lambda asked: capability >= tuple(int(x) for x in asked.split(".")))
    q = jax.ShapeDtypeStruct((1, 64, 2, head_dim), jnp.bfloat16)
    try:
        fused.check_is_flash_attention(q, q, q, fused.AttentionLayout.BTNH.value, 91000,
                                       False, True)
    except NotImplementedError:
        return True
    return False


@pytest.mark.parametrize("capability", [(8, 0), (8, 6), (8, 9), (9, 0), (10, 0)])
def test_the_cudnn_head_dim_rule_is_jaxs(capability, monkeypatch):
    from zeroflow.models.cudnn_rules import cudnn_attention_problem
    for head_dim in (8, 64, 96, 100, 128, 136, 192, 256, 264, 512):
        ours = cudnn_attention_problem(head_dim, capability, "GPU") is not None
        assert ours == _jax_refuses(head_dim, capability, monkeypatch), (head_dim, capability)


def _tiny(head_dim: int, attention: str):
    from zeroflow.config.schema import ModelConfig
    return ModelConfig(vocab_size=32, seq_len=16, num_layers=1, embed_dim=64, num_heads=2,
                       head_dim=head_dim, mlp_dim=64, attention=attention)


@pytest.mark.parametrize("gpu, refused", [("a100", True), ("l4", True), ("h100", False)])
def test_cudnn_with_head_dim_256_is_refused_before_hopper_while_tracing(gpu, refused):
    """The model's attention, traced for a target's GPUs: one line naming model.attention, the
    head dim and the compute capability before Hopper (jax's NotImplementedError would come from
    inside its cuDNN call); traced as far as XLA's program on an H100."""
    require_cuda_plugin()
    import zeroflow as zf
    from zeroflow import backend
    from zeroflow.backend.targets import compute_capability
    from zeroflow.models.gpt import GPT, abstract_params
    from zeroflow.util import compat
    cfg = _tiny(256, "cudnn")
    shapes = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, jnp.bfloat16),
                          abstract_params(cfg)[0])
    tokens = jax.ShapeDtypeStruct((1, 16), jnp.int32)

    def trace():
        return jax.eval_shape(lambda p, t: GPT(cfg).apply({"params": p}, t), shapes, tokens)

    mesh = zf.target_mesh(gpu, data=1)
    with backend.tracing_for(backend.of(mesh)), compat.cudnn_for_target(compute_capability(gpu)):
        if not refused:
            assert trace().shape == (1, 16, 32)
            return
        with pytest.raises(ValueError) as err:
            trace()
    major, minor = compute_capability(gpu)
    message = str(err.value)
    assert "\n" not in message
    assert message.startswith("model.attention='cudnn' cannot run head dim 256 on NVIDIA")
    assert f"(compute capability {major}.{minor})" in message and "up to 128 before" in message
    assert "use model.attention=xla" in message


def test_the_planner_row_of_a_refused_cudnn_plan_is_the_one_line():
    """What the planner does with a plan that cannot be traced (``failure_reason``): the row
    says the refusal, not jax's error from inside its cuDNN call."""
    require_cuda_plugin()
    from zeroflow.config.io import load_config
    from zeroflow.planner.compiling import failure_reason
    from zeroflow.trainer.planning import compile_config
    cfg = load_config("configs/tiny.yaml", [
        "model.seq_len=16", "model.num_layers=1", "model.num_heads=2", "model.head_dim=256",
        "model.embed_dim=64", "train.batch_size=1", "parallel.grad_accum=1",
        "precision.params=bf16", "model.attention=cudnn"])
    choice = dict(num_devices=1, stage=0, offload="none", update_on="device", remat="none")
    with pytest.raises(ValueError) as err:
        compile_config(cfg, target="a100", **choice)
    row = failure_reason(err.value)
    assert "\n" not in row and row.startswith("ValueError: model.attention='cudnn' cannot run "
                                              "head dim 256 on NVIDIA A100")
