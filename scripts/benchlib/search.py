"""The largest GPT that trains: a search over the number of layers at a fixed width.

Each probe (does a model of L layers train?) costs a process start, a compile and two steps, so
the search starts where ``zeroflow.memory`` predicts the limit is and needs few probes: from
the prediction it grows (or shrinks) by a growing fraction until the answer flips, then
bisects the bracket. ``layer_search`` is a generator: it yields the next layer count to probe
and is sent the verdict (True fits, False out of memory, None the probe failed otherwise,
which ends the search); its return value is the result.
"""
from __future__ import annotations

from collections.abc import Callable, Generator


def predicted_max_layers(estimate_at: Callable[[int], object], *, device_bytes: float,
                         host_bytes: float | None, max_layers: int) -> int:
    """The largest L <= max_layers whose estimate fits the device (and the host, when given),
    0 when none does. ``estimate_at(L)`` returns a ``zeroflow.memory.MemoryEstimate``."""
    best = 0
    for layers in range(1, max_layers + 1):
        est = estimate_at(layers)
        if est.device_bytes > device_bytes or (host_bytes is not None and est.host_bytes > host_bytes):
            break
        best = layers
    return best


def layer_search(start: int, *, max_layers: int, max_probes: int,
                 growth: float = 0.1) -> Generator[int, bool | None, dict]:
    """Probe ``start``, then move by ``growth`` x start (doubling each time) until the verdict
    flips, then bisect. Ends after ``max_probes`` probes or when the bracket is one layer."""
    fits_at, fails_at = 0, max_layers + 1  # largest known to fit, smallest known not to
    probes: list[list] = []
    layers, stride = max(1, min(start, max_layers)), max(1, round(growth * max(start, 1)))
    stopped = None
    while len(probes) < max_probes and fails_at - fits_at > 1:
        verdict = yield layers
        probes.append([layers, verdict])
        if verdict is None:
            stopped = f"probe at {layers} layers failed (not an out-of-memory error)"
            break
        if verdict:
            fits_at = layers
        else:
            fails_at = layers
        if fails_at - fits_at <= 1:
            break
        if fails_at > max_layers:  # everything so far fit: grow
            layers, stride = min(max_layers, layers + stride), stride * 2
            if layers == fits_at:
                break
        elif fits_at == 0:  # nothing fit yet: shrink
            layers, stride = max(1, layers - stride), stride * 2
            if layers == fails_at:
                break
        else:
            layers = (fits_at + fails_at) // 2
    if stopped is None and len(probes) >= max_probes and fails_at - fits_at > 1:
        stopped = f"probe limit ({max_probes}) reached before the bracket closed"
    return {"largest_fits": fits_at, "smallest_fails": fails_at if fails_at <= max_layers else None,
            "exact": fails_at - fits_at == 1, "probes": probes, "stopped": stopped}
