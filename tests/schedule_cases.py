"""Compiles the cases of tests/test_schedule.py for 8 abstract H100s and prints one JSON line of
what XLA:GPU's scheduler estimated. Run in a process started with
``zeroflow.xla.schedule.LOG_ENV`` (XLA reads the log level at start-up)."""
from __future__ import annotations

import json
import re
import sys
from functools import partial

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding, PartitionSpec as P

import zeroflow as zf
from zeroflow.util import compat
from zeroflow.xla import schedule

try:
    from jax import shard_map
except ImportError:  # jax 0.10
    from jax.experimental.shard_map import shard_map

N = 8192


def matmul_and_gather(mesh, dependent: bool):
    """One local 8192^3 bf16 matmul per device and an all-gather of 8192 x 8192 bf16: beside
    it (independent) or feeding it."""
    @partial(shard_map, mesh=mesh, in_specs=(P(), P(), P("data")), out_specs=(P("data"), P("data")))
    def body(a, b, x):
        gathered = jax.lax.all_gather(x, "data", tiled=True)
        if dependent:
            return a @ gathered, gathered[:1]
        return a @ b, gathered[:1]

    spec = lambda s: jax.ShapeDtypeStruct((N, N), jnp.bfloat16,  # noqa: E731
                                          sharding=NamedSharding(mesh, s))
    compiled, est = schedule.timed(lambda: jax.jit(body).lower(spec(P()), spec(P()),
                                                               spec(P("data"))).compile())
    return {"step_ms": est.step_ms, "exposed_ag_us": est.exposed_us("all-gather")}


def scanned_loss(params, batch):
    def layer(x, w):
        h = jax.nn.gelu(x @ w["up"].astype(jnp.bfloat16))
        return x + h @ w["down"].astype(jnp.bfloat16), None
    x = params["embed"].astype(jnp.bfloat16)[batch["tokens"][:, :-1]]
    x, _ = jax.lax.scan(jax.checkpoint(layer), x, params["layers"])
    logits = (x @ params["embed"].astype(jnp.bfloat16).T).astype(jnp.float32)
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["tokens"][:, 1:]).mean()


def forward_loops(mesh, **options):
    """Stage 3 of a scanned model: per loop body that gathers weights and reduces nothing (the
    forward pass's), its trip count and exposed all-gather time per iteration."""
    s = jax.ShapeDtypeStruct
    params = {"embed": s((4096, 1024), jnp.float32),
              "layers": {"up": s((8, 1024, 4096), jnp.float32),
                         "down": s((8, 4096, 1024), jnp.float32)}}
    batch = {"tokens": s((8 * 16, 1025), jnp.int32)}
    plan = zf.ZeroPlan(mesh, stage=3)
    compiled, _, est = zf.memory.compile_step_timed(
        scanned_loss, params, batch, optax.adamw(1e-4), plan,
        zf.Precision(params="bf16", master="fp32"), **options)
    bodies = _computations(compiled.as_text())
    out = {}
    for comp in est.computations:
        text = bodies.get(comp.name, "")
        if comp.trips > 1 and "all-gather-start" in text and "reduce-scatter" not in text:
            out[comp.name] = {"trips": comp.trips,
                              "exposed_ag_us": comp.wasted_us.get("all-gather", 0.0)}
    return out


def _computations(hlo: str) -> dict:
    out, name = {}, None
    for line in hlo.splitlines():
        head = re.match(r"^(?:ENTRY )?%?([\w.\-]+) ", line)
        if head and line.rstrip().endswith("{"):
            name = head.group(1)
            out[name] = ""
        elif name is not None:
            out[name] += line + "\n"
    return out


def main() -> None:
    mesh = zf.target_mesh("h100", data=8)
    case = sys.argv[1]
    if case == "matmul":
        result = {"hidden": matmul_and_gather(mesh, dependent=False),
                  "exposed": matmul_and_gather(mesh, dependent=True)}
    elif case == "stage3":
        result = {"pipelined": forward_loops(mesh)}
    else:  # the same with XLA's collective pipeliner off for all-gathers
        result = {"not_pipelined": forward_loops(
            mesh, compiler_options=compat.pipelined_all_gather(False))}
    print(json.dumps(result))


if __name__ == "__main__":
    main()
