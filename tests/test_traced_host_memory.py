"""The instant estimate's walk of values moved between host and device memory
(``jax.memory.Space``: how JAX's remat offloads residuals and the engine streams offloaded state):
a value parked in host memory takes no device memory, and one brought to the device takes its
device share there. References: bytes written out by hand, and XLA:GPU's compiled peak."""
import jax
import jax.numpy as jnp
import pytest

from zeroflow.memory.traced import walk

MB = 1024 * 1024  # one (1024, 256) float32 matrix
WIDE = jax.ShapeDtypeStruct((1024, 256), jnp.float32)
SQUARE = jax.ShapeDtypeStruct((256, 256), jnp.float32)


def _parked(x, w):
    """``a`` waits in host memory while ``b`` and ``c`` are made, then comes back."""
    a = jnp.sin(x) @ w
    parked = jax.device_put(a, jax.memory.Space.Host)
    b = jnp.cos(x) @ w
    c = b @ w
    back = jax.device_put(parked, jax.memory.Space.Device)
    return jnp.sum(back * c)


@pytest.mark.fast
def test_a_value_parked_in_host_memory_takes_no_device_memory():
    """At ``c = b @ w`` the device holds ``b`` and ``c`` (1 MB each); ``a`` is on the host. At
    the sum (the product fused into it) it holds ``a`` back, ``c`` and the 4-byte sum. The walk
    counting ``a`` at ``c = b @ w`` too (3 MB) is what it did before moves were read."""
    jaxpr = jax.make_jaxpr(_parked)(WIDE, SQUARE).jaxpr
    got = walk(jaxpr, [1.0, 1.0])
    assert got.peak == 2 * MB + 4, got
    # Kept on the device instead, the same program holds all three at that point.
    kept = jax.make_jaxpr(lambda x, w: _parked_on_device(x, w))(WIDE, SQUARE).jaxpr
    assert walk(kept, [1.0, 1.0]).peak == 3 * MB


def _parked_on_device(x, w):
    a = jnp.sin(x) @ w
    b = jnp.cos(x) @ w
    c = b @ w
    return jnp.sum(a * c)


@pytest.mark.fast
def test_state_in_host_memory_comes_in_at_its_device_share():
    """An input in host memory (share 0 on the device) brought in with ``Space.Device``: its copy
    is its share of a device (a quarter here: sharded over 4), not nothing."""

    def step(x_host, w):
        x = jax.device_put(x_host, jax.memory.Space.Device)
        return jnp.sum(x @ w)

    jaxpr = jax.make_jaxpr(step)(WIDE, jax.ShapeDtypeStruct((256, 8), jnp.float32)).jaxpr
    got = walk(jaxpr, [0.0, 1.0], in_homes=[0.25, 1.0])
    copy, product = MB / 4, 1024 * 8 * 4 / 4
    assert got.peak == pytest.approx(copy + product), got


@pytest.mark.slow
@pytest.mark.parametrize("config,overrides,stage,offload,remat", [
    # The matmul outputs offloaded (8 x H100, configs/tiny.yaml): was 1.26x of XLA:GPU.
    ("configs/tiny.yaml", [], 0, "none", "offload_dots"),
    # The layer inputs offloaded, the optimizer state in host memory (1 x H100, 884,736 tokens,
    # docs/long_context.md's run): was 3.45x.
    ("configs/long-context-llama3-8b.yaml", ["model.seq_len=884736"], 0, "optimizer",
     "offload_input"),
])
def test_offloaded_steps_on_h100s_are_near_xla_gpus_peak(config, overrides, stage, offload, remat):
    from helpers import require_cuda_plugin

    from zeroflow.config.io import load_config
    from zeroflow.memory.measure import analysed, device_peak
    from zeroflow.trainer.planning import compile_config, trace_config

    require_cuda_plugin()
    cfg = load_config(config, overrides)
    devices = 8 if config.endswith("tiny.yaml") else 1
    choice = dict(num_devices=devices, stage=stage, offload=offload, update_on="device",
                  remat=remat, target="h100")
    est = trace_config(cfg, **choice).peak_bytes
    compiled, setup = compile_config(cfg, **choice)
    xla = device_peak(analysed(compiled), setup.state)
    assert abs(est / xla - 1) <= 0.1, (est, xla)
