"""``AutocastPolicy``: per-primitive and per-name-scope overrides of the default lists."""

from __future__ import annotations

import dataclasses
import re

from zeroflow.autocast import fp8, fp8_delayed, lists

_PRIMITIVE_FIELDS = ("low", "fp32", "follow", "keep")


def _as_tuple(value, field: str) -> tuple[str, ...]:
    if isinstance(value, str):
        return (value,)  # a lone name, not its characters
    try:
        items = tuple(value)
    except TypeError:
        raise ValueError(
            f"AutocastPolicy.{field} must be a sequence of strings, got {value!r}"
        ) from None
    bad = [x for x in items if not isinstance(x, str) or not x]
    if bad:
        raise ValueError(f"AutocastPolicy.{field} must hold non-empty strings, got {bad[0]!r}")
    return items


@dataclasses.dataclass(frozen=True)
class AutocastPolicy:
    """Overrides of ``zf.autocast``'s lists; every field is optional.

    Primitive names are jax's (``dot_general``, ``exp``, ``reduce_sum``, ...; see
    ``docs/autocast.md``). Scope names match ``jax.named_scope`` names and Flax module paths
    (``"Block_0/attn"`` or just ``"attn"``), as a run of whole path components.
    """

    low: tuple[str, ...] = ()
    "Extra primitives that start in half precision (added to the allow list)."
    fp32: tuple[str, ...] = ()
    "Extra primitives that always run in fp32 (added to the fp32 list)."
    follow: tuple[str, ...] = ()
    "Extra primitives that follow their inputs' precision."
    keep: tuple[str, ...] = ()
    "Primitives that keep the dtypes the program declared (taken off every list)."
    fp32_scopes: tuple[str, ...] = ()
    "Name scopes whose operations all keep their declared (fp32) dtypes."
    low_scopes: tuple[str, ...] = ()
    "Name scopes whose allow-list operations run low whatever the cost model says."
    custom_calls: tuple[str, ...] = ()
    "custom_jvp / custom_vjp functions (by name) whose bodies run under autocast; their rule is kept."
    cost_model: bool = True
    "Keep an allow-list op in fp32 when the casts it needs move more bytes than it saves."
    train: bool = True
    "The cost model counts the backward pass too (forward only when False)."
    fp8_scaling: str = "tensor"
    "dtype='fp8': 'tensor' or 'row' (current scaling, ``fp8.py``) or 'delayed' (``fp8_delayed.py``)."
    fp8_history: int = fp8_delayed.DEFAULT_HISTORY
    "fp8_scaling='delayed': steps of amax history per tensor (Transformer Engine's default)."
    fp8_margin: int = 0
    "fp8_scaling='delayed': the scale leaves 2**margin of headroom above the history's max."
    fp8_keep_scopes: tuple[str, ...] = ("lm_head",)
    "dtype='fp8': name scopes whose matmuls stay bf16 (the LM head; e.g. a first or last layer)."
    fp8_cost_model: bool = True
    "dtype='fp8': keep a matmul bf16 when the roofline model says FP8 is not faster."

    def __post_init__(self) -> None:
        for spec in dataclasses.fields(self):
            if spec.type == "tuple[str, ...]":
                object.__setattr__(self, spec.name, _as_tuple(getattr(self, spec.name), spec.name))
        known = lists.known_primitive_names()
        seen: dict[str, str] = {}
        for field in _PRIMITIVE_FIELDS:
            for name in getattr(self, field):
                if name not in known:
                    close = sorted(k for k in known if k.startswith(name[:3]))[:8]
                    raise ValueError(
                        f"AutocastPolicy.{field}: unknown primitive {name!r}"
                        + (f"; similar: {close}" if close else "")
                    )
                if name in seen:
                    raise ValueError(
                        f"AutocastPolicy: primitive {name!r} is in both "
                        f"{seen[name]!r} and {field!r}"
                    )
                seen[name] = field
        fp8.check_scaling(self.fp8_scaling, "AutocastPolicy.fp8_scaling")
        for field, least in (("fp8_history", 1), ("fp8_margin", 0)):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise ValueError(
                    f"AutocastPolicy.{field} must be an integer >= {least}, got {value!r}"
                )
        for field in ("cost_model", "train", "fp8_cost_model"):
            if not isinstance(getattr(self, field), bool):
                raise ValueError(
                    f"AutocastPolicy.{field} must be True or False, got {getattr(self, field)!r}"
                )

    def category(self, primitive: str) -> str:
        """``"low"``, ``"fp32"``, ``"follow"``, ``"neutral"``, ``"operand_led"``,
        ``"passthrough"`` or ``"keep"`` for a primitive name."""
        for field in _PRIMITIVE_FIELDS:
            if primitive in getattr(self, field):
                return field
        if primitive in lists.ALLOW:
            return "low"
        for name, members in (
            ("fp32", lists.FP32),
            ("follow", lists.FOLLOW),
            ("neutral", lists.NEUTRAL),
            ("operand_led", lists.OPERAND_LED),
            ("passthrough", lists.PASSTHROUGH),
        ):
            if primitive in members:
                return name
        return "keep"

    def fp8_kept(self, scope: str) -> bool:
        """Whether an equation in this name stack stays bf16 under dtype='fp8'."""
        parts = split_scope(scope)
        return any(_contains_run(parts, split_scope(s)) for s in self.fp8_keep_scopes)

    def scope_rule(self, scope: str) -> str | None:
        """``"fp32"``, ``"low"`` or None for an eqn's name stack (``"Model/Block_0/attn"``)."""
        parts = split_scope(scope)
        for rule, scopes in (("fp32", self.fp32_scopes), ("low", self.low_scopes)):
            if any(_contains_run(parts, split_scope(s)) for s in scopes):
                return rule
        return None


def split_scope(scope: str) -> list[str]:
    """``"transpose(jvp(M/up))"`` style name stacks -> ``["M", "up"]`` (transform names dropped)."""
    plain = re.sub(r"[\w.-]+\(", "", scope).replace(")", "")
    return [part for part in plain.split("/") if part]


def _contains_run(parts: list[str], run: list[str]) -> bool:
    n = len(run)
    return n > 0 and any(parts[i : i + n] == run for i in range(len(parts) - n + 1))
