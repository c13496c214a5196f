"""``model.layer_chunk`` on an abstract H100 (XLA:GPU, compiled without a GPU): the step of
``configs/long-context-llama3-8b.yaml`` with FP8 layer inputs and two of Llama-3.1-8B's layers,
compiled at two row lengths. What grows with the row is the one layer the backward pass
recomputes. The chunked layer holds for the whole row at most its input gradient, q and the
attention output (8,192 bytes per token each), the FP8 input bytes and k, v (4,096 each), and
one key/value head group's attention-output gradient and q/k/v gradients (2,560) with the
softmax statistics (128): 35,456 bytes per token. The plain layer holds 66,176: the incoming
gradient, the attention norm's output, q, the attention output, the MLP norm's input and
output and a stacked copy of it (8,192 each), the FP8 bytes, k and v (8,192) and fp32 rotary
tables and softmax statistics (640)."""
import dataclasses

import pytest

from helpers import REPO, require_cuda_plugin

pytestmark = pytest.mark.slow

ROWS = (131072, 262144)
CHUNKED_PER_TOKEN = 3 * 8192 + 2 * 4096 + 2560 + 128
PLAIN_PER_TOKEN = 7 * 8192 + 2 * 4096 + 640


def peaks(layer_chunk: int) -> list[float]:
    from zeroflow.cli.max_seq import probe_config
    from zeroflow.config.io import load_config
    from zeroflow.trainer.setup import run_model_config

    cfg = load_config(REPO / "configs/long-context-llama3-8b.yaml",
                      ["model.remat_dtype=fp8", f"model.layer_chunk={layer_chunk}"])
    # Llama-3.1-8B's layers from its config.json, two of them, without reading it again.
    model = dataclasses.replace(run_model_config(cfg), num_layers=2, init_from="")
    probe = probe_config(dataclasses.replace(cfg, model=model), devices=1, target="h100")
    got = [probe(seq).peak_bytes for seq in ROWS]
    assert None not in got, got
    return got


def test_the_chunked_layer_grows_by_its_whole_row_buffers_only():
    require_cuda_plugin()
    plain, chunked = peaks(0), peaks(8192)
    tokens = ROWS[1] - ROWS[0]
    plain_slope, chunked_slope = ((p[1] - p[0]) / tokens for p in (plain, chunked))
    assert chunked_slope <= 1.02 * CHUNKED_PER_TOKEN, (chunked_slope, chunked)
    assert plain_slope >= 0.98 * PLAIN_PER_TOKEN, (plain_slope, plain)
    assert chunked[1] < plain[1]
