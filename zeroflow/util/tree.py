"""Key paths of pytree leaves, as every part of zeroflow names them."""

from __future__ import annotations


def path_str(path) -> str:
    """'/'-joined key path of a pytree leaf, e.g. ``Dense_0/kernel``."""
    parts = []
    for k in path:
        for attr in ("key", "name", "idx"):
            if hasattr(k, attr):
                parts.append(str(getattr(k, attr)))
                break
        else:
            parts.append(str(k))
    return "/".join(parts)


def is_under(path: str, prefix: str | None) -> bool:
    """Whether the leaf at ``path`` (``path_str``) lies under the subtree ``prefix`` (None: no
    subtree), e.g. ``blocks/attn/w`` under ``blocks``, but ``blocks2/w`` not."""
    return prefix is not None and (path + "/").startswith(prefix + "/")
