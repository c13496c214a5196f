"""How a weight is laid out where a matmul reads it: a weight followed through layout
operations (casts, transposes, reshapes, size-1 axes, a scan's per-layer slice).

A ``View`` names, for each axis of the value in hand, the pieces of the weight's own axes it
is made of. A piece (an *atom*) is a weight axis, or a part of one that a reshape split off:
``(k,)`` is weight axis ``k``; splitting it gives ``(k, 0)`` (the major part) and ``(k, 1)``
(the minor part), so sorting the atoms of one weight axis gives them in row-major order.
Size-1 atoms are dropped: they carry no index. At a ``dot_general`` the atoms on the
contracted side say which weight axes are the adapter's *input* axes, and how to lay the
adapter factors out like the operand (``factor_like``).
"""

from __future__ import annotations

import dataclasses
import math

from jax import lax


class UnsupportedUse(Exception):
    """A layout the view cannot follow; the interpreter turns it into a ValueError naming the
    parameter."""


@dataclasses.dataclass(frozen=True)
class View:
    path: str
    "The parameter's '/'-joined path (``zeroflow.util.tree.path_str``)."
    shape: tuple[int, ...]
    "The parameter's own shape."
    axes: tuple[tuple[tuple[int, ...], ...], ...]
    "For each axis of the value in hand, its atoms (major first)."
    sizes: dict
    "Atom -> its size."
    stack: int = 0
    "Leading weight axes already taken one index at a time by enclosing scans."

    @classmethod
    def of(cls, path: str, shape) -> View:
        shape = tuple(int(n) for n in shape)
        axes = tuple(((k,),) if n != 1 else () for k, n in enumerate(shape))
        return cls(path, shape, axes, {(k,): n for k, n in enumerate(shape) if n != 1})

    def dim(self, axis: int) -> int:
        return math.prod(self.sizes[a] for a in self.axes[axis])

    # -------------------------------------------------------------- layout operations
    def transposed(self, permutation) -> View:
        return dataclasses.replace(self, axes=tuple(self.axes[p] for p in permutation))

    def squeezed(self, dimensions) -> View:
        return dataclasses.replace(
            self, axes=tuple(a for k, a in enumerate(self.axes) if k not in set(dimensions))
        )

    def expanded(self, shape, broadcast_dimensions) -> View:
        """``broadcast_in_dim`` that only adds size-1 axes (``expand_dims``)."""
        axes: list = [()] * len(shape)
        for k, d in enumerate(broadcast_dimensions):
            axes[d] = self.axes[k]
        for d, n in enumerate(shape):
            if d not in broadcast_dimensions and n != 1:
                raise UnsupportedUse(f"broadcast to {tuple(shape)} repeats the weight")
            if d in broadcast_dimensions and n != self.dim(broadcast_dimensions.index(d)):
                raise UnsupportedUse(f"broadcast to {tuple(shape)} repeats the weight")
        return dataclasses.replace(self, axes=tuple(axes))

    def reshaped(self, new_sizes) -> View:
        """Atoms regrouped into ``new_sizes``, splitting an atom where a new axis ends inside
        it; a reshape that would cut an atom unevenly is refused."""
        queue = [a for axis in self.axes for a in axis]
        sizes = dict(self.sizes)
        axes = []
        for n in new_sizes:
            taken, product = [], 1
            while product < n:
                if not queue:
                    raise UnsupportedUse(f"reshape to {tuple(new_sizes)}")
                atom = queue.pop(0)
                need = n // product
                if n % product or (sizes[atom] > need and sizes[atom] % need):
                    raise UnsupportedUse(
                        f"reshape to {tuple(new_sizes)} cuts a weight axis unevenly"
                    )
                if sizes[atom] > need:  # the axis ends inside this atom: split it
                    major, minor = atom + (0,), atom + (1,)
                    sizes[major], sizes[minor] = need, sizes.pop(atom) // need
                    atom = major
                    queue.insert(0, minor)
                taken.append(atom)
                product *= sizes[atom]
            if product != n:
                raise UnsupportedUse(f"reshape to {tuple(new_sizes)}")
            axes.append(tuple(taken))
        return dataclasses.replace(self, axes=tuple(axes), sizes=sizes)

    def layer(self) -> View:
        """The view of one slice along the leading axis (a scan over a stack of layers): that
        axis must be the next whole weight axis (or, for a stack of one layer, a size-1 axis:
        it carries no atom, and slicing it is the same whichever size-1 axis it is)."""
        single = (
            bool(self.axes)
            and self.axes[0] == ()
            and self.stack < len(self.shape)
            and self.shape[self.stack] == 1
        )
        if not single and (not self.axes or self.axes[0] != ((self.stack,),)):
            raise UnsupportedUse(
                "a scan slices it along an axis other than its leading (layer) axis"
            )
        return dataclasses.replace(self, axes=self.axes[1:], stack=self.stack + 1)

    # -------------------------------------------------------------- the matmul
    def input_axes(self, contracted) -> tuple[int, ...]:
        """The weight axes that the axes ``contracted`` of the value in hand are made of; a
        weight axis split across both sides is refused."""
        inside = {a[0] for c in contracted for a in self.axes[c]}
        outside = {a[0] for k, axis in enumerate(self.axes) if k not in contracted for a in axis}
        if inside & outside:
            axis = min(inside & outside)
            raise UnsupportedUse(
                f"its axis {axis} is split between the contracted and the "
                "kept dimensions of the matmul"
            )
        if any(k < self.stack for k in inside):
            raise UnsupportedUse("a matmul contracts its stacked (layer) axis")
        return tuple(sorted(inside))

    def atoms_of(self, weight_axes) -> list:
        """The atoms of ``weight_axes`` in hand, in row-major order of the weight."""
        return sorted(a for axis in self.axes for a in axis if a[0] in set(weight_axes))

    def factor_like(self, factor, weight_axes, view_axes):
        """An adapter factor laid out like the operand: ``factor`` holds ``weight_axes`` (in
        the weight's order; its other axes have size 1) and a trailing rank axis; returns it
        with the dimensions ``view_axes`` of the value in hand, in that order, then the rank."""
        atoms = self.atoms_of(weight_axes)
        rank = factor.shape[-1]
        factor = factor.reshape([*(self.sizes[a] for a in atoms), rank])
        order = [atoms.index(a) for v in view_axes for a in self.axes[v]]
        factor = lax.transpose(factor, [*order, len(atoms)])
        return factor.reshape([*(self.dim(v) for v in view_axes), rank])
