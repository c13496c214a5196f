"""What the backward pass holds at its fullest, from the gradient's jaxpr and a model of what
XLA fuses (nothing compiled).

``jax.vjp``'s residuals are what jax keeps, not what XLA keeps: XLA fuses elementwise work
into its consumers and recomputes it there, keeps values an expensive elementwise chain makes
for several consumers, copies convolution operands into the layout the convolution wants, and
writes a result over an operand that dies. Summing the residuals therefore overstates a
transformer's activations by a fifth and misses a CNN's backward copies entirely (the corpus
in ``experiments/estimator_corpus.py``). ``peak_bytes`` walks the gradient's equations in
order instead, with these rules:

1. **Buffers.** A value is a buffer of its own where XLA cannot fuse it away: the result of a
   primitive outside ``FUSIBLE`` (dots, convolutions, reductions, scatters, gathers, random
   bits, loops, kernels), an operand of a primitive that reads whole buffers (any primitive
   outside ``FUSIBLE`` but a gather), and a value an expensive elementwise chain (``EXPENSIVE``:
   ``exp``, ``tanh``, ``div``...) computes for more than one consumer. Every other value is
   recomputed inside each consumer: the buffers it is computed from live until its last
   consumer has run. Where ``Traits.fuses_matmul_and_reduction_operands`` (XLA:GPU), matmuls
   and reductions (``REDUCTIONS``) also read fused operands: Triton computes a matmul's
   elementwise operands in the kernel (as compiled without autotuning: on a GPU the autotuner
   may choose cuBLAS, which reads written-out operands), and a reduction kernel its input's.
2. **Layout copies** (``Traits.copies_conv_layouts``: XLA:CPU). A convolution whose operand
   (or result) is not in the native layout (channels last: ``NHWC``, ``HWIO``) reads (or
   writes) a transposed copy; the copies of one value are made together and each lives until
   its convolution has run. XLA:GPU chooses the convolutions' layouts instead.
3. **In place.** A fused elementwise result or a scatter is written over a buffer of the same
   size that dies at it; on XLA:GPU not a result a reduction reads (XLA computes the two in
   one kernel with outputs of their own: the corpus CNN's activation gradient beside its
   bias gradient).
4. **Loops.** A loop body's own peak adds to what is live when the loop runs.
5. **Split-K** (``Traits.splits_k``: XLA:GPU). A small matmul with a long contraction writes
   fp32 partial sums beside everything live while it runs (``zeroflow.memory.split_k``). How
   long XLA keeps them after is its schedule's choice (in the corpus's NNX step, until a
   gradient's reduce-scatter): the walk counts the matmul alone.

The parameters (inputs) and the gradients (outputs, also as made before a transpose or a
reshape) are not counted: ``estimate_step`` has terms of its own for them. Values in host
memory (a remat policy's offloaded residuals) are not device buffers. Measured against XLA:CPU
and XLA:GPU on the corpus models: docs/memory.md.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
from jax.extend.core import Literal

from zeroflow import backend
from zeroflow.memory import split_k
from zeroflow.util import jaxprs
from zeroflow.util.compat import REMAT_PRIMITIVES

EXPENSIVE = frozenset(
    {
        "exp",
        "exp2",
        "expm1",
        "log",
        "log1p",
        "tanh",
        "logistic",
        "erf",
        "erf_inv",
        "erfc",
        "div",
        "rem",
        "sqrt",
        "rsqrt",
        "cbrt",
        "pow",
        "sin",
        "cos",
        "tan",
        "asin",
        "acos",
        "atan",
        "atan2",
        "sinh",
        "cosh",
        "asinh",
        "acosh",
        "atanh",
        "lgamma",
        "digamma",
    }
)
"Elementwise primitives XLA does not recompute for a second consumer."

FUSIBLE = EXPENSIVE | frozenset(
    {
        "abs",
        "add",
        "add_any",
        "and",
        "bitcast_convert_type",
        "broadcast_in_dim",
        "ceil",
        "clamp",
        "concatenate",
        "convert_element_type",
        "copy",
        "copy_p",
        "dynamic_slice",
        "eq",
        "expand_dims",
        "floor",
        "ge",
        "gt",
        "imag",
        "integer_pow",
        "iota",
        "is_finite",
        "le",
        "lt",
        "max",
        "min",
        "mul",
        "ne",
        "neg",
        "nextafter",
        "not",
        "one_minus_square",
        "or",
        "pad",
        "real",
        "reduce_precision",
        "reshape",
        "rev",
        "round",
        "select_n",
        "shift_left",
        "shift_right_arithmetic",
        "shift_right_logical",
        "sign",
        "slice",
        "square",
        "squeeze",
        "stop_gradient",
        "sub",
        "transpose",
        "unstack",
        "xor",
        "optimization_barrier",
    }
)
"""Primitives XLA fuses into their consumers (elementwise work and data movement).
``one_minus_square`` (``tanh``'s derivative) and ``unstack`` are jax 0.11's."""

READS_IN_PLACE = frozenset({"gather"})
"Outside ``FUSIBLE`` (a buffer of its own) but reading its operand where it lies."

IN_PLACE = frozenset(
    {"scatter-add", "scatter_add", "scatter", "scatter-mul", "scatter_mul", "dynamic_update_slice"}
)
"Outside ``FUSIBLE``, writing its result over its first operand when that dies there."

REDUCTIONS = frozenset(
    {
        "reduce_sum",
        "reduce_max",
        "reduce_min",
        "reduce_prod",
        "reduce_and",
        "reduce_or",
        "argmax",
        "argmin",
    }
)
"Outside ``FUSIBLE``; on XLA:GPU reading their fused input inside the reduction kernel."

_LOOPS = ("scan", "while", "cond")


@dataclasses.dataclass(frozen=True)
class _Eqn:
    name: str
    ins: list
    outs: list
    params: dict


def memory_of(x) -> str:
    """ "host" for a value (or variable) in host memory, else "device"."""
    space = getattr(getattr(x, "aval", None), "memory_space", None)
    return "host" if space is not None and space.name.lower() == "host" else "device"


def nbytes(var) -> int:
    aval = var.aval
    shape = getattr(aval, "shape", None)
    if shape is None:
        return 0
    try:
        width = np.dtype(aval.dtype).itemsize
    except TypeError:  # a PRNG key array: two uint32 words per key
        width = 8
    return math.prod(shape) * width


def _body(eqn):
    """The sub-jaxpr to inline for a call, a remat or a custom-derivative call, else None."""
    if jaxprs.call_body(eqn) is not None:
        return jaxprs.call_body(eqn)
    if eqn.primitive.name in REMAT_PRIMITIVES or eqn.primitive.name.startswith("custom_"):
        return (
            eqn.params.get("jaxpr") or eqn.params.get("call_jaxpr") or eqn.params.get("fun_jaxpr")
        )
    return None


def flat_equations(jaxpr) -> list[_Eqn]:
    """The equations of ``jaxpr`` with calls, remats and custom-derivative calls inlined (their
    outputs renamed to the body's), loops kept whole."""
    out: list[_Eqn] = []

    def visit(jx, env):
        rename = lambda v: v if isinstance(v, Literal) else env.get(v, v)  # noqa: E731
        for eqn in jx.eqns:
            ins = [rename(v) for v in eqn.invars]
            body = _body(eqn)
            if body is None:
                out.append(_Eqn(eqn.primitive.name, ins, list(eqn.outvars), eqn.params))
                continue
            inner, _ = jaxprs.open_jaxpr(body)
            sub = dict(zip(inner.invars, ins))
            visit(inner, sub)
            for o, io in zip(eqn.outvars, inner.outvars):
                env[o] = io if isinstance(io, Literal) else sub.get(io, io)

    visit(jaxpr, {})
    return out


def _vars(values):
    return [v for v in values if not isinstance(v, Literal)]


class _Graph:
    """Which values of ``eqns`` are buffers (rule 1) and, for every value, the buffers it is
    computed from (itself for a buffer or an input)."""

    def __init__(self, eqns: list[_Eqn], inputs: set, outputs: set, reads_fused=READS_IN_PLACE):
        self.eqns, self.inputs = eqns, inputs
        consumers: dict = {}
        for i, e in enumerate(eqns):
            for v in _vars(e.ins):
                consumers.setdefault(v, set()).add(i)
        self.buffers = set(outputs)
        costly: dict = {}
        for e in eqns:
            if e.name not in FUSIBLE:
                self.buffers.update(e.outs)
                if e.name not in reads_fused:
                    self.buffers.update(_vars(e.ins))
                continue
            chain = e.name in EXPENSIVE or any(
                costly.get(v, False) for v in _vars(e.ins) if v not in self.buffers
            )
            for o in e.outs:
                costly[o] = chain
                if chain and len(consumers.get(o, ())) >= 2:
                    self.buffers.add(o)
        self.sources: dict = {}
        for e in eqns:
            found = self.read_by(e)
            for o in e.outs:
                self.sources[o] = found

    def buffers_of(self, var) -> set:
        """The buffers ``var`` is read from: itself, or those a fused value is computed from."""
        return (
            {var} if (var in self.buffers or var in self.inputs) else self.sources.get(var, set())
        )

    def read_by(self, e: _Eqn) -> set:
        """The buffers equation ``e`` reads, through the fused values it reads."""
        return set().union(*(self.buffers_of(v) for v in _vars(e.ins)))


def _native_specs(rank: int) -> dict:
    """The layouts XLA's convolutions read and write without a copy: channels last."""
    return {
        "lhs": (0, rank - 1) + tuple(range(1, rank - 1)),
        "rhs": (rank - 1, rank - 2) + tuple(range(rank - 2)),
        "out": (0, rank - 1) + tuple(range(1, rank - 1)),
    }


def _layout_copies(graph: _Graph) -> list[tuple[int, int, int]]:
    """Rule 2: ``(first, last, bytes)`` of each copy, live from equation ``first`` (the first
    convolution to copy that buffer) to ``last`` (the convolution reading this copy)."""
    wanted: dict = {}
    copies = []
    for i, e in enumerate(graph.eqns):
        if e.name != "conv_general_dilated":
            continue
        numbers = e.params["dimension_numbers"]
        native = _native_specs(len(numbers.lhs_spec))
        for spec, var, kind in (
            (numbers.lhs_spec, e.ins[0], "lhs"),
            (numbers.rhs_spec, e.ins[1], "rhs"),
        ):
            if tuple(spec) != native[kind] and not isinstance(var, Literal):
                for buffer in graph.buffers_of(var):
                    wanted.setdefault(buffer, []).append(i)
        if tuple(numbers.out_spec) != native["out"]:
            copies.append((i, i, nbytes(e.outs[0])))
    for buffer, uses in wanted.items():
        copies.extend((min(uses), use, nbytes(buffer)) for use in uses)
    return copies


def _loop_peak(e: _Eqn) -> float:
    """Rule 4: the peak of a loop's body (of its largest branch for a ``cond``)."""
    if e.name == "scan":
        bodies = [e.params["jaxpr"]]
    elif e.name == "while":
        bodies = [e.params["body_jaxpr"], e.params["cond_jaxpr"]]
    else:
        bodies = list(e.params["branches"])
    return max(peak_bytes(b) for b in bodies)


def peak_bytes(closed) -> float:
    """The most bytes of device buffers live at once while ``closed`` (a ``ClosedJaxpr`` or
    ``Jaxpr``: the gradient of a loss) runs on the backend being traced for
    (``zeroflow.backend.current()``), its inputs and outputs not counted."""
    jaxpr, _ = jaxprs.open_jaxpr(closed)
    outputs = set(_vars(jaxpr.outvars))
    eqns = flat_equations(jaxpr)
    traits = backend.current()
    gpu_fusion = traits.fuses_matmul_and_reduction_operands
    graph = _Graph(
        eqns,
        set(jaxpr.invars) | set(jaxpr.constvars),
        outputs,
        READS_IN_PLACE | ({"dot_general"} | REDUCTIONS if gpu_fusion else set()),
    )
    reduced = (
        {v for e in eqns if e.name in REDUCTIONS for v in _vars(e.ins)} if gpu_fusion else set()
    )
    last: dict = {}
    becomes_output: dict = {}
    for i, e in enumerate(eqns):
        for buffer in graph.read_by(e):
            last[buffer] = i
            # (a gradient transposed or reshaped on its way out: the buffer is the output)
            becomes_output[buffer] = (
                becomes_output.get(buffer, True)
                and e.name in FUSIBLE
                and all(o in outputs and nbytes(o) == nbytes(buffer) for o in e.outs)
            )

    def counted(v):
        return (
            v in graph.buffers
            and v not in graph.inputs
            and v not in outputs
            and not becomes_output.get(v, False)
            and memory_of(v) == "device"
        )

    copies = _layout_copies(graph) if traits.copies_conv_layouts else []
    dies_at: dict = {}
    for buffer, i in last.items():
        dies_at.setdefault(i, []).append(buffer)
    live: set = set()
    held = best = 0.0
    for i, e in enumerate(eqns):
        made = [o for o in e.outs if counted(o)]
        if made and ((e.name in FUSIBLE and e.name != "transpose") or e.name in IN_PLACE):
            # Rule 3: written over a buffer of the same size that dies here.
            dying = [b for b in graph.read_by(e) if b in live and last.get(b) == i]
            for o in made:
                if o in reduced:  # (XLA:GPU writes it beside the reduction: a buffer of its own)
                    continue
                same = next((b for b in dying if nbytes(b) == nbytes(o)), None)
                if same is not None:
                    dying.remove(same)
                    live.discard(same)
                    held -= nbytes(same)
        for o in made:
            live.add(o)
            held += nbytes(o)
            if o not in last:  # read by nothing: freed once made
                dies_at.setdefault(i, []).append(o)
        transient: float = sum(size for first, use, size in copies if first <= i <= use)
        if e.name in _LOOPS:
            transient += _loop_peak(e)
        elif e.name == "dot_general" and traits.splits_k:
            # (the sum is written once they are done: a counted result is not there yet)
            transient += max(0, split_k.partial_sums_bytes(e) - sum(nbytes(o) for o in made))
        best = max(best, held + transient)
        for buffer in dies_at.get(i, ()):
            if buffer in live:
                live.discard(buffer)
                held -= nbytes(buffer)
    return best
