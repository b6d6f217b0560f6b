"""A shared/exclusive gate: an unlocked rule's pushes hold it shared while they log and apply;
whatever must see no push half-applied (a write-ahead log's compaction, a piece's export) holds
it exclusive."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager


class Gate:
    """Shared/exclusive gate for an unlocked rule: pushes append and apply under ``shared``;
    a compaction or an export copies the state under ``exclusive`` (no push half-applied).
    Waiting writers block new readers, so a writer never starves."""

    def __init__(self) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._readers = 0
        self._writer = False

    @contextmanager
    def shared(self) -> Iterator[None]:
        with self._cond:
            while self._writer:
                self._cond.wait()
            self._readers += 1
        try:
            yield
        finally:
            with self._cond:
                self._readers -= 1
                if not self._readers:
                    self._cond.notify_all()

    @contextmanager
    def exclusive(self) -> Iterator[None]:
        with self._cond:
            while self._writer:
                self._cond.wait()
            self._writer = True
            while self._readers:
                self._cond.wait()
        try:
            yield
        finally:
            with self._cond:
                self._writer = False
                self._cond.notify_all()
