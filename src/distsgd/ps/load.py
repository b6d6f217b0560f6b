"""What a shard's work has been: pushes and pulls, their bytes, and the seconds its pushes kept
it busy (the check, the write-ahead log and the update). Read by ``Info``; the launcher turns
the counters into rates over time (``shard_load`` events in metrics and TensorBoard), the
measure of which server is the bottleneck that ``distsgd plan`` predicts."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field


@dataclass
class ShardLoad:
    """Counters since the server started; safe to update from its handler threads."""

    pushes: int = 0
    push_bytes: int = 0
    pulls: int = 0
    pull_bytes: int = 0
    busy_seconds: float = 0.0
    """Seconds spent inside :meth:`Shard.push` (overlapping where an unlocked rule lets
    pushes run side by side: then more than the wall time can pass)."""
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def pushed(self, nbytes: int, started: float) -> None:
        """A push of ``nbytes`` handled since ``started`` (``time.perf_counter()``)."""
        seconds = time.perf_counter() - started
        with self._lock:
            self.pushes += 1
            self.push_bytes += nbytes
            self.busy_seconds += seconds

    def pulled(self, nbytes: int) -> None:
        with self._lock:
            self.pulls += 1
            self.pull_bytes += nbytes
