"""``python -m zeroflow.train --config configs/tiny.yaml [section.key=value ...]``

Trains (or resumes) the GPT described by the config. Outputs go to ``run.dir``: the resolved
``config.yaml``, ``metrics.jsonl``, ``checkpoints/``, ``tb/`` (TensorBoard) and ``plot.png``;
``train.eval_only=true`` only evaluates (docs/runs.md).
Set ZEROFLOW_TRACEBACK=1 to see full tracebacks instead of one-line errors. What a run folder
holds and what survives which fault (kill -9, damaged checkpoints): docs/runs.md. Multi-process
runs: ``python -m zeroflow.launch`` or SLURM, see docs/multihost.md.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from zeroflow.cli.common import ArgumentParser, run_cli, set_cpu_devices
from zeroflow.cli.inputs import CPU_DEVICES_MAX, check_path, int_between
from zeroflow.config.io import add_config_arguments, config_from_args

PROG = "zeroflow.train"


def parser() -> argparse.ArgumentParser:
    p = ArgumentParser(prog=f"python -m {PROG}", description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--cpu-devices",
        type=int_between(1, CPU_DEVICES_MAX, "more than any mesh needs; each costs host memory"),
        default=None,
        metavar="N",
        help="emulate N CPU devices (testing data/model parallelism without a GPU)",
    )
    return add_config_arguments(p)


def main_args(args: argparse.Namespace) -> int:
    if args.config is not None:
        if not args.config.strip():
            raise ValueError("--config must not be empty: give a YAML file, or leave the flag out")
        check_path("--config", Path(args.config))
    cfg = config_from_args(args)  # ConfigError is a ValueError: one line, exit 2
    from zeroflow.engine.distributed import initialize_from_env

    set_cpu_devices(args.cpu_devices)
    # Joins a multi-process job when ZEROFLOW_*/SLURM variables describe one; like the line
    # above, this must come before anything starts a jax backend.
    initialize_from_env()
    if cfg.fusemix.enabled:
        from zeroflow.fusemix.trainer import train_fusemix as train
    else:
        from zeroflow.trainer import train
    result = train(cfg)
    if result.stopped_by:
        return 128 + {"SIGINT": 2, "SIGTERM": 15}.get(result.stopped_by, 0)
    return 0


def main(argv=None) -> int:
    return run_cli(PROG, main_args, parser(), argv)


if __name__ == "__main__":
    sys.exit(main())
