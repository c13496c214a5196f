"""What every jaxpr interpreter of zeroflow does alike: bind one equation to values, and open
a call's body.

Autocast (``autocast/interpret.py``), weights fetched on use (``grads/gather_on_use.py``) and
the streamed optimizer update (``update.py``) each replay a traced jaxpr with values of their
own: a jaxpr replay is a small loop over equations that keeps the transform a pure
function of the traced program, with ``jax.grad`` of the replay doing the rest. The memory estimator (``memory/peak.py``) follows the same calls as the
fetch-on-use replay. They bind equations here, the way jax's own ``eval_jaxpr`` does, and agree
on which equations are calls. Only public jax names (``jax.extend``) are used.
"""

from __future__ import annotations

import contextlib

from jax.extend import core as jcore
from jax.extend import source_info_util

from zeroflow.util.compat import CALL_PRIMITIVES

CALLS = CALL_PRIMITIVES
"Call primitives: their body is a plain sub-jaxpr that an interpreter may inline."


def bind(eqn, values, params: dict | None = None) -> list:
    """The outputs of ``eqn`` applied to ``values`` (one per input, literals included), always
    as a list. ``params``: bind params that replace the equation's own (autocast's low dots).

    ``get_bind_params`` turns stored params back into bind arguments (custom_jvp_call keeps
    its rules in another form); before jax 0.10 it returned ``(subfuns, params)``."""
    bind_params = eqn.primitive.get_bind_params(eqn.params if params is None else params)
    subfuns = ()
    if isinstance(bind_params, tuple):
        subfuns, bind_params = bind_params
    with eqn.ctx.manager:
        out = eqn.primitive.bind(*subfuns, *values, **bind_params)
    return list(out) if eqn.primitive.multiple_results else [out]


def source_context(eqn) -> contextlib.AbstractContextManager:
    """The source location and name stack of ``eqn``, under which ``eval_jaxpr`` binds it, so
    that a replayed program keeps the names of the one it was traced from (profiles, HLO)."""
    return source_info_util.user_context(
        eqn.source_info.traceback,
        name_stack=source_info_util.current_name_stack() + eqn.source_info.name_stack,
    )


def open_jaxpr(jaxpr) -> tuple:
    """``(Jaxpr, consts)`` from a ``ClosedJaxpr`` or an open ``Jaxpr``."""
    if isinstance(jaxpr, jcore.ClosedJaxpr):
        return jaxpr.jaxpr, list(jaxpr.consts)
    return jaxpr, []


def call_body(eqn):
    """The body of a call equation (``CALLS``) as stored (``jit``'s and ``eval_jaxpr``'s
    ``jaxpr``, ``closed_call``'s ``call_jaxpr``; closed or open), or None for any other."""
    if eqn.primitive.name not in CALLS:
        return None
    return eqn.params.get("jaxpr", eqn.params.get("call_jaxpr"))


def inline_calls(closed: jcore.ClosedJaxpr) -> jcore.ClosedJaxpr:
    """``closed`` with every call equation (``CALLS``, at any depth) replaced by its body's
    equations, for passes that group equations by the values they read: from jax 0.11 a
    ``jit(inline=True)`` call (optax's ``tree_bias_correction``) stays a ``jit`` equation
    that reads all its arguments at once."""
    import jax

    def run(jaxpr, consts, args):
        env = dict(zip(jaxpr.constvars, consts))
        env.update(zip(jaxpr.invars, args))
        read = lambda a: a.val if isinstance(a, jcore.Literal) else env[a]  # noqa: E731
        for eqn in jaxpr.eqns:
            values = [read(a) for a in eqn.invars]
            body = call_body(eqn)
            outs = run(*open_jaxpr(body), values) if body is not None else bind(eqn, values)
            env.update(zip(eqn.outvars, outs))
        return [read(a) for a in jaxpr.outvars]

    return jax.make_jaxpr(lambda *args: run(closed.jaxpr, closed.consts, args))(
        *[jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in closed.jaxpr.invars]
    )
