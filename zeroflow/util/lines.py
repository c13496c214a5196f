"""Report lines cut only between their items, never inside one.

A report line (``step 10/200  loss 2.3456  lr 3.0e-04  ...``, a run's banner, a recall line) is
a sequence of items, each a name and its value, separated by two spaces or by a comma or a
semicolon and a space (not a colon: ``{'data': 8}`` pairs a name with its value). Piped into a file or another program, a line is written
whole, however long; in a terminal narrower than the line, ``fit`` breaks it between items, so
a name never ends one line with its value on the next (which rich's word wrapping, and the
terminal's own, do at the first space that overflows).
"""

from __future__ import annotations

import re

BREAK = re.compile(r"(?<=[,;]) (?=\S)| {2,}")
"Where a line may be cut: after a comma or semicolon and its space, or at two spaces."
INDENT = "  "
"Continuation lines start with this, so that they read as part of the line above."


def fit(message: str, width: int | None) -> list[str]:
    """``message`` as lines of at most ``width`` characters, cut only at ``BREAK``s (an item
    wider than ``width`` keeps its own line, whole); ``width`` None: one line."""
    if width is None or len(message) <= width or "\n" in message:
        return [message]
    pieces = BREAK.split(message)
    lines = [pieces[0]]
    separators = [m.group(0) for m in BREAK.finditer(message)]
    for separator, piece in zip(separators, pieces[1:]):
        joined = lines[-1] + separator + piece
        if len(joined) <= width:
            lines[-1] = joined
        else:
            lines[-1] = lines[-1].rstrip()
            lines.append(INDENT + piece)
    return lines
