"""Batches as pure functions of (seed, step): resuming at step s replays step s exactly.

Each batch row is a window of ``seq_len + 1`` consecutive tokens (inputs and shifted targets).
The window offsets of the whole global batch are drawn first; a process then keeps its own
contiguous block of rows and reads only those windows, so with many hosts each reads just
its part, and the hosts' parts stack up to the single-process batch.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def _local_rows(global_batch: int, process_index: int, process_count: int) -> slice:
    if process_count <= 0 or not 0 <= process_index < process_count:
        raise ValueError(f"process_index {process_index} is not in [0, {process_count})")
    if global_batch <= 0 or global_batch % process_count:
        raise ValueError(
            f"global_batch {global_batch} must be a positive multiple of "
            f"process_count {process_count}"
        )
    local = global_batch // process_count
    return slice(process_index * local, (process_index + 1) * local)


def _num_starts(tokens: np.ndarray, seq_len: int, what: str) -> int:
    """How many window offsets fit in ``tokens``."""
    if seq_len <= 0:
        raise ValueError(f"seq_len must be positive, got {seq_len}")
    count = len(tokens) - seq_len
    if count <= 0:
        raise ValueError(f"{what} has {len(tokens)} tokens, fewer than seq_len + 1 = {seq_len + 1}")
    return count


def read_windows(tokens: np.ndarray, starts: Sequence[int] | np.ndarray, length: int) -> np.ndarray:
    """``tokens[s : s + length]`` for every start, as int32 ``[len(starts), length]``."""
    starts = np.asarray(starts, dtype=np.int64)
    return np.asarray(tokens[starts[:, None] + np.arange(length)], dtype=np.int32)


def train_batch(
    tokens: np.ndarray,
    step: int,
    *,
    global_batch: int,
    seq_len: int,
    seed: int,
    process_index: int = 0,
    process_count: int = 1,
) -> np.ndarray:
    """This process's rows of the training batch of ``step``.

    Returns int32 ``[global_batch // process_count, seq_len + 1]``.
    """
    rows = _local_rows(global_batch, process_index, process_count)
    num_starts = _num_starts(tokens, seq_len, "the training split")
    starts = np.random.default_rng([int(seed), int(step)]).integers(0, num_starts, global_batch)
    return read_windows(tokens, starts[rows], seq_len + 1)


def eval_batches(
    tokens: np.ndarray,
    *,
    num_batches: int,
    global_batch: int,
    seq_len: int,
    process_index: int = 0,
    process_count: int = 1,
) -> list[np.ndarray]:
    """The fixed held-out batches, identical at every evaluation.

    ``num_batches * global_batch`` windows evenly spaced over ``tokens``; batch ``i`` takes
    every ``num_batches``-th of them from ``i``, so each batch spans the whole split.
    """
    rows = _local_rows(global_batch, process_index, process_count)
    if num_batches <= 0:
        return []
    num_starts = _num_starts(tokens, seq_len, "the validation split")
    starts = np.linspace(0, num_starts - 1, num_batches * global_batch).round().astype(np.int64)
    grid = starts.reshape(global_batch, num_batches).T  # grid[i] = starts[i::num_batches]
    return [read_windows(tokens, grid[i][rows], seq_len + 1) for i in range(num_batches)]
