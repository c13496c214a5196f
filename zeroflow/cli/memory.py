"""``python -m zeroflow.memory --config X [--devices N --device-memory 80GB] [key=value ...]``
Prints every ZeRO stage x offload x remat choice for the GPT model of a trainer config, with
the ZeRO formula's bytes per device and per host process (model states, and the GPT's
activation formula) and, where the step is compiled (small configs, enough devices: the CPU
backend emulates them; always for a --target), what XLA says it needs, then names the
cheapest choice that fits. Nothing model-sized is allocated: the measured column comes from
ahead-of-time compilation with abstract inputs.

"Cheapest" and "fits" are ``zeroflow.planner.memory_table``'s; this module only reads the
flags and the config.

With ``--target`` each compiled row also carries XLA:GPU's *estimated* step time (its
latency-hiding scheduler's cost model for the target, ``zeroflow.memory.schedule``; nothing
runs, so it is an estimate, not a measurement), the communication it leaves exposed and the
MFU it implies. XLA prints those statistics only when the process starts with
``zeroflow.util.xla_log.LOG_ENV``, so the command starts itself again with it, before it
imports jax.

``--max-seq`` instead answers the longest sequence that fits, by compiling the config's own
choice at one length after another (``zeroflow.cli.max_seq``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from collections.abc import Sequence

from zeroflow.cli.plan_flags import (
    PlanParser,
    at_least,
    check_between,
    count,
    memory_size,
    require_cuda_plugin,
)
from zeroflow.config.io import ConfigError, add_config_arguments, load_config
from zeroflow.util import xla_log
from zeroflow.util.units import parse_bytes

# jax and what imports it are imported in ``_run``, after the command has restarted itself
# for XLA's start-up settings (``_restart_with_schedule_log``).
FAST_CPU_COMPILE = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"


def _choices(text: str, valid: Sequence, name: str, cast=str) -> list:
    out = []
    for item in text.split(","):
        try:
            value = cast(item.strip())
        except ValueError:
            value = item.strip()
        if value not in valid:
            raise ValueError(
                f"unknown {name} {item.strip()!r}; choose from {', '.join(map(str, valid))}"
            )
        out.append(value)
    return out


def _parser() -> argparse.ArgumentParser:
    parser = PlanParser(prog="python -m zeroflow.memory", description=__doc__.split("\n\n")[1])
    parser.add_argument(
        "--devices",
        type=count,
        default=None,
        help="data-parallel devices (default: parallel.data, or all devices)",
    )
    parser.add_argument(
        "--device-memory",
        type=memory_size,
        default=None,
        help="memory per device, e.g. 80GB, 24GiB (default: the target's, else 80GB)",
    )
    parser.add_argument(
        "--target",
        default=None,
        help="compile for this GPU without having one (h100, a100, l4): the "
        "measured column is XLA:GPU's peak, with the collectives' overlap",
    )
    parser.add_argument(
        "--devices-per-process",
        type=count,
        default=None,
        help="devices sharing one host's memory (default: min(devices, 8))",
    )
    parser.add_argument(
        "--measure",
        choices=("auto", "always", "never"),
        default="auto",
        help="compile to measure (auto: where it is cheap, small models on few devices: "
        "docs/memory.md)",
    )
    parser.add_argument("--stages", default="0,1,2,3")
    parser.add_argument("--offloads", default=None, help="default: every offload choice")
    parser.add_argument("--remats", default=None, help="default: every remat policy")
    parser.add_argument(
        "--json", action="store_true", help="print one JSON object per choice instead of the table"
    )
    parser.add_argument(
        "--all", action="store_true", help="list every choice (default: the cheapest fits)"
    )
    parser.add_argument(
        "--max-seq",
        action="store_true",
        help="instead of the table, find the longest model.seq_len that fits by compiling "
        "the config's own choice (stage, offload, remat, context, chunks) at one length "
        "after another",
    )
    parser.add_argument(
        "--seq-step", type=count, default=1024, help="--max-seq tries multiples of this"
    )
    parser.add_argument(
        "--seq-limit", type=count, default=1 << 24, help="--max-seq tries nothing longer"
    )
    parser.add_argument(
        "--max-compiles", type=at_least(2), default=12, help="--max-seq compiles at most this many"
    )
    add_config_arguments(parser)
    return parser


def _device_memory(args) -> int:
    """--device-memory, else the target GPU's memory (unknown names stop here, with the
    choices), else 80 GB."""
    if args.target is not None:
        from zeroflow.backend import targets

        spec = targets.spec_text(args.target)
        default = int(targets.spec_field(spec, "device_memory_size"))
        targets.use_cpu_for_targets()
    else:
        default = parse_bytes("80GB")
    return args.device_memory or default


def _emulate_devices(wanted: int) -> None:
    """Emulate ``wanted`` devices on the CPU backend (read when jax first starts a backend).
    Nothing is run, so XLA may skip its slow LLVM passes (buffers are the same)."""
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags:
        flags += f" --xla_force_host_platform_device_count={wanted} {FAST_CPU_COMPILE}"
        os.environ["XLA_FLAGS"] = flags.strip()


def _where(args, devices: int) -> str:
    """Where the measured column's compiles are for, as the table's title says."""
    import jax

    if args.target is not None:
        return f"{devices} x {args.target} (XLA:GPU, compiled without the GPU)"
    return f"{devices} devices (measured: XLA:{jax.default_backend().upper()} of this machine)"


def _restart_with_schedule_log(argv: Sequence[str] | None, args) -> None:
    """Start this command again with XLA's scheduler statistics on (read at start-up), for
    the estimated step time of a target's rows, and with as many CPU devices as the target
    has (offloaded rows are compiled through CPU devices standing in for the GPUs, and XLA
    reads the device count at start-up too); only from the command line (``argv`` None)."""
    if argv is not None or args.target is None or args.measure == "never" or xla_log.enabled():
        return
    env = xla_log.enable(dict(os.environ))
    env["ZEROFLOW_QUIET_XLA_INFO"] = "1"
    flags = env.get("XLA_FLAGS", "")
    wanted = _target_devices(args)
    if wanted and "xla_force_host_platform_device_count" not in flags:
        env["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={wanted}".strip()
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, "-m", "zeroflow.memory", *sys.argv[1:]], env)


def _target_devices(args) -> int | None:
    """Devices of the target mesh (data x model), or None where the config cannot tell (the
    restarted command then reports what is wrong with it)."""
    try:
        cfg = load_config(args.config, args.overrides)
    except (ValueError, ConfigError):
        return None
    data = args.devices or (cfg.parallel.data if cfg.parallel.data > 0 else 1)
    return data * cfg.parallel.model * cfg.parallel.context


def _max_seq(args, cfg, devices: int, device_memory: float, title: str) -> int:
    """``--max-seq``: the search, then its answer (``zeroflow.cli.max_seq``)."""
    from zeroflow.cli import max_seq

    search = max_seq.search_config(
        cfg,
        devices=devices,
        target=args.target,
        device_memory=device_memory,
        step=args.seq_step,
        limit=args.seq_limit,
        max_compiles=args.max_compiles,
    )
    total = devices * cfg.parallel.model * cfg.parallel.context
    if total != devices:
        title += f", {total} devices in all (context {cfg.parallel.context})"
    max_seq.print_result(search, args, device_memory=device_memory, devices=total, title=title)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_intermixed_args(argv)
    check_between(parser, args, "seq_step", "seq_limit")
    if args.target is not None and args.measure != "never":
        require_cuda_plugin(
            parser, "--target", args.target, "; or --measure never for the formula's figures"
        )
    _restart_with_schedule_log(argv, args)
    if os.environ.get("ZEROFLOW_QUIET_XLA_INFO"):
        from zeroflow.memory import schedule

        schedule.drop_info_lines()
    return _run(parser, args)


def _run(parser, args) -> int:
    """The table (or ``--max-seq``'s search) once the flags are checked and the process has
    the environment XLA reads at start-up."""
    import jax

    from zeroflow.memory.estimate import OFFLOADS, REMATS, STAGES
    from zeroflow.models.spec import count_gpt_params
    from zeroflow.planner.memory_table import (
        MEASURE_MAX_DEVICES,
        plan_rows,
        render,
    )
    from zeroflow.trainer.setup import run_model_config

    try:
        cfg = load_config(args.config, args.overrides)
        if cfg.model.init_from:  # the architecture is the checkpoint's config.json
            cfg = dataclasses.replace(cfg, model=run_model_config(cfg))
        device_memory = _device_memory(args)
        stages = _choices(args.stages, STAGES, "stage", int)
        offloads = _choices(args.offloads or ",".join(OFFLOADS), OFFLOADS, "offload")
        remats = _choices(args.remats or ",".join(REMATS), REMATS, "remat")
        if args.devices is not None and args.devices < 1:
            raise ValueError(f"--devices must be >= 1, got {args.devices}")
        devices = args.devices or (cfg.parallel.data if cfg.parallel.data > 0 else None)
        wanted = (devices or 1) * cfg.parallel.model * cfg.parallel.context
        if (
            args.target is None
            and args.measure != "never"
            and devices
            and wanted <= MEASURE_MAX_DEVICES
        ):
            _emulate_devices(wanted)
        devices = devices or jax.device_count() // (cfg.parallel.model * cfg.parallel.context)
        where = _where(args, devices)
        title = (
            f"{args.config or 'default config'}: {count_gpt_params(cfg.model):,} params, "
            f"batch {cfg.train.batch_size}, {cfg.precision.params}, {where}"
        )
        if args.max_seq:
            return _max_seq(args, cfg, devices, device_memory, title)
        rows = plan_rows(
            cfg,
            devices=devices,
            stages=stages,
            offloads=offloads,
            remats=remats,
            measure=args.measure,
            # Every device of the mesh (data x context x model) keeps its own host state.
            devices_per_process=args.devices_per_process
            or min(devices * cfg.parallel.model * cfg.parallel.context, 8),
            log=lambda m: print(m, file=sys.stderr),
            target=args.target,
        )
    except (ValueError, ConfigError) as e:
        parser.error(str(e))
    if args.json:
        for row in rows:
            print(
                json.dumps(
                    {
                        **row.as_json(),
                        "fits": row.need_bytes <= device_memory,
                        "device_memory_bytes": device_memory,
                        **({"target": args.target} if args.target else {}),
                    }
                )
            )
    else:
        render(rows, device_memory, title, show_all=args.all)
    return 0
