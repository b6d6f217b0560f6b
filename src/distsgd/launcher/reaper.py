"""A process group's reaper: ``python -m distsgd.launcher.reaper PGID [DIR]``, started by a
launcher, ends the group it was given (the group the launcher created, by its id) when the
launcher dies, however it dies (SIGKILL included), then removes DIR (the group's scratch
folder), and exits by itself once the group is gone.

The local launcher's tasks need none (each ties itself to the launcher, ``lifeline.py``); a
local Ray instance does, because Ray's agent processes outlive a killed driver.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import sys
import threading
import time

from distsgd.launcher.lifeline import PARENT_ENV, set_death_signal
from distsgd.util.signals import setter


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except (ProcessLookupError, PermissionError):  # PermissionError: not ours any more
        return False
    return True


def end_group(pgid: int, grace: float = 3.0, settle: float = 2.0) -> None:
    """SIGTERM to the group, then SIGKILL after ``grace`` seconds if any of it is left, again
    and again for up to ``settle`` seconds: a process that was forking when the first SIGKILL
    came leaves a child in the group that the signal did not reach."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and group_alive(pgid):
        time.sleep(0.1)
    deadline = time.monotonic() + settle
    while True:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, signal.SIGKILL)
        if not group_alive(pgid) or time.monotonic() > deadline:
            return
        time.sleep(0.1)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) not in (1, 2) or not args[0].isdigit():
        print("usage: python -m distsgd.launcher.reaper PGID [DIR]", file=sys.stderr)
        return 2
    pgid = int(args[0])
    scratch = args[1] if len(args) == 2 else None
    parent = int(os.environ.get(PARENT_ENV, os.getppid()))
    woken = threading.Event()
    signal.signal(signal.SIGTERM, setter(woken))
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the launcher's to handle
    set_death_signal()
    while group_alive(pgid):
        if woken.wait(0.5) or os.getppid() != parent:
            end_group(pgid)
            remove(scratch)
            return 0
    if os.getppid() != parent:  # the group ended by itself after its launcher died
        remove(scratch)
    return 0


def remove(scratch: str | None, tries: int = 5) -> None:
    """Remove the scratch folder; again if a process of the ending group still wrote into it
    while it was removed (an ``rmtree`` that ignores errors can leave the folder behind)."""
    if scratch is None:
        return
    for _ in range(tries):
        shutil.rmtree(scratch, ignore_errors=True)
        if not os.path.exists(scratch):
            return
        time.sleep(0.2)


if __name__ == "__main__":
    sys.exit(main())
