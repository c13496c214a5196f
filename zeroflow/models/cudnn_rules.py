"""Which attention shapes cuDNN's flash attention takes, checked before a step is traced into
jax's cuDNN call, which refuses them there with its own NotImplementedError.

The rule is jax's (``check_is_flash_attention`` for bf16/fp16, the same in jax 0.10.2 and
0.12): the head dim must be a multiple of 8 and at most 256 on compute capability 9.0 and
later (Hopper, Blackwell), at most 128 before (Ampere, Ada: A100, L4). Gemma 2/3's head dim
of 256 (1B-12B) therefore runs on H100s and not on A100s.
"""

from __future__ import annotations

HOPPER = (9, 0)
"The compute capability from which cuDNN's flash attention takes head dims up to 256."
MAX_HEAD_DIM_BEFORE_HOPPER = 128
MAX_HEAD_DIM_FROM_HOPPER = 256
HEAD_DIM_MULTIPLE = 8


def cudnn_max_head_dim(capability: tuple[int, int]) -> int:
    """The largest head dim cuDNN's flash attention takes on a GPU of ``capability``."""
    return MAX_HEAD_DIM_FROM_HOPPER if capability >= HOPPER else MAX_HEAD_DIM_BEFORE_HOPPER


def _named(capability: tuple[int, int]) -> str:
    return f"{capability[0]}.{capability[1]}"


def cudnn_attention_problem(
    head_dim: int, capability: tuple[int, int] | None, device_kind: str = ""
) -> str | None:
    """One line saying why ``model.attention: cudnn`` cannot run a head dim of ``head_dim`` on
    GPUs of ``capability`` (``device_kind`` names them), or None when it can, or when the
    capability is unknown (then jax decides). The planner and the trainer ask it for a target
    before compiling a plan; the model asks it while the step is traced."""
    if capability is None:
        return None
    limit = cudnn_max_head_dim(capability)
    if head_dim <= limit and head_dim % HEAD_DIM_MULTIPLE == 0:
        return None
    gpu = f"{device_kind} GPUs" if device_kind else "these GPUs"
    return (
        f"model.attention='cudnn' cannot run head dim {head_dim} on {gpu} (compute capability "
        f"{_named(capability)}): cuDNN flash attention takes head dims that are multiples of "
        f"{HEAD_DIM_MULTIPLE}, up to {MAX_HEAD_DIM_BEFORE_HOPPER} before compute capability "
        f"{_named(HOPPER)} and up to {MAX_HEAD_DIM_FROM_HOPPER} from {_named(HOPPER)} (H100, "
        "H200); use model.attention=xla on these GPUs"
    )
