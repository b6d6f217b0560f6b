"""A signal handler that sets a :class:`threading.Event` without deadlocking.

Python runs a signal handler in the main thread between two bytecodes, which may be while that
thread is inside ``event.wait()`` holding the event's internal (non-reentrant) lock; an
``event.set()`` in the handler then waits for that lock forever. It was seen: a reaper
deadlocked so, and the local Ray instance it should have ended outlived its launcher. The
handler made here hands ``set`` to a short-lived thread instead, which takes the lock as soon
as the main thread lets go of it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from types import FrameType


def setter(
    event: threading.Event, before: Callable[[], None] | None = None
) -> Callable[[int, FrameType | None], None]:
    """A signal handler that sets ``event`` (after calling ``before``, if given)."""

    def handle(signum: int, frame: FrameType | None) -> None:
        if before is not None:
            before()
        threading.Thread(target=event.set, name="signal-set", daemon=True).start()

    return handle
