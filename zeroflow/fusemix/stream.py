"""Training batches of cached latent pairs, streamed to the devices ahead of the step.

Which rows form step ``s``'s batch is a pure function of ``(seed, s)``: epoch ``e`` is a
permutation of the training rows drawn from ``(seed, e)``, cut into whole batches (the last
partial one dropped), so a run resumed at any step, mid-epoch included, sees exactly the
batches the uninterrupted run saw, with no loader state to save.

``device_batches`` runs a thread that gathers each batch's rows from the memmaps and starts
its host-to-device copy (``jax.device_put`` into the batch sharding) up to ``prefetch`` steps
ahead, so the copy of step ``s + 1`` overlaps the compute of step ``s``.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator, Mapping

import jax
import numpy as np


def batch_rows(train_rows: np.ndarray, batch_size: int, seed: int, step: int) -> np.ndarray:
    """The rows (indices into the latent files) of step ``step``'s batch (0-based)."""
    per_epoch = len(train_rows) // batch_size
    if per_epoch == 0:
        raise ValueError(
            f"train.batch_size={batch_size} is larger than the {len(train_rows)} training pairs"
        )
    epoch, index = divmod(step, per_epoch)
    order = np.random.default_rng([seed, epoch]).permutation(len(train_rows))
    return np.sort(train_rows[order[index * batch_size : (index + 1) * batch_size]])


def host_batch(latents: Mapping[str, np.ndarray], rows: np.ndarray) -> dict[str, np.ndarray]:
    """``{modality: float32 [batch, dim]}`` read from the memmaps (rows sorted: forward reads)."""
    return {name: np.asarray(array[rows], np.float32) for name, array in latents.items()}


def device_batches(
    latents: Mapping[str, np.ndarray],
    train_rows: np.ndarray,
    batch_size: int,
    seed: int,
    start: int,
    stop: int,
    sharding: jax.sharding.Sharding,
    prefetch: int = 2,
) -> Iterator[dict[str, jax.Array]]:
    """Device batches of steps ``start .. stop - 1``, each already copied (or copying) while
    the step before it runs."""
    ready: queue.Queue = queue.Queue(maxsize=max(prefetch, 1))
    done = threading.Event()

    def produce():
        try:
            for step in range(start, stop):
                if done.is_set():
                    return
                rows = batch_rows(train_rows, batch_size, seed, step)
                ready.put(jax.device_put(host_batch(latents, rows), sharding))
        except BaseException as e:
            ready.put(e)

    thread = threading.Thread(target=produce, name="fusemix-prefetch", daemon=True)
    thread.start()
    try:
        for _ in range(start, stop):
            item = ready.get()
            if isinstance(item, BaseException):
                raise item
            yield item
    finally:
        done.set()
        while thread.is_alive():  # unblock a producer waiting on a full queue
            try:
                ready.get_nowait()
            except queue.Empty:
                thread.join(timeout=0.05)
