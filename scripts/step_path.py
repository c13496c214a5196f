"""Count how often tracing one train step goes back and forth between zeroflow's modules.

    PYTHONPATH=$PWD python scripts/step_path.py                 # stage 3, bf16, 8 CPU devices
    PYTHONPATH=$PWD python scripts/step_path.py --stage 1 --params fp32

The model is two weights, ``x @ embed @ head``: ``embed`` trains and ``head`` is frozen
(``zf.init_train_state(..., trainable=...)``), so both a trained and a frozen parameter's path
are walked. The state is built first; then, under ``sys.setprofile``, the script runs
``jax.make_jaxpr`` of ``TrainStep.__call__`` on a fresh step (its first call: the step's
layout is built and the step traced, as in training).

Every Python call and return is attributed to the zeroflow module of its frame (a file under
``zeroflow/``) and compared with the nearest zeroflow frame below it on the stack (its caller,
possibly through jax or flax code in between):
- an *entry* is a call whose function is defined in another zeroflow module than that caller's;
- a *return* is the matching return into the caller's module.
Calls within one module, and calls into jax itself, count nothing. The table prints, per
module, how many times the trace entered it and how many times a return came back to it.
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
from pathlib import Path

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

from zeroflow.cli.common import start_script  # noqa: E402

start_script()  # before jax: where the CUDA plugin has no driver, a CPU jax without its noise

import jax
import jax.numpy as jnp
import optax

import zeroflow as zf

PACKAGE = Path(zf.__file__).resolve().parent


def module_of(frame) -> str | None:
    """``engine/frozen.py`` for a frame of zeroflow's code, else None."""
    path = Path(frame.f_code.co_filename)
    try:
        return str(path.resolve().relative_to(PACKAGE))
    except ValueError:
        return None


def caller_module(frame) -> str | None:
    """The module of the nearest zeroflow frame below ``frame`` on the stack."""
    frame = frame.f_back
    while frame is not None:
        module = module_of(frame)
        if module is not None:
            return module
        frame = frame.f_back
    return None


class Transitions:
    """A ``sys.setprofile`` hook counting entries into and returns to zeroflow modules."""

    def __init__(self):
        self.entries: collections.Counter = collections.Counter()
        self.returns: collections.Counter = collections.Counter()
        self.calls: collections.Counter = collections.Counter()

    def __call__(self, frame, event, arg):
        if event not in ("call", "return"):
            return
        module = module_of(frame)
        if module is None:
            return
        caller = caller_module(frame)
        if caller is None or caller == module:
            return
        if event == "call":
            self.entries[module] += 1
            self.calls[(caller, module, frame.f_code.co_qualname)] += 1
        else:
            self.returns[caller] += 1


def tiny_state(stage: int, params: str):
    """A stage-``stage`` state of two weights, ``head`` frozen, and its loss and step."""
    plan = zf.ZeroPlan(zf.make_mesh(), stage=stage)
    prec = zf.Precision(params=params)
    tx = optax.adam(1e-3)
    weights = {
        "embed": jnp.ones((32, 16), jnp.float32),
        "head": jnp.ones((16, 8), jnp.float32),
    }
    trainable = {"embed": True, "head": False}

    def loss_fn(p, batch):
        out = batch["x"].astype(p["embed"].dtype) @ p["embed"] @ p["head"]
        return jnp.mean(out.astype(jnp.float32) ** 2)

    state = zf.init_train_state(weights, tx, plan, prec, trainable=trainable)
    step = zf.make_train_step(loss_fn, tx, plan, prec, donate=False)
    batch = {"x": jnp.ones((16, 32), jnp.float32)}
    return step, state, batch


def count(stage: int, params: str) -> Transitions:
    step, state, batch = tiny_state(stage, params)
    hook = Transitions()
    sys.setprofile(hook)
    try:
        jax.make_jaxpr(lambda s, b: step(s, b))(state, batch)
    finally:
        sys.setprofile(None)
    return hook


def table(hook: Transitions) -> str:
    modules = sorted(set(hook.entries) | set(hook.returns), key=lambda m: (-hook.entries[m], m))
    width = max(len(m) for m in modules)
    lines = [f"{'module':<{width}}  entries  returns"]
    lines += [f"{m:<{width}}  {hook.entries[m]:>7}  {hook.returns[m]:>7}" for m in modules]
    total_in, total_back = sum(hook.entries.values()), sum(hook.returns.values())
    lines.append(f"{'total':<{width}}  {total_in:>7}  {total_back:>7}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--stage", type=int, default=3, choices=(0, 1, 2, 3))
    parser.add_argument("--params", default="bf16", choices=("fp32", "bf16"))
    parser.add_argument(
        "--detail", metavar="MODULE", help="also list the functions entered in MODULE, by caller"
    )
    args = parser.parse_args()
    print(f"stage {args.stage}, params {args.params}, {jax.device_count()} devices")
    hook = count(args.stage, args.params)
    print(table(hook))
    if args.detail:
        for (caller, module, name), k in sorted(hook.calls.items()):
            if module == args.detail:
                print(f"  {k:>3} x {name} from {caller}")


if __name__ == "__main__":
    main()
