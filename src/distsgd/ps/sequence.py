"""Exactly-once pushes: push sequence numbers, and the shard's record of those it applied.

A worker numbers its pushes (``PushHeader.sequence``, see "Exactly once" in the .proto) from
its local step, so a restarted worker that trains a step again sends its push under the number
the first try had: :func:`push_sequence` is ``step << STEP_SHIFT`` for a step's first push (and
one more for each further push of the same step). Each shard keeps, per worker, the highest
sequence it applied (:class:`AppliedSequences`, part of its checkpoint and of its write-ahead
log's records); a push at or below it is a duplicate, answered accepted and not applied. A
restarted worker learns where its pushes stopped from ``InfoResponse.applied_sequence``
(:func:`steps_applied`).
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from typing import Any

STEP_SHIFT = 16
"""Low bits of a sequence that number the pushes within one step (a step's first push is
``step << STEP_SHIFT``); the step is ``sequence >> STEP_SHIFT``."""

MAX_SEQUENCE = (1 << 63) - 1
"""The largest sequence a shard records (fits a signed 64-bit write-ahead log field)."""


def push_sequence(step: int, last: int) -> int:
    """The sequence of a push made at ``step`` (steps done with it, 1 or more) by a worker whose
    previous push had sequence ``last`` (0: none): the step's first number, or one past ``last``
    when that is higher (a further push of the same step), so a worker's sequences increase."""
    return min(MAX_SEQUENCE, max(last + 1, step << STEP_SHIFT))


def steps_applied(sequence: int) -> int:
    """The steps a worker had done when it made the push of ``sequence`` (0: none applied)."""
    return sequence >> STEP_SHIFT


def is_duplicate(highest: Mapping[int, int], worker: int, sequence: int) -> bool:
    """Whether a push of ``worker`` under ``sequence`` was applied already, given the highest
    sequence applied per worker: never for sequence 0 (no id) or worker -1 (a tool)."""
    return sequence > 0 and worker >= 0 and sequence <= highest.get(worker, 0)


class AppliedSequences:
    """Per worker, the highest push sequence a shard applied. Thread-safe: an unlocked rule's
    pushes :meth:`claim` theirs concurrently (a worker sends one push to a shard at a time)."""

    def __init__(self, highest: Mapping[int, int] | None = None) -> None:
        self._highest: dict[int, int] = dict(highest or {})
        self._lock = threading.Lock()

    def duplicate(self, worker: int, sequence: int) -> bool:
        """Whether ``sequence`` of ``worker`` was applied already (see :func:`is_duplicate`)."""
        with self._lock:
            return is_duplicate(self._highest, worker, sequence)

    def record(self, worker: int, sequence: int) -> None:
        """``worker``'s push of ``sequence`` was applied (nothing for sequence 0 or worker -1)."""
        if sequence > 0 and worker >= 0:
            with self._lock:
                if sequence > self._highest.get(worker, 0):
                    self._highest[worker] = sequence

    def claim(self, worker: int, sequence: int) -> bool:
        """Record ``sequence`` as applied unless it was: False for a duplicate. For a rule that
        cannot refuse a push (it is applied right after), so the check and the record are one
        step that a concurrent resend of the same push cannot pass in between."""
        with self._lock:
            if is_duplicate(self._highest, worker, sequence):
                return False
            if sequence > 0 and worker >= 0:
                self._highest[worker] = sequence
            return True

    def unclaim(self, worker: int, sequence: int, before: int) -> None:
        """Take back a :meth:`claim` of ``sequence`` whose push was not applied after all (its
        write-ahead log was down): ``before`` is the highest applied until then."""
        with self._lock:
            if sequence > 0 and worker >= 0 and self._highest.get(worker) == sequence:
                self._highest[worker] = before

    def highest(self, worker: int) -> int:
        """The highest sequence applied from ``worker`` (0: none)."""
        with self._lock:
            return self._highest.get(worker, 0)

    def state(self) -> dict[str, int]:
        """For the shard file's JSON header: worker (as text) -> highest sequence."""
        with self._lock:
            return {str(w): s for w, s in sorted(self._highest.items())}

    @classmethod
    def from_state(cls, state: Any) -> AppliedSequences:
        """Read back :meth:`state` (absent: none); ValueError for anything else than worker
        indexes (0 or more) mapped to sequences in 1..:data:`MAX_SEQUENCE`."""
        if state is None:
            return cls()
        if not isinstance(state, dict):
            raise ValueError(f"applied_sequences is {type(state).__name__}, not an object")
        highest: dict[int, int] = {}
        for key, value in state.items():
            if not (isinstance(key, str) and key.isdigit()):
                raise ValueError(f"applied_sequences has a worker {key!r:.40}")
            if type(value) is not int or not 0 < value <= MAX_SEQUENCE:
                raise ValueError(f"applied_sequences[{key}] is {value!r:.40}")
            highest[int(key)] = value
        return cls(highest)
