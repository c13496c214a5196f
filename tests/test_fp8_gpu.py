"""FP8 on XLA:GPU targets compiled without the GPU (``zf.target_mesh``): the matmuls of a
training step reach the GEMMs with float8 operands on an H100 (forward e4m3 x e4m3, both
backward products e5m2 x e4m3), and FP8 is refused on a GPU without FP8 tensor cores."""
import re

import jax
import jax.numpy as jnp
import optax
import pytest
from helpers import require_cuda_plugin

require_cuda_plugin()

import zeroflow as zf  # noqa: E402
from zeroflow.autocast.fp8_hlo import count_gemms  # noqa: E402

D, F, V, LAYERS = 256, 512, 1024, 2
BATCH = {"tokens": jax.ShapeDtypeStruct((8, 129), jnp.int32)}


def _params():
    p = {"embed": jnp.zeros((V, D)), "head": jnp.zeros((D, V))}
    for i in range(LAYERS):
        p[f"up{i}"], p[f"down{i}"] = jnp.zeros((D, F)), jnp.zeros((F, D))
    return jax.eval_shape(lambda: p)


def loss_fn(p, b):
    """A plain-JAX residual MLP language model with no thought of precision."""
    x = p["embed"][b["tokens"][:, :-1]]
    for i in range(LAYERS):
        x = x + jax.nn.gelu(x @ p[f"up{i}"]) @ p[f"down{i}"]
    logits = (x @ p["head"]).astype(jnp.float32)
    return optax.softmax_cross_entropy_with_integer_labels(logits, b["tokens"][:, 1:]).mean()


@pytest.mark.fast
def test_fp8_is_refused_without_fp8_tensor_cores_and_accepted_on_ada_and_hopper():
    prec = zf.Precision(autocast="fp8")
    tx = optax.adamw(1e-3)
    with pytest.raises(ValueError, match=r"needs FP8 tensor cores .* is sm_80; use autocast='bf16'") as e:
        zf.make_train_step(loss_fn, tx, zf.ZeroPlan(zf.target_mesh("a100", data=2), stage=3), prec)
    assert "\n" not in str(e.value) and "A100" in str(e.value)
    for gpu in ("l4", "h100"):  # sm_89 and sm_90
        zf.make_train_step(loss_fn, tx, zf.ZeroPlan(zf.target_mesh(gpu, data=2), stage=3), prec)


@pytest.mark.slow
def test_every_matmul_of_the_step_is_an_fp8_gemm_on_h100():
    plan = zf.ZeroPlan(zf.target_mesh("h100", data=2), stage=3)
    prec = zf.Precision(params="bf16", autocast="fp8", fp8_select="all")
    compiled, _ = zf.memory.compile_step(loss_fn, _params(), BATCH, optax.adamw(1e-3), plan, prec)
    gemms = count_gemms(compiled.as_text())
    matmuls = 2 * LAYERS + 1  # up, down per layer, and the head
    assert gemms.fp8 == 3 * matmuls and gemms.other == 0
    kinds = sorted(gemms.fp8_operand_types)
    assert kinds.count(("f8e4m3fn", "f8e4m3fn")) == matmuls  # the forward products
    assert all("f8e5m2" in k for k in kinds if k != ("f8e4m3fn", "f8e4m3fn"))
    # and in bf16 the same step has as many GEMMs, none of them FP8
    compiled, _ = zf.memory.compile_step(loss_fn, _params(), BATCH, optax.adamw(1e-3), plan,
                                         zf.Precision(params="bf16"))
    bf16 = count_gemms(compiled.as_text())
    assert bf16.fp8 == 0 and bf16.other == 3 * matmuls


def _gpt_step_text(gpu: str, remat: str, remat_dtype: str) -> str:
    from zeroflow.config.schema import ModelConfig
    from zeroflow.models.gpt import abstract_params
    from zeroflow.models.loss import make_loss_fn

    cfg = ModelConfig(vocab_size=256, seq_len=128, num_layers=2, embed_dim=128, num_heads=4,
                      mlp_dim=256, remat=remat, remat_dtype=remat_dtype)
    params, _ = abstract_params(cfg)
    plan = zf.ZeroPlan(zf.target_mesh(gpu, data=2), stage=3)
    batch = {"tokens": jax.ShapeDtypeStruct((4, 129), jnp.int32)}
    loss_fn = make_loss_fn(cfg)
    compiled, _ = zf.memory.compile_step(lambda p, b: loss_fn(p, b)[0], params, batch,
                                         optax.adamw(1e-3), plan, zf.Precision(params="bf16"))
    return compiled.as_text()


@pytest.mark.slow
def test_fp8_saved_activations_need_no_fp8_tensor_cores():
    """``model.remat_dtype: fp8`` only stores e4m3 bytes (no FP8 matmul): the GPT step compiles
    for an A100 (sm_80), where FP8 matmuls are refused, with the bytes in the program."""
    text = _gpt_step_text("a100", "save_dots", "fp8")
    assert "f8e4m3fn" in text and "u8[" in text


@pytest.mark.slow
@pytest.mark.parametrize("remat", ["offload_dots", "offload_input"])
def test_offloading_remats_with_fp8_move_bytes_to_the_host(remat):
    """On an H100 (separate host memory) remat offload_dots keeps its matmul outputs and
    offload_input its layer inputs in pinned host memory (memory space S(5)): bf16 in the
    compute dtype, one byte each with fp8."""
    def host_types(remat_dtype):
        text = _gpt_step_text("h100", remat, remat_dtype)
        # a stacked [layers, batch, seq, ...] activation whose layout names the host space
        return set(re.findall(r"\b(u8|bf16)\[2,2,128,[\d,]*\]\{[\d,]*:S\(5\)\}", text))
    assert host_types("compute") == {"bf16"}
    assert host_types("fp8") == {"u8"}


def _entry_parameter_types(text: str) -> list[str]:
    """The element type and shape of each parameter of the compiled program's ENTRY."""
    entry = text[text.index("\nENTRY "):]
    entry = entry[: entry.index("\n}")]
    return re.findall(r"= (\w+\[[\d,]*\])\{?[\d,]*\}? parameter\(", entry)


@pytest.mark.slow
def test_delayed_scaling_compiles_for_an_h100_target_from_an_abstract_state():
    """``zf.memory.compile_step`` lowers the step on an abstract state for devices that hold
    no arrays: under delayed scaling the first FP8 state is made abstract too (it was put on
    the target's devices, which failed). Every matmul is an FP8 GEMM, and the program takes
    one scale and one amax history for each operand and incoming gradient of each matmul."""
    history = 7  # a length nothing else in the program has
    plan = zf.ZeroPlan(zf.target_mesh("h100", data=2), stage=3)
    prec = zf.Precision(params="bf16", autocast="fp8", fp8_select="all",
                        fp8_scaling="delayed", fp8_history=history)
    compiled, _ = zf.memory.compile_step(loss_fn, _params(), BATCH, optax.adamw(1e-3), plan, prec)
    text = compiled.as_text()
    gemms = count_gemms(text)
    matmuls = 2 * LAYERS + 1  # up, down per layer, and the head
    assert gemms.fp8 == 3 * matmuls and gemms.other == 0
    assert _entry_parameter_types(text).count(f"f32[{history}]") == 3 * matmuls
