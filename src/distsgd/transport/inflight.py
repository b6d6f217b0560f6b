"""The calls a process has in flight to parameter servers, for ``distsgd doctor``.

:class:`~distsgd.transport.client.ShardClient` enters each call (its retries included) here
and leaves it when the call returns or fails: a dict insert and a delete, nothing more, so
that a process asked by the doctor (:mod:`distsgd.util.probe`) can say which server it waits
on, since when, after how many attempts and with what error. The seconds of its pulls and
pushes are summed per server on the way out (:meth:`InFlight.spent`): a worker's metrics say
which server its exchanges wait on (the straggler detector, :mod:`distsgd.control.stragglers`).
"""

from __future__ import annotations

import contextlib
import itertools
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

TIMED_METHODS = frozenset({"Pull", "Push"})
"""The calls whose seconds :meth:`InFlight.spent` sums."""


@dataclass
class Call:
    """One call in flight (a record the calling thread updates as it retries)."""

    address: str
    method: str
    began: float
    """``time.monotonic()`` when it was entered."""
    thread: str
    attempts: int = 1
    last_error: str = ""
    """The code of its last failed attempt (``UNAVAILABLE`` ...), '' while none failed."""

    def retried(self, error: str) -> None:
        """An attempt failed with ``error`` (a status code's name); the call tries again."""
        self.attempts += 1
        self.last_error = error


class InFlight:
    """The process's calls in flight (thread-safe: each call is its own key)."""

    def __init__(self) -> None:
        self._calls: dict[int, Call] = {}
        self._ids = itertools.count()
        self._spent: dict[tuple[str, str], float] = {}
        self._spent_lock = threading.Lock()

    @contextlib.contextmanager
    def track(self, address: str, method: str) -> Iterator[Call]:
        """Within: a call of ``method`` to ``address`` is in flight (its record yielded, for
        the caller's retries to count)."""
        key = next(self._ids)
        call = Call(address, method, time.monotonic(), threading.current_thread().name)
        self._calls[key] = call
        try:
            yield call
        finally:
            del self._calls[key]
            if method in TIMED_METHODS:
                seconds = time.monotonic() - call.began
                with self._spent_lock:
                    spent = self._spent.get((address, method), 0.0) + seconds
                    self._spent[(address, method)] = spent

    def spent(self, address: str, method: str) -> float:
        """Seconds this process's calls of ``method`` (Pull or Push) to ``address`` took so far
        (retries and each call's wait for its server included; calls on other threads too)."""
        return self._spent.get((address, method), 0.0)

    def snapshot(self) -> list[dict[str, Any]]:
        """The calls in flight now, longest first."""
        now = time.monotonic()
        calls = sorted(list(self._calls.values()), key=lambda c: c.began)
        return [
            {
                "address": c.address,
                "method": c.method,
                "age_s": round(now - c.began, 3),
                "thread": c.thread,
                "attempts": c.attempts,
                "last_error": c.last_error,
            }
            for c in calls
        ]


CALLS = InFlight()
"""This process's calls in flight."""
