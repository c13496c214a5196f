"""Helpers shared by several test files (tests/ is on sys.path under pytest): loading scripts,
walking jaxprs, and the loops and comparisons the engine tests run against plain optax."""
import importlib.util
import os
import re
from pathlib import Path

import jax
import numpy as np
import optax
from jax.extend import core as jcore

REPO = Path(__file__).resolve().parents[1]


def one_cpu_env(*, cache_every_program: bool = False, **extra) -> dict[str, str]:
    """The environment of a program a test starts as a user would: one CPU device (without the
    suite's 8 emulated ones), the suite's cheap-compile XLA flags (tests/conftest.py: a tiny
    run starts in about half the time), and ``extra`` on top. ``cache_every_program``: every
    program it compiles goes to the persistent compilation cache (the test run's, from
    conftest, unless ``extra`` names another), however quickly it compiled, so a second
    process running the same command loads them instead of compiling."""
    flags = re.sub(r"--xla_force_host_platform_device_count=\d+", "", os.environ.get("XLA_FLAGS", ""))
    cache = ({"JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
              "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "-1"} if cache_every_program else {})
    return {**os.environ, "PYTHONPATH": str(REPO), "XLA_FLAGS": " ".join(flags.split()), **cache,
            **extra}


def load_script(name):
    """The module of ``scripts/<name>.py`` (scripts are not a package)."""
    spec = importlib.util.spec_from_file_location(name, REPO / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def walk(jaxpr):
    """Every equation of ``jaxpr`` and of its sub-jaxprs, depth first."""
    jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
    for eqn in jaxpr.eqns:
        yield eqn
        for sub in jcore.jaxprs_in_params(eqn.params):
            yield from walk(sub)


# --- training loops -----------------------------------------------------------------------------

def train_losses(step, state, batches):
    """Run the engine's ``step`` once per batch: (the losses as a list of floats, the final
    state, the last step's metrics)."""
    losses, metrics = [], None
    for batch in batches:
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
    return losses, state, metrics


def optax_losses(loss_fn, tx, params, batches, *, has_aux=False, jit=False):
    """The reference the engine is held to: ``value_and_grad`` and plain optax on one device,
    one batch per step. ``jit``: compile the gradient function (as a caller's own loop would).
    Returns (the losses as an array, the final parameters, the final optimizer state)."""
    grad_fn = jax.value_and_grad(loss_fn, has_aux=has_aux)
    grad_fn = jax.jit(grad_fn) if jit else grad_fn
    opt_state, losses = tx.init(params), []
    for batch in batches:
        loss, grads = grad_fn(params, batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        losses.append(float(loss[0] if has_aux else loss))
    return np.array(losses), params, opt_state


# --- comparisons --------------------------------------------------------------------------------

def _leaf_pairs(got, want):
    got, want = jax.tree.leaves(got), jax.tree.leaves(want)
    assert len(got) == len(want), (len(got), len(want))
    return zip(got, want)


def assert_leaves_close(got, want, **tolerances):
    """``np.testing.assert_allclose`` on each pair of leaves of two pytrees, in tree order."""
    for a, b in _leaf_pairs(got, want):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), **tolerances)


def assert_leaves_equal(got, want):
    """Bit-for-bit equality of each pair of leaves of two pytrees, in tree order."""
    for a, b in _leaf_pairs(got, want):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def bytes_on(device, tree) -> int:
    """Bytes of the shards of ``tree``'s arrays that live on ``device``."""
    return sum(s.data.nbytes for x in jax.tree.leaves(tree) for s in x.addressable_shards
               if s.device == device)


def token_batches(count, *, rows, seq_len, vocab):
    """``count`` batches of random next-token data, ``{"tokens": [rows, seq_len + 1]}``, batch
    ``s`` drawn from seed ``s``."""
    return [{"tokens": np.random.default_rng(s).integers(0, vocab, size=(rows, seq_len + 1),
                                                         dtype=np.int32)} for s in range(count)]


def require_cuda_plugin():
    """Skip (the calling test, or at module level the module) where no CUDA plugin is installed:
    XLA:GPU compiles for ``zf.target_mesh`` need ``jax-cuda12-plugin`` or ``jax-cuda13-plugin``,
    which the test extra installs."""
    import pytest

    from zeroflow.util.compat import cuda_plugin_module
    if cuda_plugin_module() is None:
        pytest.skip("no CUDA plugin (jax-cuda12-plugin or jax-cuda13-plugin) is installed: "
                    "pip install -e '.[test]'", allow_module_level=True)


def printed_by(run, *args) -> str:
    """What ``run(*args)`` prints, with ``os.environ`` put back as it was after it (the GPU
    report pins its own process to the CPU platform)."""
    import contextlib
    import io

    saved = dict(os.environ)
    try:
        with contextlib.redirect_stdout(io.StringIO()) as printed:
            run(*args)
    finally:
        os.environ.clear()
        os.environ.update(saved)
    return printed.getvalue()
