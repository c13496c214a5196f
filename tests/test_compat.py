"""zeroflow.util.compat against the jax that is installed (CI runs it on 0.10.2 and 0.11.2): each
helper is checked against what that jax actually traces, compiles or prints."""
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from helpers import REPO, walk
from zeroflow.util import compat

pytestmark = pytest.mark.fast


def _scan_eqn(fn, *args):
    eqns = [e for e in walk(jax.make_jaxpr(fn)(*args)) if e.primitive.name == "scan"]
    assert len(eqns) == 1
    return eqns[0]


def test_scan_split_counts_consts_and_carry_as_traced():
    """Two closed-over arrays (consts), a carry of three leaves, two scanned inputs: the body
    jaxpr's inputs are in that order, and the split says where each group starts."""
    w, b = jnp.ones((4, 4)), jnp.ones((4,))

    def fn(h, xs, ys):
        def body(carry, x):
            h, n, acc = carry
            return (jnp.tanh(h @ w + b + x[0]), n + 1, acc + x[1].sum()), h.sum()
        return lax.scan(body, (h, 0, 0.0), (xs, ys))

    eqn = _scan_eqn(fn, jnp.ones((4,)), jnp.ones((3, 4)), jnp.ones((3, 2)))
    consts, carry = compat.scan_split(eqn.params)
    assert carry == 3
    body = eqn.params["jaxpr"].jaxpr
    assert consts == len(eqn.invars) - carry - 2 >= 2  # w and b (jax may hoist more)
    in_shapes = [v.aval.shape for v in body.invars]
    assert in_shapes[consts:consts + carry] == [(4,), (), ()]
    assert in_shapes[consts + carry:] == [(4,), (2,)]  # one slice of each scanned input
    assert len(eqn.outvars) == carry + 1


def test_scan_split_of_a_scan_without_consts():
    eqn = _scan_eqn(lambda c, xs: lax.scan(lambda c, x: (c + x, c * x), c, xs),
                    jnp.zeros(()), jnp.arange(5.0))
    assert compat.scan_split(eqn.params) == (0, 1)


def test_call_primitives_include_what_this_jax_traces_for_a_call():
    """A nested jit traces to a call equation that ``zeroflow.util.jaxprs.call_body`` opens, and jax's
    closed call primitive (``closed_call`` up to 0.10, ``eval_jaxpr`` from 0.11) is a call."""
    from jax.extend.core.primitives import closed_call_p

    from zeroflow.util.jaxprs import call_body

    traced = jax.make_jaxpr(lambda x: jax.jit(jnp.cos)(x) * 2)(1.0)
    call = traced.jaxpr.eqns[0]
    assert call.primitive.name in compat.CALL_PRIMITIVES
    assert [e.primitive.name for e in call_body(call).jaxpr.eqns] == ["cos"]
    assert closed_call_p.name in compat.CALL_PRIMITIVES


def test_remat_primitive_is_known():
    traced = jax.make_jaxpr(jax.checkpoint(lambda x: jnp.sin(jnp.sin(x))))(1.0)
    assert len(traced.jaxpr.eqns) == 1
    assert traced.jaxpr.eqns[0].primitive.name in compat.REMAT_PRIMITIVES


def test_cpu_widens_half_precision_collectives_as_xla_cpu_compiles_them():
    """XLA:CPU's bf16 all-gather runs through fp32, as the traits carry it."""
    from zeroflow import backend
    traits = backend.for_platform("cpu")
    mesh = jax.make_mesh((2,), ("d",), devices=jax.devices("cpu")[:2])
    split = jax.device_put(jnp.ones((64, 64), jnp.bfloat16), jax.NamedSharding(mesh, jax.P("d")))
    gathered = jax.jit(lambda a: a, out_shardings=jax.NamedSharding(mesh, jax.P()))
    text = gathered.lower(split).compile().as_text()
    assert traits.widens_half_precision and "f32[64,64]{1,0} all-gather(" in text
    assert not backend.for_platform("gpu").widens_half_precision


def test_host_compute_runs_on_pinned_host_arrays():
    """The compiled program marks the function as host compute, its results stay in pinned
    host memory, and the values are the function's."""
    from jax.sharding import NamedSharding, PartitionSpec as P

    mesh = jax.make_mesh((1,), ("x",), devices=jax.devices()[:1])
    host = NamedSharding(mesh, P(), memory_kind="pinned_host")

    def scaled(a):
        return jax.device_put(a * 3.0 + 1.0, jax.memory.Space.Host)

    on_host = compat.host_compute(scaled)
    step = jax.jit(lambda a: on_host(a), out_shardings=host)
    a = jax.device_put(jnp.arange(8.0), host)
    out = step(a)
    np.testing.assert_array_equal(np.asarray(out), np.arange(8.0) * 3.0 + 1.0)
    assert out.sharding.memory_kind == "pinned_host"
    assert "_xla_compute_type" in step.lower(a).as_text()


def test_cuda_plugin_module_is_one_that_imports():
    name = compat.cuda_plugin_module()
    if name is None:
        pytest.skip("no CUDA plugin installed (the test extra installs one)")
    assert name.rsplit(".", 1)[1] in compat.CUDA_PLUGINS
    assert compat.cuda_plugin_install_hint("0.10.2").startswith(
        "pip install jax-cuda12-plugin==0.10.2 jax-cuda12-pjrt==0.10.2")
    assert compat.cuda_plugin_install_hint("0.11.2").startswith(
        "pip install jax-cuda13-plugin==0.11.2")


def test_a_command_s_jax_prints_nothing_without_a_gpu():
    """With the CUDA plugin installed and no GPU driver, a command's process (prepared as
    ``python -m zeroflow.<command>`` prepares it) imports jax and lists its devices with nothing
    on stderr: the CPU is chosen and the plugin's lines muted. Plain jax prints them (the
    control), and so does a program that imports zeroflow, which changes nothing of jax."""
    from zeroflow.util.quiet_jax import has_gpu_driver
    if compat.cuda_plugin_module() is None or has_gpu_driver():
        pytest.skip("needs the CUDA plugin installed on a machine without a GPU driver")
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_PLATFORMS", "XLA_FLAGS")}
    listing = "import jax; print(jax.devices())"
    runs = {code: subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                 cwd=REPO, env=env, timeout=300)
            for code in ("from zeroflow.util import quiet_jax; quiet_jax.quiet_for_this_command(); "
                         + listing, listing)}
    command, plain = runs.values()
    assert command.returncode == 0 and "CpuDevice" in command.stdout, command.stderr[-2000:]
    assert command.stderr == ""
    assert "cuda" in plain.stderr.lower()
