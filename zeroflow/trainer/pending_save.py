"""A checkpoint being finished off the training thread: Orbax writing the files, then the digests.

``RunCheckpoints.save`` returns once the state is copied to host memory (Orbax's async
checkpointer); a ``PendingSave`` thread then waits for the files, hashes them into the
manifest and applies the retention rules, while training goes on. One save at a time: the next
save, a restore, a rollback, listing the steps and closing all wait for it first
(``RunCheckpoints.finish``), so no step is ever read, moved or counted half-written.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable


class PendingSave:
    """``work()`` running in a thread for checkpoint ``step`` (``nbytes``: the state's size, for
    a message should the disk fill)."""

    def __init__(self, step: int, nbytes: int, work: Callable[[], None]):
        self.step, self.nbytes = step, nbytes
        self.error: BaseException | None = None
        self.started = time.perf_counter()
        self._thread = threading.Thread(
            target=self._run, args=(work,), name=f"zeroflow-save-{step}", daemon=False
        )
        self._thread.start()

    def _run(self, work: Callable[[], None]) -> None:
        try:
            work()
        except BaseException as e:  # handed to the training thread by ``wait``
            self.error = e

    def wait(self) -> float:
        """Seconds the caller waited for the save to finish (its error is in ``self.error``)."""
        start = time.perf_counter()
        self._thread.join()
        return time.perf_counter() - start
