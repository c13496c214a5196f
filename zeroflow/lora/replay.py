"""The interpreter: replay a loss's jaxpr, following each adapted weight to the matmuls that
read it and adding the low-rank path there. Replaying the traced program (rather than
rewriting the user's modules) is what lets any JAX function take adapters.

Every equation that does not touch an adapted weight is bound as it is. A weight is followed
through layout operations (``views.View``); at a ``dot_general`` that reads it the output
gains ``scale * (dropout(x) @ a) @ b``, with the factors laid out like the weight operand.
Calls (``jit``) and custom derivatives (``custom_jvp`` / ``custom_vjp``) that read a weight
are inlined: their body is differentiated as written, since their own rule knows nothing of
the adapter. ``remat`` stays a ``jax.checkpoint`` around its replayed body, and a ``scan``
stays a ``lax.scan``: a weight it slices per iteration (a stack of layers) takes its
factors sliced the same way. Anything else that reads an adapted weight is refused with one
line naming the parameter.

In the *discover* mode (no factors given) the replay only records, per weight, where it is
read (``adapters.Site``), which is how ``LoRA.init`` learns the factor shapes.
"""

from __future__ import annotations

import jax
from jax import lax
from jax.extend import core as jcore

from zeroflow.lora.adapters import Site
from zeroflow.lora.views import UnsupportedUse
from zeroflow.util.compat import REMAT_PRIMITIVES, scan_split
from zeroflow.util.jaxprs import bind, call_body, open_jaxpr, source_context

LAYOUT = ("convert_element_type", "copy", "copy_p", "sharding_constraint", "reduce_precision")
"Operations that leave a weight's layout as it is."
REMAT = REMAT_PRIMITIVES
CUSTOM = ("custom_jvp_call", "custom_vjp_call")


class Replay:
    """One pass over a jaxpr. ``factors``: ``(path, stack) -> (a, b)`` as this level sees
    them (None: discover mode); ``sites``: shared record of where each weight is read;
    ``refuse(path, reason)``: the error for an unsupported use."""

    def __init__(
        self,
        factors: dict | None,
        sites: dict,
        refuse,
        *,
        scale: float = 1.0,
        dropout: float = 0.0,
        rng=None,
    ):
        self.factors, self.sites, self.refuse = factors, sites, refuse
        self.scale, self.dropout, self.rng = scale, dropout, rng
        self.used: set = set()
        self._count = 0

    def _key(self):
        """A key of its own for each dropout site and loop (None without dropout)."""
        if self.rng is None or not self.dropout:
            return None
        self._count += 1
        return jax.random.fold_in(self.rng, self._count)

    def run(self, jaxpr, consts, values, views):
        """``(outputs, their views)`` of ``jaxpr`` on ``values`` (views: None where a value
        is not an adapted weight)."""
        env, seen = {}, {}
        for var, value in zip(jaxpr.constvars, consts):
            env[var] = value
        for var, value, view in zip(jaxpr.invars, values, views):
            env[var], seen[var] = value, view

        def read(atom):
            return atom.val if isinstance(atom, jcore.Literal) else env[atom]

        def view_of(atom):
            return None if isinstance(atom, jcore.Literal) else seen.get(atom)

        for eqn in jaxpr.eqns:
            ins, in_views = [read(v) for v in eqn.invars], [view_of(v) for v in eqn.invars]
            with source_context(eqn):
                if not any(in_views):
                    outs, out_views = bind(eqn, ins), [None] * len(eqn.outvars)
                else:
                    outs, out_views = self._tracked(eqn, ins, in_views)
            for var, value, view in zip(eqn.outvars, outs, out_views):
                if not isinstance(var, jcore.DropVar):
                    env[var], seen[var] = value, view
        return [read(v) for v in jaxpr.outvars], [view_of(v) for v in jaxpr.outvars]

    def _tracked(self, eqn, ins, views):
        view = next(v for v in views if v is not None)
        try:
            return self._dispatch(eqn, ins, views)
        except UnsupportedUse as err:
            raise self.refuse(view.path, str(err)) from None

    def _dispatch(self, eqn, ins, views):
        name, params = eqn.primitive.name, eqn.params
        if name == "dot_general":
            return self._dot(eqn, ins, views)
        if call_body(eqn) is not None:
            return self.run(*open_jaxpr(call_body(eqn)), ins, views)
        if name in CUSTOM:
            return self.run(*open_jaxpr(params["call_jaxpr"]), ins, views)
        if name in REMAT:
            return self._remat(eqn, ins, views)
        if name == "scan":
            return self._scan(eqn, ins, views)
        view = views[0]
        if view is None or any(views[1:]):
            raise UnsupportedUse(f"'{name}' reads it, not a matmul")
        if name in LAYOUT:
            out = view
        elif name == "transpose":
            out = view.transposed(params["permutation"])
        elif name == "reshape" and params.get("dimensions") is None:
            out = view.reshaped(params["new_sizes"])
        elif name == "squeeze":
            out = view.squeezed(params["dimensions"])
        elif name == "broadcast_in_dim" and len(ins) == 1:
            out = view.expanded(params["shape"], list(params["broadcast_dimensions"]))
        else:
            raise UnsupportedUse(f"'{name}' reads it, not a matmul")
        return bind(eqn, ins), [out]

    # -------------------------------------------------------------- the matmul
    def _dot(self, eqn, ins, views):
        (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
        if views[0] is not None and views[1] is not None:
            raise UnsupportedUse("a matmul reads it together with another adapted weight")
        side = 0 if views[0] is not None else 1
        view, weight, x = views[side], ins[side], ins[1 - side]
        w_contract, x_contract = (lc, rc) if side == 0 else (rc, lc)
        if (lb, rb)[side]:
            raise UnsupportedUse("a batched matmul (dot_general batch dimensions) reads it")
        inputs = view.input_axes(w_contract)
        site = Site(view.path, view.shape, view.stack, inputs)
        known = self.sites.setdefault(view.path, site)
        if known != site:
            raise UnsupportedUse(
                f"matmuls read it in two ways (input axes {known.inputs} and "
                f"{site.inputs}, stacked axes {known.stack} and {site.stack})"
            )
        out = bind(eqn, ins)[0]
        if self.factors is None:
            return [out], [None]
        if (view.path, view.stack) not in self.factors:
            raise UnsupportedUse("the adapters have no factors for it (made for other targets?)")
        self.used.add(view.path)
        a, b = self.factors[(view.path, view.stack)]
        outputs = tuple(k for k in range(view.stack, len(view.shape)) if k not in inputs)
        free = [k for k in range(weight.ndim) if k not in w_contract]
        a_op = view.factor_like(a, inputs, w_contract).astype(weight.dtype)
        b_op = view.factor_like(b, outputs, free).astype(weight.dtype)
        b_op = jax.numpy.moveaxis(b_op, -1, 0)
        x = self._dropped(x)
        kw = dict(
            precision=eqn.params.get("precision"),
            preferred_element_type=eqn.params.get("preferred_element_type"),
        )
        down = lax.dot_general(
            x, a_op, ((tuple(x_contract), tuple(range(len(w_contract)))), ((), ())), **kw
        ).astype(weight.dtype)
        up = lax.dot_general(down, b_op, (((down.ndim - 1,), (0,)), ((), ())), **kw)
        if side == 0:  # dot_general puts the weight's kept dimensions first
            x_free = up.ndim - len(free)
            up = lax.transpose(up, [*range(x_free, up.ndim), *range(x_free)])
        return [out + (up * self.scale).astype(out.dtype)], [None]

    def _dropped(self, x):
        key = self._key()
        if key is None:
            return x
        keep = jax.random.bernoulli(key, 1.0 - self.dropout, x.shape)
        return jax.numpy.where(keep, x / (1.0 - self.dropout), 0).astype(x.dtype)

    # -------------------------------------------------------------- higher-order operations
    def _inner(self, factors, rng):
        inner = Replay(
            factors, self.sites, self.refuse, scale=self.scale, dropout=self.dropout, rng=rng
        )
        return inner

    def _remat(self, eqn, ins, views):
        jaxpr, consts = open_jaxpr(eqn.params["jaxpr"])
        wanted = {(v.path, v.stack) for v in views if v is not None}
        factors = (
            None
            if self.factors is None
            else {k: self.factors[k] for k in wanted if k in self.factors}
        )
        rng = self._key()
        found = {}

        def body(values, factors):
            inner = self._inner(factors, rng)
            outs, out_views = inner.run(jaxpr, consts, values, views)
            found["used"] = inner.used
            if any(out_views):
                raise UnsupportedUse("a checkpointed (remat) block returns it")
            return outs

        params = eqn.params
        outs = jax.checkpoint(
            body, prevent_cse=params.get("prevent_cse", True), policy=params.get("policy")
        )(list(ins), factors)
        self.used |= found.get("used", set())
        return list(outs), [None] * len(outs)

    def _scan(self, eqn, ins, views):
        params = eqn.params
        n_consts, n_carry = scan_split(params)
        split = n_consts + n_carry
        if any(views[n_consts:split]):
            raise UnsupportedUse("a loop carries it from one iteration to the next")
        consts, carry, xs = ins[:n_consts], ins[n_consts:split], ins[split:]
        inner_views = list(views[:split]) + [
            None if v is None else v.layer() for v in views[split:]
        ]
        sliced_keys = [(v.path, v.stack) for v in views[split:] if v is not None]
        whole_keys = {(v.path, v.stack) for v in views[:n_consts] if v is not None}
        factors_xs, factors_whole = None, None
        if self.factors is not None:
            factors_xs = [self.factors[k] for k in sliced_keys if k in self.factors]
            factors_whole = {k: self.factors[k] for k in whole_keys if k in self.factors}
        key = self._key()
        keys = None if key is None else jax.random.split(key, params["length"])
        body_jaxpr, body_consts = open_jaxpr(params["jaxpr"])
        found = {}

        def step(carry, sliced):
            data, layer_factors, layer_key = sliced
            factors = None
            if factors_whole is not None:
                factors = dict(factors_whole)
                present = [k for k in sliced_keys if k in self.factors]
                factors.update({(p, s + 1): f for (p, s), f in zip(present, layer_factors)})
            inner = self._inner(factors, layer_key)
            outs, out_views = inner.run(
                body_jaxpr, body_consts, list(consts) + list(carry) + list(data), inner_views
            )
            found["used"] = inner.used
            if any(out_views):
                raise UnsupportedUse("a scan returns it")
            return outs[:n_carry], outs[n_carry:]

        carry, ys = lax.scan(
            step,
            list(carry),
            (list(xs), factors_xs, keys),
            length=params["length"],
            reverse=params["reverse"],
            unroll=params["unroll"],
            _split_transpose=params.get("_split_transpose", False),
        )
        self.used |= found.get("used", set())
        return list(carry) + list(ys), [None] * (len(carry) + len(ys))
