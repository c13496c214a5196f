"""``import zeroflow`` changes nothing in the process that imports it and imports no layer until
a name is used; the commands check what they were given before jax is imported, and write
their errors and warnings with one prefix, ``zeroflow.<command>: error|warning: ``."""

import json
import os
import subprocess
import sys

import pytest

from helpers import REPO

def _python(code: str, **env) -> subprocess.CompletedProcess:
    """``code`` in a fresh interpreter on this checkout, with the environment a user has (no
    JAX_PLATFORMS: where the CUDA plugin has no driver, a command sets it)."""
    environ = {k: v for k, v in os.environ.items() if k not in ("JAX_PLATFORMS", "XLA_FLAGS")}
    environ.update(PYTHONPATH=str(REPO), **env)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          cwd=REPO, env=environ, timeout=300)


def _json_of(run: subprocess.CompletedProcess):
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


HIGH_LAYERS = ("zeroflow.planner", "zeroflow.trainer", "zeroflow.cli", "zeroflow.lora",
               "zeroflow.hf", "zeroflow.fusemix", "zeroflow.memory", "zeroflow.xla")


@pytest.mark.fast
def test_import_zeroflow_leaves_the_environment_jax_and_signals_as_they_were():
    # Taken before and after, with jax imported first as a program would: os.environ, jax's
    # plugin discovery (once replaced at import), the signal handlers, the import machinery.
    code = f"""
import json, os, signal, sys
import jax
from jax._src import xla_bridge
env, discover, finders = dict(os.environ), xla_bridge.discover_pjrt_plugins, list(sys.meta_path)
handlers = {{s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}}
import zeroflow
print(json.dumps({{
    "environ_changes": sorted(set(os.environ.items()) ^ set(env.items())),
    "discover_same": xla_bridge.discover_pjrt_plugins is discover,
    "signals_same": all(signal.getsignal(s) is h for s, h in handlers.items()),
    "finders_same": sys.meta_path == finders,
    "layers": sorted(m for m in sys.modules if m.startswith({HIGH_LAYERS!r})),
}}))
"""
    got = _json_of(_python(code))
    assert got == {"environ_changes": [], "discover_same": True, "signals_same": True,
                   "finders_same": True, "layers": []}


@pytest.mark.fast
def test_import_zeroflow_alone_imports_neither_jax_nor_a_layer():
    code = """
import json, os, signal, sys
env, finders, handler = dict(os.environ), list(sys.meta_path), signal.getsignal(signal.SIGINT)
import zeroflow
print(json.dumps({
    "environ_changes": sorted(set(os.environ.items()) ^ set(env.items())),
    "finders_same": sys.meta_path == finders,
    "signal_same": signal.getsignal(signal.SIGINT) is handler,
    "modules": sorted(m for m in sys.modules if m == "jax" or m.startswith("zeroflow.")),
}))
"""
    # the one module it reads: whether this process is a ``python -m zeroflow.<command>``
    assert _json_of(_python(code)) == {"environ_changes": [], "finders_same": True,
                                       "signal_same": True,
                                       "modules": ["zeroflow.util", "zeroflow.util.interrupts"]}


@pytest.mark.fast
def test_the_public_names_are_the_documented_objects():
    """Each public name, read from the package, is the object of the module the docs name;
    ``zf.autocast`` and ``zf.lora`` stay the functions once their sub-packages are loaded."""
    code = """
import json
import zeroflow as zf
import zeroflow.autocast.interpret, zeroflow.lora.transform, zeroflow.planner.library
import zeroflow.autocast.precision, zeroflow.engine.offload, zeroflow.memory, zeroflow.optim
m = __import__("sys").modules
print(json.dumps({
    "autocast": zf.autocast is m["zeroflow.autocast.interpret"].autocast,
    "lora": zf.lora is m["zeroflow.lora.transform"].lora,
    "plan": zf.plan is m["zeroflow.planner.library"].plan,
    "Precision": zf.Precision is m["zeroflow.autocast.precision"].Precision,
    "offload": zf.offload is m["zeroflow.engine.offload"],
    "memory": zf.memory is m["zeroflow.memory"] and callable(zf.memory.estimate),
    "optim": callable(zf.optim.adamw_8bit),
    "all": [n for n in zf.__all__ if getattr(zf, n, None) is None],
    "dir": sorted(set(zf.__all__) - set(dir(zf))),
}))
"""
    got = _json_of(_python(code))
    assert got == {"autocast": True, "lora": True, "plan": True, "Precision": True,
                   "offload": True, "memory": True, "optim": True, "all": [], "dir": []}
    import zeroflow as zf
    with pytest.raises(AttributeError, match="no attribute 'no_such_name'"):
        zf.no_such_name  # noqa: B018


BAD_INPUTS = [
    ("train", ["--config", "configs/tiny.yaml", "bad.key=1"], "unknown section 'bad'"),
    ("train", ["--config", "configs/tiny.yaml", "train.stesp=5"], "did you mean 'train.steps'"),
    ("train", ["--config", "configs/tiny.yaml", "precision.params=fp8"], "precision.params"),
    ("train", ["--config", "configs/tiny.yaml", "precision.autocast=fp16"], "loss scaling"),
    ("train", ["--config", "no/such.yaml"], "config file not found: no/such.yaml"),
    ("train", ["--config", "configs/tiny.yaml", "--bogus"], "unrecognized arguments: --bogus"),
    ("sample", ["--run", "no/such/run"], "no/such/run has no config.yaml"),
    ("export", ["--run", "no/such/run", "--out", "w.npz"], "no/such/run has no config.yaml"),
    ("export", ["--run", "no/such/run", "--out", "w.txt"], "--out must end in"),
    ("launch", ["--processes", "0", "--", "true"], "--processes must be at least 1"),
]


@pytest.mark.fast
@pytest.mark.parametrize("command, argv, message", BAD_INPUTS,
                         ids=[f"{c}-{m[:24]}" for c, _, m in BAD_INPUTS])
def test_a_bad_input_is_refused_before_jax_is_imported(command, argv, message):
    code = f"""
import json, sys
from zeroflow.cli import {command} as cli
try:
    code = cli.main({argv!r})
except SystemExit as e:  # argparse ends the process itself
    code = e.code
print(json.dumps([code, "jax" in sys.modules]))
"""
    run = _python(code)
    assert _json_of(run) == [2, False]
    assert run.stderr.splitlines() == [run.stderr.strip()]  # one line
    assert run.stderr.startswith(f"zeroflow.{command}: error: ") and message in run.stderr


@pytest.mark.fast
def test_a_command_writes_errors_and_warnings_with_its_prefix():
    # A process prepared as ``python -m zeroflow.sample`` prepares it: zeroflow's logged
    # warnings and Python warnings raised in zeroflow's code read "zeroflow.sample: warning:",
    # another library's Python warning keeps Python's own form.
    code = f"""
import logging, sys, warnings
sys.orig_argv = [sys.executable, "-m", "zeroflow.sample", "--run", "r"]
from zeroflow.cli import common
common.start_command()
logging.getLogger("zeroflow").warning("checkpoint 4 has no digests")
logging.getLogger("zeroflow.trainer").error("cannot draw plot.png")
warnings.warn_explicit("a ragged batch", UserWarning, {str(REPO / "zeroflow" / "engine" / "plan.py")!r}, 1)
warnings.warn_explicit("old option", UserWarning, "/lib/other/thing.py", 7)
"""
    run = _python(code)
    assert run.returncode == 0, run.stderr
    assert run.stderr.splitlines() == [
        "zeroflow.sample: warning: checkpoint 4 has no digests",
        "zeroflow.sample: error: cannot draw plot.png",
        "zeroflow.sample: warning: a ragged batch",
        "/lib/other/thing.py:7: UserWarning: old option",
    ]


@pytest.mark.slow
@pytest.mark.parametrize("argv, line", [
    (["zeroflow.train", "--config", "configs/tiny.yaml", "bad.key=1"],
     "zeroflow.train: error: unknown section 'bad' (in override 'bad.key=1'); valid sections: "
     "model, data, train, parallel, precision, checkpoint, run, fusemix"),
    (["zeroflow.train", "--bogus"],
     "zeroflow.train: error: unrecognized arguments: --bogus (--help lists the flags)"),
    (["zeroflow.memory", "--bogus"],
     "zeroflow.memory: error: unrecognized arguments: --bogus (--help lists the flags)"),
])
def test_a_command_s_bad_input_is_its_one_line_and_nothing_else(argv, line):
    """As a user runs it: one line on stderr, nothing of the CUDA plugin's where it has no
    driver (``zeroflow.memory`` imports jax before it reads its flags)."""
    environ = {k: v for k, v in os.environ.items() if k not in ("JAX_PLATFORMS", "XLA_FLAGS")}
    run = subprocess.run([sys.executable, "-m", *argv], capture_output=True, text=True, cwd=REPO,
                         env={**environ, "PYTHONPATH": str(REPO)}, timeout=300)
    assert (run.returncode, run.stderr, run.stdout) == (2, line + "\n", "")


@pytest.mark.fast
def test_one_spelling_of_the_remat_policies():
    # The config's vocabulary (util.settings, no jax) and the memory estimator's
    import importlib

    from zeroflow.config.schema import ModelConfig, choices_of

    estimate = importlib.import_module("zeroflow.memory.estimate")
    assert choices_of(ModelConfig)["remat"] == tuple(estimate.REMATS)
