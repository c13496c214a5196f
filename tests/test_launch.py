"""Multi-process runs: ``zeroflow.launch`` on local CPU processes, ``zeroflow.engine.distributed`` settings."""
import json
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

from zeroflow.engine.distributed import ProcessSettings, requested, settings_from_env
from zeroflow.cli.launch import free_port, process_env
from zeroflow.trainer.checkpoints import RunCheckpoints
from fixtures import TINY_TRAINER
from helpers import one_cpu_env

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
# No plot.png: drawing it (a matplotlib import and a render) costs each run's reporting
# process about 2 s of CPU, and nothing here reads it.
SHRUNK = TINY_TRAINER + ["data.max_bytes=400000", "train.steps=4", "train.eval_every=0",
                         "run.plot=false"]
SLURM_STEP = {"SLURM_JOB_ID": "77", "SLURM_STEP_NODELIST": "localhost", "SLURM_NTASKS": "2",
              "SLURM_PROCID": "0", "SLURM_LOCALID": "0"}


def start(args, **kw):
    return subprocess.Popen([sys.executable, *args], cwd=REPO, env=one_cpu_env(), text=True, **kw)


def launch(*args, **kw):
    return start(["-m", "zeroflow.launch", *args], **kw)


def read_metrics(run_dir: Path, key: str = "loss") -> dict[int, dict]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r for r in rows if key in r}


def test_two_processes_train_like_one(tmp_path):
    """2 processes x 2 CPU devices (gloo) = 1 process x 4 devices, at ZeRO-3 where every process
    holds only shards of the state, and the final checkpoint is written by both."""
    train = ["-m", "zeroflow.train", "--config", "configs/tiny.yaml", *SHRUNK, "parallel.zero_stage=3"]
    one, two = tmp_path / "one", tmp_path / "two"
    pipes = dict(stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    # Concurrently: the single process leaves a core idle while it compiles.
    single = start([*train, "--cpu-devices", "4", f"run.dir={one}"], **pipes)
    multi = launch("--processes", "2", "--cpu-devices", "2", "--", sys.executable, *train,
                   f"run.dir={two}", **pipes)
    out, err = multi.communicate(timeout=600)
    assert multi.returncode == 0, err
    assert single.wait(timeout=600) == 0, single.stderr.read()
    single.stderr.close(), single.stdout.close()

    want, got = read_metrics(one), read_metrics(two)
    assert sorted(got) == sorted(want) == [1, 2, 3, 4]
    for key in ("loss", "grad_norm"):
        np.testing.assert_allclose([got[s][key] for s in got], [want[s][key] for s in want], rtol=1e-5)
    evals = [read_metrics(run, "eval_loss")[4]["eval_loss"] for run in (one, two)]
    np.testing.assert_allclose(evals[1], evals[0], rtol=1e-5)
    assert RunCheckpoints(two / "checkpoints", 3).steps() == [4]
    assert "mesh: {'data': 4, 'model': 1}" in out  # what a person reads is on stdout
    lines = (out + err).splitlines()
    # Only process 0 reports; every line carries its process's prefix.
    assert any(line.startswith("[p0] final: train loss") for line in lines), err
    assert not any(line.startswith("[p1] final") for line in lines)
    assert all(line.startswith(("[p0] ", "[p1] ")) for line in lines), err


def test_a_process_that_compiles_late_is_waited_for():
    """The CPU collectives (gloo) connect on a program's first collective and give up when a
    peer is more than 30 s late, as a slow compile on a loaded machine can make it; the
    trainer's programs run ``InLockstep``: compiled everywhere, then a barrier, then run."""
    script = textwrap.dedent("""
        import os, time
        import jax, jax.numpy as jnp, numpy as np
        from jax.sharding import Mesh, NamedSharding, PartitionSpec
        from zeroflow.engine.distributed import InLockstep, initialize_from_env
        initialize_from_env()
        mesh = Mesh(np.array(jax.devices()), ("all",))
        total = InLockstep(jax.jit(jnp.sum, out_shardings=NamedSharding(mesh, PartitionSpec())), "sum")
        ones = jax.make_array_from_process_local_data(NamedSharding(mesh, PartitionSpec("all")),
                                                      np.ones(len(jax.local_devices()), np.float32))
        if jax.process_index() == 1:
            time.sleep(35)  # before the processes' first collective
        print("total", float(total(ones)), flush=True)
    """)
    p = launch("--processes", "2", "--cpu-devices", "2", "--", sys.executable, "-c", script,
               stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    out, err = p.communicate(timeout=600)
    assert p.returncode == 0, err[-2000:]
    assert {"[p0] total 4.0", "[p1] total 4.0"} <= set(out.splitlines())


def test_launcher_fails_fast_with_the_failing_code():
    script = textwrap.dedent("""
        import os, sys, time
        rank = os.environ["ZEROFLOW_PROCESS_ID"]
        print("ready", rank, os.environ["ZEROFLOW_NUM_PROCESSES"], os.environ["JAX_NUM_CPU_DEVICES"], flush=True)
        if rank == "1":
            print("giving up", file=sys.stderr)
            sys.exit(3)
        time.sleep(3600)
    """)
    p = launch("--processes", "2", "--cpu-devices", "3", "--", sys.executable, "-c", script,
               stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    # Process 0 sleeps for an hour unless the launcher stops it: the run ending at all shows it
    # was not waited for.
    out, err = p.communicate(timeout=600)
    assert p.returncode == 3
    assert "[p1] ready 1 2 3" in out.splitlines() and "[p0] ready 0 2 3" in out.splitlines()
    assert "[p1] giving up" in err.splitlines()
    assert "zeroflow.launch: process 1 failed with exit code 3; stopping the other 1" in err


def test_launcher_forwards_sigterm_and_waits_for_the_stop(tmp_path):
    """Like the trainer: catch SIGTERM, finish up, exit 128 + 15; the launcher exits the same."""
    script = textwrap.dedent("""
        import os, signal, sys, time
        rank = os.environ["ZEROFLOW_PROCESS_ID"]
        signal.signal(signal.SIGTERM, lambda *_: (time.sleep(0.5 * int(rank)), print("saved", rank), sys.exit(143)))
        print("ready", flush=True)
        time.sleep(120)
    """)
    log = tmp_path / "out.txt"
    with open(log, "w") as sink:
        p = launch("--processes", "2", "--", sys.executable, "-c", script, stdout=sink, stderr=subprocess.PIPE)
        deadline = time.monotonic() + 60
        while log.read_text().count("ready") < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        p.send_signal(signal.SIGTERM)
        _, err = p.communicate(timeout=60)
    assert p.returncode == 143, err
    # Process 0 stopped first; process 1 was not killed for it, it finished its own stop.
    assert {"[p0] saved 0", "[p1] saved 1"} <= set(log.read_text().splitlines())
    assert "exited with code 143 after SIGTERM" in err


def test_processes_under_slurm_find_each_other():
    """With only SLURM's variables, initialize_from_env() defers to jax's SLURM detection."""
    script = textwrap.dedent("""
        import jax, numpy as np
        from jax.experimental import multihost_utils
        from zeroflow.engine.distributed import initialize, initialize_from_env
        assert initialize_from_env()
        initialize()  # a second call is harmless
        ranks = multihost_utils.process_allgather(np.int32(jax.process_index()))
        print(jax.process_index(), jax.process_count(), jax.device_count(), ranks.tolist())
    """)
    port = str(free_port())
    procs = [subprocess.Popen([sys.executable, "-c", script], cwd=REPO, text=True, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE,
                              env=one_cpu_env(**{**SLURM_STEP, "SLURM_PROCID": str(i), "SLURM_LOCALID": str(i)},
                                            JAX_COORDINATOR_PORT=port, JAX_PLATFORMS="cpu"))
             for i in range(2)]
    results = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], results
    last_lines = [out.strip().splitlines()[-1] for out, _ in results]  # after gloo's own messages
    assert last_lines == ["0 2 2 [0, 1]", "1 2 2 [0, 1]"]


def test_train_cli_reports_bad_settings_in_one_line(tmp_path):
    env = one_cpu_env(ZEROFLOW_COORDINATOR="127.0.0.1:1", ZEROFLOW_NUM_PROCESSES="two", ZEROFLOW_PROCESS_ID="0")
    p = subprocess.run([sys.executable, "-m", "zeroflow.train", "--config", "configs/tiny.yaml",
                        f"run.dir={tmp_path}"], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 2
    assert p.stderr.strip().splitlines() == [
        "zeroflow.train: error: ZEROFLOW_NUM_PROCESSES must be an integer >= 1, got 'two'"]


@pytest.mark.parametrize("env,message", [
    ({"ZEROFLOW_COORDINATOR": "10.0.0.1"}, "ZEROFLOW_COORDINATOR must be host:port"),
    ({"ZEROFLOW_COORDINATOR": "10.0.0.1:http"}, "ZEROFLOW_COORDINATOR must be host:port"),
    ({"ZEROFLOW_NUM_PROCESSES": "0"}, "ZEROFLOW_NUM_PROCESSES must be an integer >= 1, got '0'"),
    ({"ZEROFLOW_PROCESS_ID": "-1"}, "ZEROFLOW_PROCESS_ID must be an integer >= 0"),
    ({"ZEROFLOW_NUM_PROCESSES": "2", "ZEROFLOW_PROCESS_ID": "2"},
     "ZEROFLOW_PROCESS_ID=2 is not below ZEROFLOW_NUM_PROCESSES=2"),
    ({"ZEROFLOW_LOCAL_DEVICE_IDS": "0,x"}, "ZEROFLOW_LOCAL_DEVICE_IDS must be device ids like 0,1,2"),
])
def test_bad_environment_is_one_line(env, message):
    with pytest.raises(ValueError, match="^" + message.replace("(", r"\(")) as e:
        settings_from_env(env)
    assert "\n" not in str(e.value)


def test_settings_from_environment():
    env = {"ZEROFLOW_COORDINATOR": " node1:1234", "ZEROFLOW_NUM_PROCESSES": "4", "ZEROFLOW_PROCESS_ID": "3",
           "ZEROFLOW_LOCAL_DEVICE_IDS": "2,3", "ZEROFLOW_OTHER": "x"}
    assert settings_from_env(env) == ProcessSettings("node1:1234", 4, 3, (2, 3))
    assert settings_from_env({"ZEROFLOW_PROCESS_ID": ""}) == ProcessSettings()  # empty = unset
    explicit = ProcessSettings(num_processes=8).merged_over(settings_from_env(env))
    assert explicit == ProcessSettings("node1:1234", 8, 3, (2, 3))


@pytest.mark.parametrize("env,expected", [
    ({}, False),
    ({"ZEROFLOW_COORDINATOR": "h:1"}, True),
    ({"JAX_COORDINATOR_ADDRESS": "h:1"}, True),
    (SLURM_STEP, True),
    ({**SLURM_STEP, "SLURM_NTASKS": "1"}, False),  # one task: nothing to join
    ({k: v for k, v in SLURM_STEP.items() if k != "SLURM_STEP_NODELIST"}, False),  # not inside srun
    ({**SLURM_STEP, "ZEROFLOW_DISTRIBUTED": "0"}, False),
    ({"ZEROFLOW_DISTRIBUTED": "1"}, True),
])
def test_when_the_environment_asks_for_multi_process(env, expected):
    assert requested(env) is expected


def test_process_env_sets_devices_and_drops_the_inherited_device_count():
    base = {"XLA_FLAGS": "--xla_force_host_platform_device_count=8 --xla_dump_to=/tmp/x", "HOME": "/h"}
    env = process_env(base, index=1, processes=2, coordinator="127.0.0.1:5", cpu_devices=2,
                      devices_per_process=None)
    assert env["XLA_FLAGS"] == "--xla_dump_to=/tmp/x" and env["JAX_NUM_CPU_DEVICES"] == "2"
    assert (env["ZEROFLOW_COORDINATOR"], env["ZEROFLOW_NUM_PROCESSES"], env["ZEROFLOW_PROCESS_ID"]) == (
        "127.0.0.1:5", "2", "1")
    gpu = process_env(base, index=1, processes=2, coordinator="h:5", cpu_devices=None, devices_per_process=4)
    assert gpu["ZEROFLOW_LOCAL_DEVICE_IDS"] == "4,5,6,7" and gpu["XLA_FLAGS"] == base["XLA_FLAGS"]
