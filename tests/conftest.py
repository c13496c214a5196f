"""Test setup: 8 emulated CPU devices, set before jax is imported anywhere."""
import gc
import importlib.util
import os
from importlib.metadata import version

# pyproject's addopts use plugins of the test extra (-n: pytest-xdist, --nbmake: nbmake); without
# them pytest would end in an INTERNALERROR about this file's hooks. One line instead.
_missing = [name for name in ("xdist", "nbmake") if importlib.util.find_spec(name) is None]
if _missing:
    raise SystemExit(f"the tests need the test extra ({', '.join(_missing)} missing): "
                     "pip install -e \".[test]\"")

# Compiling is a large part of the suite's time, and the tests check numerics and sharding,
# not CPU speed: XLA:CPU skips its expensive optimisation passes, and on jaxlib 0.10 generates
# its fusions with its older emitters, which compile a training step 2-2.5x faster (jaxlib
# 0.11 has only the new ones, and stops on a flag it does not know).
FAST_COMPILES = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
if version("jaxlib").startswith("0.10."):
    FAST_COMPILES += " --xla_cpu_use_fusion_emitters=false"
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8 " + FAST_COMPILES
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

# One compilation cache for the whole run: its worker processes and every process a test starts
# inherit it. Tests compile the same programs again and again (the tiny trainer's step in each
# run a test starts, the same small model in many tests), and XLA compiling is most of the
# suite's time. Keyed by the program, the devices and XLA's options, so a hit is the program
# the test would have compiled; a fresh folder per run, so no run's timing depends on another.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    import atexit
    import shutil
    import tempfile

    os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="zeroflow-test-compiles-")
    atexit.register(shutil.rmtree, os.environ["JAX_COMPILATION_CACHE_DIR"], ignore_errors=True)
    # Every program, however quickly it compiles (JAX keeps only those over a second by
    # default): the tests build the same small steps in many places, as new function objects
    # that JAX's in-memory cache does not recognise (test_engine + test_padding +
    # test_autocast_train in one process: 139 -> 128 CPU-s).
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "-1")


import pytest  # noqa: E402  (after the environment above: pytest's plugins may import jax)

TIERS = ("fast", "slow")
NOTEBOOKS = "experiments/notebooks"


def pytest_report_header(config):
    return [f"tier: {_tier_asked(config)} (python -m pytest: the fast tier; -m slow: the "
            "end-to-end tier; -m \"\": both; tests/conftest.py)"]


def _tier_asked(config) -> str:
    expression = config.getoption("markexpr", "")
    return {"not slow": "fast", "slow": "slow", "": "both"}.get(expression, expression)


def pytest_configure(config):
    # One line per finished test file rather than a dot per test: what a person watching a
    # long run on two cores wants to know is how far it is.
    from file_progress import FileProgress

    if not hasattr(config, "workerinput"):  # the process that prints, not an xdist worker
        config.pluginmanager.register(FileProgress(config), "file-progress")


def pytest_collection_finish(session):
    # What collection imported (jax, torch, transformers, the test modules) lives until the
    # end: frozen, Python's cyclic collector stops walking it again and again, and it runs
    # less often. test_engine + test_frozen in one process: 5.3 -> 1.8 s collecting garbage,
    # about 3% of their CPU time (2026-12-02).
    gc.collect()
    gc.freeze()
    gc.set_threshold(20_000, 10, 10)


def pytest_xdist_auto_num_workers(config):
    # ``-n auto`` (pyproject's addopts): a worker per core this process may run on, but no more
    # than one per 4 GiB of memory. A worker holds JAX's caches and the programs it compiled,
    # and a test's own processes (trainer runs, GPU compiles) come on top: the largest process
    # of a run on 2026-12-01 peaked at 5.6 GB.
    if hasattr(os, "sched_getaffinity"):  # Linux: the cores this process may use
        cores = len(os.sched_getaffinity(0))
    else:  # macOS has no affinity call
        cores = os.cpu_count() or 1
    try:
        memory_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    except (AttributeError, ValueError, OSError):  # no sysconf (Windows) or not this name
        return cores
    return max(1, min(cores, int(memory_gib // 4)))


@pytest.hookimpl(tryfirst=True)  # before xdist reads the groups off the items
def pytest_collection_modifyitems(config, items):
    # A module-scoped fixture (a trained run, a compiled reference) is built once per xdist
    # worker that runs a test using it: the tests that share one go to the same worker
    # (``--dist loadgroup``), the rest are spread as they come.
    _check_tiers(config, items)
    for item in items:
        info = getattr(item, "_fixtureinfo", None)
        module = getattr(item, "module", None)
        if info is None or module is None:
            continue
        if any(defs[-1].scope == "module" for defs in info.name2fixturedefs.values()):
            item.add_marker(pytest.mark.xdist_group(module.__name__))


def _tier_of(item) -> list[str]:
    """The tiers a test declares: its own mark or its file's ``pytestmark``; the notebooks,
    which have no Python file to declare it in, are end-to-end by their nature."""
    if NOTEBOOKS in item.nodeid.replace("\\", "/"):
        item.add_marker(pytest.mark.slow)
    return sorted({mark.name for mark in item.iter_markers() if mark.name in TIERS})


def _check_tiers(config, items) -> None:
    # The README's command runs the fast tier (pyproject's addopts: -m "not slow"), CI runs
    # both. Every test says which it is, so that a new test cannot land in neither or both and
    # the split cannot drift: a test without exactly one tier stops the collection.
    wrong = {}
    for item in items:
        tiers = _tier_of(item)
        if len(tiers) != 1:
            wrong[item.nodeid] = "both tiers" if tiers else "no tier"
    if not wrong:
        return
    rule = ("each needs exactly one of pytest.mark.fast / pytest.mark.slow, on the test or as "
            "the file's pytestmark")
    if not hasattr(config, "workerinput"):
        shown = "; ".join(f"{nodeid}: {why}" for nodeid, why in list(wrong.items())[:5])
        raise pytest.UsageError(f"{len(wrong)} tests declare no tier or both ({rule}): {shown}")
    # In an xdist worker a UsageError ends the worker and its message never reaches the
    # terminal: each such test fails instead, in whichever tier selects it, naming the rule.
    for item in items:
        if item.nodeid in wrong:
            item.runtest = _refusal(f"{item.nodeid} declares {wrong[item.nodeid]} ({rule})")


def _refusal(message: str):
    def runtest():
        pytest.fail(message, pytrace=False)

    return runtest
