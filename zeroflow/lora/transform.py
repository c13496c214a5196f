"""``zf.lora``: low-rank adapters on any loss function, with no change to the model.

    lo = zf.lora(loss_fn, rank=8, alpha=16, targets=r"attn/(query|value)/kernel")
    adapters = lo.init(rng, params, batch)              # shapes found by tracing the loss once
    loss = lo.loss({"base": params, "lora": adapters}, batch)   # rng=... turns dropout on
    merged = lo.merge(params, adapters)                 # W + (alpha / rank) * a b, in fp32

``lo.loss`` traces ``loss_fn`` to a jaxpr and replays it (``replay.py``): every matmul that
reads a weight whose path (``zeroflow.util.tree.path_str``) matches ``targets`` (``re.search``)
also computes ``(alpha / rank) * (dropout(x) @ a) @ b``. The base weights are inputs like any
other: the engine keeps them frozen (``trainable=``), or take gradients of the ``"lora"``
part only.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable

import jax

from zeroflow.autocast.interpret import trace
from zeroflow.lora.adapters import Site, flatten, init_factors, nest, update
from zeroflow.lora.replay import Replay
from zeroflow.lora.views import View
from zeroflow.util.tree import path_str

_DROPOUT_SALT = 0x10A
"Folded into the step's key, so the adapters' dropout draws differ from the model's own."


@dataclasses.dataclass(frozen=True)
class LoRA:
    """A loss with low-rank adapters; made by ``zf.lora``. See the module docstring."""

    loss_fn: Callable
    rank: int
    alpha: float
    targets: str
    dropout: float = 0.0

    def __post_init__(self):
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank < 1:
            raise ValueError(f"lora rank={self.rank!r}; expected a positive integer")
        if (
            isinstance(self.alpha, bool)
            or not isinstance(self.alpha, (int, float))
            or not self.alpha > 0
        ):
            raise ValueError(f"lora alpha={self.alpha!r}; expected a positive number")
        if not isinstance(self.dropout, (int, float)) or not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"lora dropout={self.dropout!r}; expected a number in [0, 1)")
        if not isinstance(self.targets, str) or not self.targets:
            raise ValueError(
                f"lora targets={self.targets!r}; expected a regex over parameter "
                "paths such as 'attn/(query|value)/kernel'"
            )
        try:
            re.compile(self.targets)
        except re.error as err:
            raise ValueError(f"lora targets={self.targets!r} is not a regex ({err})") from None
        if not callable(self.loss_fn):
            raise ValueError(f"lora needs a callable loss, got {type(self.loss_fn).__name__}")

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    # -------------------------------------------------------------- the adapted loss
    def loss(self, params, *args, rng=None, **kwargs):
        """``loss_fn(params["base"], *args, **kwargs)`` with the adapters ``params["lora"]``
        added to the matmuls. ``rng`` (as the engine passes it) goes on to ``loss_fn`` and,
        with ``dropout > 0``, drops adapter inputs; without it there is no dropout."""
        if not isinstance(params, dict) or set(params) != {"base", "lora"}:
            raise ValueError(
                "the adapted loss takes params={'base': weights, 'lora': "
                f"adapters}}, got {_describe(params)}"
            )
        flat = flatten(params["lora"])
        factors = {(path, 0): (pair["a"], pair["b"]) for path, pair in flat.items()}
        if rng is not None:
            kwargs = {**kwargs, "rng": rng}
        dropout_rng = (
            None if rng is None or not self.dropout else jax.random.fold_in(rng, _DROPOUT_SALT)
        )
        replay = Replay(
            factors, {}, self._refusal, scale=self.scale, dropout=self.dropout, rng=dropout_rng
        )
        out = self._replay(replay, params["base"], args, kwargs)
        unused = sorted(set(flat) - replay.used)
        if unused:
            raise ValueError(
                f"lora: adapters for {unused[:4]} but no matmul of the loss reads "
                "those weights (adapters made for another model or targets?)"
            )
        return out

    def _replay(self, replay: Replay, base, args, kwargs):
        matched = self.matched(base)
        closed, arrays, out_tree = trace(self.loss_fn, (base, *args), kwargs)
        paths = [path_str(p) for p, _ in jax.tree_util.tree_leaves_with_path(base)]
        views: list[View | None] = [None] * len(arrays)
        for k, path in enumerate(paths):
            if path in matched:
                views[k] = View.of(path, arrays[k].shape)
        outs, out_views = replay.run(closed.jaxpr, closed.consts, arrays, views)
        for view in out_views:
            if view is not None:
                raise self._refusal(view.path, "the loss returns it")
        return jax.tree.unflatten(out_tree, outs)

    def matched(self, base) -> set[str]:
        """The paths of ``base`` that ``targets`` matches; none is an error."""
        leaves = jax.tree_util.tree_leaves_with_path(base)
        for p, leaf in leaves:
            if not hasattr(leaf, "shape") or not hasattr(leaf, "dtype"):
                raise ValueError(
                    f"lora: parameter {path_str(p)!r} is a {type(leaf).__name__}, not an array"
                )
        paths = [path_str(p) for p, _ in leaves]
        found = {p for p in paths if re.search(self.targets, p)}
        if not found:
            raise ValueError(
                f"lora targets={self.targets!r} matches no parameter; paths are like {paths[:6]}"
            )
        return found

    def _refusal(self, path: str, reason: str) -> ValueError:
        return ValueError(
            f"lora: parameter {path!r} (matched by targets={self.targets!r}) "
            f"cannot be adapted: {reason}; LoRA adapts weights that matmuls "
            "(dot_general) read, through casts, transposes and reshapes; narrow "
            "targets to leave it out"
        )

    # -------------------------------------------------------------- adapters
    def sites(self, params, *args, **kwargs) -> dict[str, Site]:
        """Where each matched weight is read (its input and stacked axes), found by tracing
        the loss on shapes only."""
        sites: dict[str, Site] = {}

        def discover(base, args, kwargs):
            self._replay(Replay(None, sites, self._refusal), base, args, kwargs)

        jax.eval_shape(discover, params, args, kwargs)
        unread = sorted(self.matched(params) - set(sites))
        if unread:
            raise ValueError(
                f"lora: targets={self.targets!r} matches {unread[:4]} but no "
                "matmul of the loss reads them; narrow targets to leave them out"
            )
        return sites

    def init(self, rng, params, *args, **kwargs) -> dict:
        """Fresh adapters for ``params``: ``a`` Kaiming-uniform, ``b`` zero (the adapted loss
        starts equal to the base loss). ``args``/``kwargs``: an example batch (and any other
        arguments) of ``loss_fn``, traced on shapes to find where each weight is read."""
        return self.init_at(rng, self.sites(params, *args, **kwargs))

    def init_at(self, rng, sites: dict[str, Site]) -> dict:
        """Fresh adapters for the ``sites`` that ``sites()`` found: what ``init`` returns,
        without tracing the loss again (a trainer builds its state several times)."""
        keys = jax.random.split(rng, len(sites))
        return nest(
            {
                path: init_factors(sites[path], self.rank, key)
                for path, key in zip(sorted(sites), keys)
            }
        )

    def merge(self, params, adapters):
        """``params`` with the adapters folded in (``lora_merge`` at this ``alpha``)."""
        return lora_merge(params, adapters, alpha=self.alpha)


def lora(
    loss_fn: Callable, *, rank: int = 8, alpha: float = 16.0, targets: str, dropout: float = 0.0
) -> LoRA:
    """``loss_fn(params, *args, **kwargs)`` with low-rank adapters on the matmuls that read the
    weights whose path matches ``targets``. See ``zeroflow/lora/transform.py`` and
    docs/lora.md."""
    return LoRA(loss_fn, rank, alpha, targets, dropout)


def lora_merge(params, adapters, *, alpha: float):
    """``W + (alpha / rank) * a b`` for every adapted weight, summed in fp32 and cast back to
    ``W``'s dtype; the rank is read from the factors."""
    flat = flatten(adapters)
    leaves = {path_str(p) for p, _ in jax.tree_util.tree_leaves_with_path(params)}
    unknown = sorted(set(flat) - leaves)
    if unknown:
        raise ValueError(f"lora_merge: adapters for {unknown[:4]}, which params do not have")

    def merged(path, weight):
        pair = flat.get(path_str(path))
        if pair is None:
            return weight
        rank = pair["a"].shape[-1]
        delta = update(weight.shape, pair["a"], pair["b"], alpha / rank)
        return (weight.astype(delta.dtype) + delta).astype(weight.dtype)

    return jax.tree_util.tree_map_with_path(merged, params)


def _describe(params) -> str:
    if isinstance(params, dict):
        return f"a dict with keys {sorted(params)}"
    return type(params).__name__
