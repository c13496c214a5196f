"""Packed batches of examples, from a Grain pipeline: deterministic, resumable, sharded.

    examples (dicts of inputs/targets/weights)
      -> this process's share (every process_count-th, from process_index)
      -> shuffled, reshuffled every epoch, repeated forever (seeded by train.seed)
      -> packed best-fit into rows of seq_len (Grain's BestFitPackIterDataset: each row holds
         whole examples, with segment ids 1, 2, ... and positions restarting at 0 per example;
         0 marks padding)
      -> batches of this process's rows

The iterator's ``get_state()`` is a small JSON dict (where in the shuffled stream its current
packing round started); ``set_state`` puts a fresh iterator back there, so a resumed run sees
the batches the uninterrupted one would. The trainer saves it in every checkpoint through
Grain's Orbax handler (one file per process).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

FEATURES = ("inputs", "targets", "weights")
"The per-token arrays of an example; packing keeps them aligned."


def _shard(examples: Sequence[dict], process_index: int, process_count: int):
    import grain

    if process_count <= 0 or not 0 <= process_index < process_count:
        raise ValueError(f"process_index {process_index} is not in [0, {process_count})")
    if len(examples) < process_count:
        raise ValueError(f"{len(examples)} examples cannot be shared by {process_count} processes")
    return grain.MapDataset.source(list(examples))[process_index::process_count]


def model_batch(packed: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Grain's packed features -> the model's batch: ``tokens``, ``targets``, ``loss_mask``,
    ``segment_ids`` and ``positions``, each int32 [rows, seq_len]."""
    return {
        "tokens": packed["inputs"].astype(np.int32),
        "targets": packed["targets"].astype(np.int32),
        "loss_mask": packed["weights"].astype(np.int32),
        "segment_ids": packed["inputs_segment_ids"].astype(np.int32),
        "positions": packed["inputs_positions"].astype(np.int32),
    }


def packed_batches(
    examples: Sequence[dict],
    *,
    seq_len: int,
    batch_size: int,
    seed: int,
    packing_bins: int,
    process_index: int = 0,
    process_count: int = 1,
    shuffle: bool = True,
    repeat: bool = True,
):
    """A Grain ``IterDataset`` of this process's batches (dicts from ``model_batch``).

    ``batch_size`` is this process's rows. Without ``repeat`` the stream ends after one pass
    and the last batch may have fewer rows.
    """
    import grain
    from grain.experimental import BestFitPackIterDataset

    dataset = _shard(examples, process_index, process_count)
    if shuffle:
        dataset = dataset.shuffle(seed=seed)  # then repeat: a new order every epoch
    if repeat:
        dataset = dataset.repeat(None)
    # The examples are already in memory: read them in this thread (Grain's default read-ahead
    # threads cost more than they save here).
    examples_stream = dataset.to_iter_dataset(
        grain.ReadOptions(num_threads=0, prefetch_buffer_size=0)
    )
    packed = BestFitPackIterDataset(
        examples_stream,
        length_struct={k: seq_len for k in FEATURES},
        num_packing_bins=packing_bins,
        seed=seed,
        shuffle_bins=shuffle,
    )
    return packed.batch(batch_size).map(model_batch)


def pad_rows(batch: dict[str, np.ndarray], rows: int) -> dict[str, np.ndarray]:
    """``batch`` with all-padding rows (segment 0, no loss) appended up to ``rows``."""
    missing = rows - len(batch["tokens"])
    if missing <= 0:
        return batch
    return {
        k: np.concatenate([v, np.zeros((missing, *v.shape[1:]), v.dtype)]) for k, v in batch.items()
    }


def fixed_batches(
    examples: Sequence[dict],
    *,
    num_batches: int,
    seq_len: int,
    batch_size: int,
    packing_bins: int,
    process_index: int = 0,
    process_count: int = 1,
) -> list[dict[str, np.ndarray]]:
    """The first ``num_batches`` batches of one unshuffled pass: the same at every evaluation
    (the last one padded to ``batch_size`` rows)."""
    if num_batches <= 0 or not examples:
        return []
    stream = packed_batches(
        examples,
        seq_len=seq_len,
        batch_size=batch_size,
        seed=0,
        packing_bins=packing_bins,
        process_index=process_index,
        process_count=process_count,
        shuffle=False,
        repeat=False,
    )
    batches = []
    for batch in stream:
        batches.append(pad_rows(batch, batch_size))
        if len(batches) == num_batches:
            break
    return batches


def packing_efficiency(
    examples: Sequence[dict],
    *,
    seq_len: int,
    packing_bins: int,
    seed: int = 0,
    max_rows: int = 2048,
) -> float:
    """Fraction of the token slots that hold real tokens in the training stream's rows, over
    the first epoch's worth of tokens (at most ``max_rows`` rows: a sample on big sets)."""
    epoch_rows = min(-(-sum(len(e["inputs"]) for e in examples) // seq_len), max_rows)
    real = total = 0
    for batch in packed_batches(
        examples, seq_len=seq_len, batch_size=64, seed=seed, packing_bins=packing_bins
    ):
        real += int((batch["segment_ids"] > 0).sum())
        total += batch["segment_ids"].size
        if total >= epoch_rows * seq_len:
            break
    return real / max(total, 1)
