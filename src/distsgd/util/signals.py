"""A signal handler that sets a :class:`threading.Event` without deadlocking.

Python runs a signal handler in the main thread between two bytecodes, which may be while that
thread is inside ``event.wait()`` holding the event's internal (non-reentrant) lock; an
``event.set()`` in the handler then waits for that lock forever. It was seen: a reaper
deadlocked so, and the local Ray instance it should have ended outlived its launcher. The
handler made here hands ``set`` to a short-lived thread instead, which takes the lock as soon
as the main thread lets go of it. :func:`stopping` installs it for SIGINT and SIGTERM around a
command's body, and puts the handlers before it back on the way out.
"""

from __future__ import annotations

import contextlib
import functools
import signal
import threading
from collections.abc import Callable, Iterator
from types import FrameType
from typing import Any


def setter(
    event: threading.Event, before: Callable[[], None] | None = None
) -> Callable[[int, FrameType | None], None]:
    """A signal handler that sets ``event`` (after calling ``before``, if given)."""

    def handle(signum: int, frame: FrameType | None) -> None:
        if before is not None:
            before()
        threading.Thread(target=event.set, name="signal-set", daemon=True).start()

    return handle


@contextlib.contextmanager
def stopping(event: threading.Event, caught: list[int] | None = None) -> Iterator[None]:
    """Within: SIGINT and SIGTERM set ``event`` (each one caught appended to ``caught``, first
    first); on the way out the handlers before are back. Off the main thread (where Python
    cannot install handlers) nothing is installed."""
    previous: dict[signal.Signals, Any] = {}
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGINT, signal.SIGTERM):
            before = None if caught is None else functools.partial(caught.append, sig)
            previous[sig] = signal.signal(sig, setter(event, before=before))
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
