"""Which checkpoints a run keeps: the newest ``checkpoint.keep``, every step that is a multiple of
``checkpoint.keep_every`` (0: none kept for that), and always the newest verified step.

Applied by the trainer after a step's digests are written (never by Orbax, which would delete
an older step as soon as a newer one is renamed into place, before its digests exist: a kill
in between would leave no verified step). A step is deleted by renaming it out of the numbered
steps first (``<step>.deleting``), so a kill in the middle never leaves half a step that looks
whole; leftovers are removed by the next run.
"""

from __future__ import annotations

import shutil
from pathlib import Path

DELETING = ".deleting"
"Suffix of a step being deleted: no longer a step for any reader."


def to_delete(steps: list[int], newest_verified: int, keep: int, keep_every: int) -> list[int]:
    """The steps of ``steps`` that the rules above let go, oldest first."""
    kept = set(sorted(steps)[-keep:]) | {newest_verified}
    if keep_every > 0:
        kept |= {s for s in steps if s % keep_every == 0}
    return [s for s in sorted(steps) if s not in kept]


def delete_steps(directory: Path, steps: list[int]) -> None:
    for step in steps:
        doomed = directory / f"{step}{DELETING}"
        try:
            (directory / str(step)).rename(doomed)
        except FileNotFoundError:
            continue
        shutil.rmtree(doomed, ignore_errors=True)


def remove_leftovers(directory: Path) -> None:
    """Steps whose deletion a kill interrupted."""
    if directory.is_dir():
        for leftover in directory.glob(f"*{DELETING}"):
            shutil.rmtree(leftover, ignore_errors=True)
