"""Whether a path can name a file or folder at all, asked before any work is done with it."""

from __future__ import annotations

import errno
import os
from pathlib import Path


def path_problem(path: Path) -> str | None:
    """Why the OS would refuse ``path`` for its form alone (a name too long, a part that is a
    file), or None."""
    try:
        os.stat(path)
    except FileNotFoundError:
        pass
    except NotADirectoryError:
        parent = next((p for p in path.parents if p.is_file()), None)
        return f"{parent or 'a part of it'} is a file, not a folder"
    except OSError as e:
        if e.errno == errno.ENAMETOOLONG:
            return "its name is too long for the file system (at most 255 bytes per name)"
        raise
    for parent in path.parents:
        if parent.exists():
            return None if parent.is_dir() else f"{parent} is a file, not a folder"
    return None
