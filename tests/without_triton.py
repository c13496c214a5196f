"""Train and compile as a user would after jax removes its Pallas Triton module (deprecated in jax
0.11): an import hook makes that module unimportable, then this process imports zeroflow, trains
the shrunk tiny config at ZeRO stages 0-3 with XLA attention (the CLI's entry point, one run
directory each under RUN_ROOT), and compiles the step with cuDNN attention for one abstract H100.
It prints one JSON line: the custom calls of that compiled step, and every import the hook
refused.

    python tests/without_triton.py RUN_ROOT [CONFIG OVERRIDES...]
"""
import importlib.abc
import json
import re
import sys

GONE = ("jax.experimental.pallas.triton", "jax._src.pallas.triton")
refused: list[str] = []


class _Removed(importlib.abc.MetaPathFinder):
    """Refuses the Triton modules as Python refuses a module that is not installed."""

    def find_spec(self, name, path=None, target=None):
        if any(name == gone or name.startswith(gone + ".") for gone in GONE):
            refused.append(name)
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None


def main(run_root: str, overrides: list[str]) -> int:
    sys.meta_path.insert(0, _Removed())
    import zeroflow  # noqa: F401 - the package itself must import
    from zeroflow import backend
    from zeroflow.cli import train as train_cli
    from zeroflow.config.io import load_config
    from zeroflow.trainer.setup import abstract_batch, build_run
    from zeroflow.util import compat

    for stage in range(4):
        code = train_cli.main(["--config", "configs/tiny.yaml", *overrides,
                               f"parallel.zero_stage={stage}", "model.attention=xla",
                               f"run.dir={run_root}/stage{stage}"])
        if code != 0:
            return code
    cfg = load_config("configs/tiny.yaml", [*overrides, "model.attention=cudnn", "precision.params=bf16",
                                            "parallel.zero_stage=3"])
    mesh = backend.target_mesh("h100", data=1)
    with backend.tracing_for(backend.of(mesh)), compat.cudnn_for_target():
        run = build_run(cfg, with_data=False, mesh=mesh)
        batch = abstract_batch(cfg, sharding=run.plan.batch_sharding())
        hlo = run.make_step().lower(run.abstract_state(), batch).compile().as_text()
    calls = sorted(set(re.findall(r'custom_call_target="([^"]+)"', hlo)))
    print(json.dumps({"custom_calls": calls, "refused": sorted(set(refused))}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2:]))
