"""The launcher says what it waits for: a wait of its start-up that lasts more than a few
seconds (the fork server importing torch, the launcher itself importing it to host the
all-reduce rendezvous, a server not yet listening) is named on the console while it lasts,
rather than leaving the console silent (a loaded machine took 70 s so, and the user saw
nothing).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

SAY_AFTER_SECONDS = 3.0
"""How long a wait goes unsaid: a quick one is not worth a line."""
SAY_EVERY_SECONDS = 15.0
"""How often a wait that goes on is said again, with the seconds it has lasted."""


@contextmanager
def said_while_slow(
    note: Callable[[str], None] | None,
    what: str,
    *,
    after: float = SAY_AFTER_SECONDS,
    every: float = SAY_EVERY_SECONDS,
) -> Iterator[None]:
    """Run the block; once it has lasted ``after`` seconds, ``note`` ``[distsgd] waiting for
    WHAT (N s)``, again every ``every`` seconds while it lasts (nothing without ``note``)."""
    if note is None:
        yield
        return
    done = threading.Event()
    started = time.monotonic()

    def watch() -> None:
        wait = after
        while not done.wait(wait):
            note(f"[distsgd] waiting for {what} ({time.monotonic() - started:.0f} s)")
            wait = every

    watcher = threading.Thread(target=watch, name="said-while-slow", daemon=True)
    watcher.start()
    try:
        yield
    finally:
        done.set()
        watcher.join(timeout=1.0)


class Reminder:
    """A wait the supervising loop sees a little at a time (the workers' first metrics line):
    :meth:`check` it at each poll with what is still waited for; it is said once it has lasted
    ``after`` seconds, then every ``every`` seconds, until :meth:`check` is given None."""

    def __init__(
        self,
        note: Callable[[str], None],
        *,
        after: float = SAY_AFTER_SECONDS,
        every: float = SAY_EVERY_SECONDS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.note = note
        self.after = after
        self.every = every
        self.clock = clock
        self._since: float | None = None
        self._next = 0.0

    def check(self, what: str | None) -> None:
        """``what`` is still waited for (None: nothing is, and a later wait starts anew)."""
        now = self.clock()
        if what is None:
            self._since = None
            return
        if self._since is None:
            self._since, self._next = now, now + self.after
        if now >= self._next:
            self.note(f"[distsgd] waiting for {what} ({now - self._since:.0f} s)")
            self._next = now + self.every
