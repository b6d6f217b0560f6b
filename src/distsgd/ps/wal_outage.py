"""A write-ahead log that cannot be written (a full disk): its outage, as :mod:`distsgd.ps.wal`
keeps it (:class:`Outage`), and what a push that meets it sees (:class:`LogDown`,
:class:`NotLogged`).

While the log is down no push is applied: each waits, outside the shard's locks, for the log
to come back, at most :data:`PUSH_WAIT_SECONDS`, and is then answered UNAVAILABLE
``not-logged`` (nothing of it applied; the client sends it again). So the server acknowledges
no push that its log does not hold.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from distsgd.ps.replica import ReplicaError

log = logging.getLogger("distsgd.ps.wal")

T = TypeVar("T")

PUSH_WAIT_SECONDS = 20.0
"""How long a push waits for a log that is down before it is answered ``not-logged`` (below a
client's 30 s deadline, so that the client hears why and sends it again)."""
REVIVE_SECONDS = 1.0
"""How often a down log tries to start again (a snapshot and a new generation)."""


class LogDown(Exception):
    """A push met a log that cannot be written: nothing of it was applied; wait for the log
    (:meth:`Outage.wait`) and try again."""

    def __init__(self, outage: Outage) -> None:
        super().__init__(f"write-ahead log {outage.folder} is down")
        self.outage = outage


def until_logged(push: Callable[[], T]) -> T:
    """``push()`` (a shard's push, which raises :class:`LogDown` where the log is down before
    anything is applied), again whenever the log comes back, until it is logged; past
    :data:`PUSH_WAIT_SECONDS` of waiting :class:`NotLogged`."""
    since: float | None = None
    while True:
        try:
            return push()
        except LogDown as down:
            since = down.outage.wait(since)


class NotLogged(Exception):
    """A push waited :data:`PUSH_WAIT_SECONDS` for a down log in vain (or the server stopped):
    nothing of it was applied; the service answers UNAVAILABLE ``not-logged``."""


@dataclass(frozen=True, kw_only=True)
class WalState:
    """What a log reports to ``Info`` (``WalStatus`` in the .proto)."""

    folder: str
    generation: int
    down: bool
    outages: int
    down_seconds: float
    error: str
    refused_pushes: int
    unlogged: int
    replica: bool


class Outage:
    """Whether a log is down, since when, how often it was and for how long, and why; read and
    changed under its log's lock (:meth:`wait` outside it)."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.since: float | None = None
        """``time.monotonic()`` when the current outage began (None: the log is up)."""
        self.count = 0
        self.seconds = 0.0
        """Seconds of the outages that ended."""
        self.error = ""
        self.replica = False
        """Whether the last failed write was the replica's (not this host's disk)."""
        self.refused_pushes = 0
        self.unlogged = 0
        """Changes other than pushes (members, leaves, timeouts) applied while down."""
        self.next_try = 0.0
        self._up = threading.Event()
        self._up.set()
        self._count = threading.Lock()
        self.stopped = False

    @property
    def down(self) -> bool:
        return self.since is not None

    def began(self, exc: OSError) -> None:
        """A write failed (``exc``): an outage begins, unless one is on already."""
        self.error = exc.strerror or str(exc)
        self.replica = isinstance(exc, ReplicaError)
        if self.since is not None:
            return
        self.since = time.monotonic()
        self.next_try = self.since + REVIVE_SECONDS
        self.count += 1
        self._up.clear()
        log.error(
            "write-ahead log %s: cannot write (%s); pushes wait, unapplied, until it can be "
            "written again (a new generation from a snapshot): %s",
            self.folder,
            self.error,
            "its replica is started again" if self.replica else "free space on its disk",
        )

    def ended(self) -> None:
        """The log is written again: the waiting pushes go on."""
        if self.since is not None:
            self.seconds += time.monotonic() - self.since
            self.since = None
        self._up.set()

    def stop(self) -> None:
        """The server stops: waiting pushes give up (:class:`NotLogged`)."""
        self.stopped = True
        self._up.set()

    def due(self) -> bool:
        """Whether a down log should try to come back now (every :data:`REVIVE_SECONDS`)."""
        now = time.monotonic()
        if self.since is None or now < self.next_try:
            return False
        self.next_try = now + REVIVE_SECONDS
        return True

    def wait(self, since: float | None) -> float:
        """A push met the log down (first at ``since``, None: now): wait until it is up, at
        most :data:`PUSH_WAIT_SECONDS` from ``since``; returns ``since``. :class:`NotLogged`
        when the wait is over or the server stops."""
        since = time.monotonic() if since is None else since
        left = since + PUSH_WAIT_SECONDS - time.monotonic()
        if left > 0 and self._up.wait(left) and not self.stopped:
            return since
        with self._count:
            self.refused_pushes += 1
        raise NotLogged(
            f"the write-ahead log in {self.folder} cannot be written ({self.error or 'stopped'}); "
            "nothing of this push was applied: send it again"
        )

    def state(self, generation: int) -> WalState:
        """The log's state (call under its lock)."""
        now = time.monotonic()
        return WalState(
            folder=str(self.folder),
            generation=generation,
            down=self.since is not None,
            outages=self.count,
            down_seconds=self.seconds + (0.0 if self.since is None else now - self.since),
            error=self.error,
            refused_pushes=self.refused_pushes,
            unlogged=self.unlogged,
            replica=self.replica,
        )
