"""The readers of what XLA says about a compiled step live in ``zeroflow.xla``; the paths they had
under ``zeroflow.memory`` and the names ``zf.memory`` gives them still read the same objects, and
importing the package alone starts no jax."""
import importlib
import json
import subprocess
import sys

import pytest

from helpers import REPO

pytestmark = pytest.mark.fast

# Public names and private ones (code outside the package reads those too) of each moved module.
NAMES = {
    "hlo": ["computations", "groups_of", "mesh_axis_groups", "INSTRUCTION", "_TRIPS", "_ints"],
    "collectives": ["collectives", "overlap", "traffic", "Collective", "KINDS", "_bytes"],
    "schedule": ["parse", "StepTime", "enable", "timed", "LOG_ENV", "_BLOCK"],
}


@pytest.mark.parametrize("module, name", [(m, n) for m, names in NAMES.items() for n in names])
def test_the_old_module_path_reads_the_new_module_s_object(module, name):
    old = importlib.import_module(f"zeroflow.memory.{module}")
    new = importlib.import_module(f"zeroflow.xla.{module}")
    assert old is not new  # a module of its own, not a second copy of the code
    assert getattr(old, name) is getattr(new, name)


def test_each_import_form_of_the_old_paths():
    from zeroflow.memory import hlo, schedule
    from zeroflow.memory.collectives import overlap
    from zeroflow.memory.schedule import parse
    from zeroflow.xla import collectives as new_collectives
    from zeroflow.xla import hlo as new_hlo
    from zeroflow.xla import schedule as new_schedule

    assert (schedule.parse, parse) == (new_schedule.parse, new_schedule.parse)
    assert hlo.groups_of is new_hlo.groups_of and overlap is new_collectives.overlap
    with pytest.raises(AttributeError, match="no_such_name"):
        schedule.no_such_name  # noqa: B018


def test_zf_memory_names_stay_the_functions_once_the_old_module_is_imported():
    # Importing zeroflow.memory.collectives records that module on the package under the name
    # of the public function ``zf.memory.collectives``; the function must stay what it reads.
    import zeroflow as zf

    importlib.import_module("zeroflow.memory.collectives")
    new = importlib.import_module("zeroflow.xla.collectives")
    schedule = importlib.import_module("zeroflow.xla.schedule")
    assert zf.memory.collectives is new.collectives
    assert zf.memory.overlap is new.overlap and zf.memory.traffic is new.traffic
    assert zf.memory.Collective is new.Collective and zf.memory.StepTime is schedule.StepTime
    assert {"collectives", "overlap", "traffic", "Collective", "StepTime"} <= set(zf.memory.__all__)


def test_importing_the_xla_package_starts_no_jax():
    code = "import json, sys, zeroflow.xla; print(json.dumps('jax' in sys.modules))"
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO,
                         env={"PYTHONPATH": str(REPO), "PATH": ""}, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    assert json.loads(run.stdout) is False
