"""The longest sequence that fits, decided by compiling.

A step's peak does not grow linearly with its sequence once XLA has had its say (remat,
chunked loops, the scheduler's buffer reuse all change with length), so the answer is not
read off a formula: the step is compiled at one length after another and XLA's own memory
analysis decides each one. ``longest_fitting`` does the search over any ``probe(seq)`` (the
trainer's GPT step for a config is ``zeroflow.cli.max_seq``'s): doubling (or halving) from a
start until one length fits and the next does not, then bisecting between them, in steps of
``granule`` tokens, with at most ``max_compiles`` probes. A probe that fails to compile counts
as not fitting (the reason is kept).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable


@dataclasses.dataclass(frozen=True)
class Probe:
    """One compile at ``seq`` tokens per row: XLA's device peak and host bytes per device
    (None where it did not compile, with ``note`` saying why)."""

    seq: int
    peak_bytes: float | None
    host_bytes: float | None = None
    note: str = ""

    def fits(self, device_memory: float) -> bool:
        return self.peak_bytes is not None and self.peak_bytes <= device_memory


@dataclasses.dataclass(frozen=True)
class Search:
    """What a search found: ``best`` (the longest length that fitted, None if none did),
    ``first_too_long`` (the shortest length that did not, None if none failed below the
    limit) and every probe in the order it was compiled."""

    best: Probe | None
    first_too_long: Probe | None
    probes: tuple[Probe, ...]
    granule: int

    @property
    def converged(self) -> bool:
        """Whether ``best`` and ``first_too_long`` are one granule apart: the answer is exact
        to the granule, not cut short by the compile budget."""
        if self.best is None or self.first_too_long is None:
            return False
        return self.first_too_long.seq - self.best.seq == self.granule


def longest_fitting(
    probe: Callable[[int], Probe],
    device_memory: float,
    *,
    start: int,
    granule: int,
    limit: int,
    max_compiles: int = 12,
    log: Callable[[Probe, int], None] | None = None,
) -> Search:
    """The longest multiple of ``granule`` up to ``limit`` whose ``probe`` fits in
    ``device_memory``, assuming the peak grows with the length. ``log(probe, compiles left)``
    is called after each compile."""
    if granule < 1 or start < 1 or limit < granule or max_compiles < 2:
        raise ValueError(
            f"--max-seq needs a positive start ({start}) and step ({granule}), a limit "
            f"({limit}) of at least one step and at least 2 compiles ({max_compiles})"
        )
    probes: list[Probe] = []
    low: Probe | None = None  # the longest that fitted
    high: Probe | None = None  # the shortest that did not
    top = limit // granule
    units = min(max(start // granule, 1), top)
    while len(probes) < max_compiles:
        got = probe(units * granule)
        probes.append(got)
        if log is not None:
            log(got, max_compiles - len(probes))
        if got.fits(device_memory):
            low = got
        else:
            high = got
        if low is not None and high is not None:  # bisect between the two
            units = (low.seq + high.seq) // (2 * granule)
            if units * granule <= low.seq:
                break
        elif high is None:  # bracket: double while it fits
            if units == top:
                break
            units = min(2 * units, top)
        else:  # halve while it does not
            if units == 1:
                break
            units //= 2
    return Search(low, high, tuple(probes), granule)
