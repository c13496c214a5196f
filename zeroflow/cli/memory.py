"""``python -m zeroflow.memory --config X [--devices N --device-memory 80GB] [key=value ...]``

Every ZeRO stage x offload x remat choice of a trainer config's GPT, its step's instant peak
(traced, not compiled; the formula's bytes where it cannot be traced here) and, where compiled
(ahead of time, abstract inputs: nothing model-sized is allocated), XLA's, then the cheapest
choice that fits (``zeroflow.planner.memory_table``). ``--max-seq`` instead answers
the longest sequence the config's own choice fits (``zeroflow.cli.max_seq``)."""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Sequence

from zeroflow.cli import plan_flags as flags
from zeroflow.config.io import ConfigError, add_config_arguments, load_config
from zeroflow.util.settings import OFFLOAD_CHOICES, REMATS, ZERO_STAGES

PROG = "zeroflow.memory"


def _parser() -> flags.PlanParser:
    p = flags.PlanParser(prog=f"python -m {PROG}", description=__doc__.split("\n\n")[1])
    add = p.add_argument
    add("--devices", type=flags.count, help="data-parallel devices (default: parallel.data)")
    add("--device-memory", type=flags.memory_size, help="per device (default: the target's, 80GB)")
    add("--target", type=flags.gpu, help="compile for this GPU without having one (h100, l4)")
    add("--devices-per-process", type=flags.count, help="sharing a host (default: min(devices, 8))")
    add(
        "--measure",
        choices=("auto", "always", "never"),
        default="auto",
        help="compile to measure (auto: small models on few devices, docs/memory.md)",
    )
    add("--stages", type=flags.stages, default=list(ZERO_STAGES))
    add("--offloads", type=flags.offloads, default=list(OFFLOAD_CHOICES))
    add("--remats", type=flags.remats, default=list(REMATS))
    add(
        "--remat-dtypes",
        type=flags.remat_dtypes,
        help="each remat with its saved activations in these dtypes too, e.g. compute,fp8 "
        "(FP8 only where the policy saves something; default: model.remat_dtype alone)",
    )
    add("--json", action="store_true", help="one JSON object per choice instead of the table")
    add("--all", action="store_true", help="list every choice (default: the cheapest fits)")
    add(
        "--max-seq",
        action="store_true",
        help="instead, the longest model.seq_len the config's own choice fits, by compiling",
    )
    add("--seq-step", type=flags.count, default=1024, help="--max-seq tries multiples of this")
    add("--seq-limit", type=flags.count, default=1 << 24, help="--max-seq tries nothing longer")
    add("--max-compiles", type=flags.at_least(2), default=12, help="--max-seq compiles at most")
    add_config_arguments(p)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_intermixed_args(argv)
    flags.check_between(parser, args, "seq_step", "seq_limit")
    target = args.target
    if target is not None and args.measure != "never":
        hint = "; or --measure never for the formula's figures"
        flags.require_cuda_plugin(parser, "--target", target, hint)
    try:
        cfg = load_config(args.config, args.overrides)
    except (ValueError, ConfigError) as e:
        parser.error(str(e))
    par = cfg.parallel
    data = args.devices or (par.data if par.data > 0 else None)
    mesh = (data or 1) * par.model * par.context
    if args.measure != "never" and target:
        flags.start_xla(PROG, mesh, gpus=True, command_line=argv is None)
    elif args.measure != "never" and data:
        from zeroflow.planner.memory_table import MEASURE_MAX_DEVICES  # jax, not its backend

        if args.measure == "always" or mesh <= MEASURE_MAX_DEVICES:
            flags.start_xla(PROG, mesh, gpus=False, command_line=False)
    flags.drop_xla_info()
    try:
        return _run(args, cfg, data, target)
    except (ValueError, ConfigError) as e:
        parser.error(str(e))


def _run(args, cfg, data: int | None, target: str | None) -> int:
    from zeroflow.planner import memory_table
    from zeroflow.trainer.setup import run_model_config

    if cfg.model.init_from:  # the architecture is the checkpoint's config.json
        cfg = dataclasses.replace(cfg, model=run_model_config(cfg))
    name = args.config or "default config"
    devices, memory, title = memory_table.setting(
        cfg, name=name, devices=data, target=target, device_memory=args.device_memory
    )
    # Every device of the mesh (data x context x model) keeps its own host state.
    per_process = args.devices_per_process or min(
        devices * cfg.parallel.model * cfg.parallel.context, 8
    )
    if args.max_seq:
        from zeroflow.cli import max_seq

        return max_seq.run(args, cfg, devices, memory, title, target, per_process)
    keys = ("stages", "offloads", "remats", "remat_dtypes", "measure")
    table = memory_table.build(
        cfg,
        devices=devices,
        device_memory=memory,
        title=title,
        devices_per_process=per_process,
        log=lambda m: print(m, file=sys.stderr),
        target=target,
        **{k: getattr(args, k) for k in keys},
    )
    memory_table.show(table, as_json=args.json, show_all=args.all)
    return 0
