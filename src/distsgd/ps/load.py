"""What a shard's work has been: pushes and pulls, their bytes, and the seconds its pushes kept
it busy (the check, the write-ahead log and the update). Read by ``Info``; the launcher turns
the counters into rates over time (``shard_load`` events in metrics and TensorBoard), the
measure of which server is the bottleneck that ``distsgd plan`` predicts."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field


@dataclass
class PieceCounts:
    """What one piece brought to its shard: its bytes in pushes and pulls, and the pushes of it
    that were applied. Moves with the piece (``--rebalance``), so the sum over the shards of a
    piece's ``applies`` counts every update it ever took."""

    push_bytes: int = 0
    pull_bytes: int = 0
    applies: int = 0


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
    pull_busy_seconds: float = 0.0
    """Seconds spent answering pulls before their bytes go out (the wait for a version
    excluded): unlike :attr:`busy_seconds`, never a wait for the write-ahead log's replica."""
    pieces: dict[str, PieceCounts] = field(default_factory=dict)
    """Per piece held now, by key (read under :meth:`piece_counts`)."""
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def pushed(self, nbytes: int, started: float) -> None:
        """A push of ``nbytes`` handled since ``started`` (``time.perf_counter()``)."""
        seconds = time.perf_counter() - started
        with self._lock:
            self.pushes += 1
            self.push_bytes += nbytes
            self.busy_seconds += seconds

    def stalled(self, seconds: float) -> None:
        """An injected delay of a push of ``seconds`` (a slow server's test): busy time."""
        with self._lock:
            self.busy_seconds += seconds

    def reached(self, nbytes: Mapping[str, int], *, applied: bool) -> None:
        """A push of these pieces' bytes reached the rule (``applied``: the rule took it).
        Called where the update is applied, under the lock a move's export takes, so a piece's
        counters and its values travel together: no update is counted on a shard it left."""
        with self._lock:
            for key, n in nbytes.items():
                counts = self.pieces.setdefault(key, PieceCounts())
                counts.push_bytes += n
                counts.applies += applied

    def pulled(self, nbytes: Mapping[str, int], busy: float = 0.0) -> None:
        """A pull of these pieces' bytes (as sent), ``busy`` seconds answered."""
        with self._lock:
            self.pulls += 1
            self.pull_busy_seconds += max(0.0, busy)
            self.pull_bytes += sum(nbytes.values())
            for key, n in nbytes.items():
                self.pieces.setdefault(key, PieceCounts()).pull_bytes += n

    def piece_counts(self, keys: Iterable[str]) -> dict[str, PieceCounts]:
        """Copies of these pieces' counters (zero for a piece not pushed or pulled yet)."""
        with self._lock:
            return {k: PieceCounts(**vars(self.pieces.get(k, PieceCounts()))) for k in keys}

    def take(self, keys: Iterable[str]) -> dict[str, PieceCounts]:
        """Remove these pieces' counters and return them (the pieces left this shard)."""
        with self._lock:
            return {k: self.pieces.pop(k, PieceCounts()) for k in keys}

    def give(self, counts: Mapping[str, PieceCounts]) -> None:
        """Take over pieces' counters (the pieces came to this shard)."""
        with self._lock:
            self.pieces.update({k: PieceCounts(**vars(c)) for k, c in counts.items()})
