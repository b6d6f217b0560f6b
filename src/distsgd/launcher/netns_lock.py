"""One set of emulated hosts with a management link per machine: the management address
(198.18.0.253) and the hosts' subnet can be on one link only. The process that makes them
holds an exclusive ``flock`` on a file named for the subnet (in ``/run/lock``, else the
temporary folder) as long as they are up; a second one refuses in one line naming the first
(its PID and what it wrote). The kernel drops the lock when its holder ends, SIGKILL included.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import tempfile
import time
from pathlib import Path
from typing import IO

__all__ = ["HostsLock", "lock_path"]


def lock_path(subnet: str) -> Path:
    """The lock file of the hosts on ``subnet`` (``198.18.0.0/24``)."""
    folder = Path("/run/lock")
    if not (folder.is_dir() and os.access(folder, os.W_OK)):
        folder = Path(tempfile.gettempdir())
    return folder / f"distsgd-hosts-{subnet.replace('/', '-')}.lock"


class HostsLock:
    """The lock of the hosts on ``subnet``: :meth:`acquire` or ValueError; :meth:`release`."""

    def __init__(self, subnet: str, *, what: str) -> None:
        self.path = lock_path(subnet)
        """The lock file."""
        self.what = what
        """What holds it, as a second one is told (``emulated hosts ds1a2b3c``)."""
        self._file: IO[str] | None = None

    def acquire(self) -> None:
        """Take the lock, or ValueError in one line naming its holder."""
        handle = self.path.open("a+")
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.seek(0)
            holder = handle.read().strip() or "another process"
            handle.close()
            raise ValueError(
                f"the emulated hosts' network is in use by {holder} (lock {self.path}); wait "
                "for that run or `distsgd hosts up` to end: one at a time on a machine"
            ) from None
        handle.seek(0)
        handle.truncate()
        stamp = time.strftime("%Y-%m-%d %H:%M:%S")
        handle.write(f"pid {os.getpid()} ({self.what}, since {stamp})\n")
        handle.flush()
        self._file = handle

    def release(self) -> None:
        """Let go of the lock (no effect where not held)."""
        if self._file is not None:
            with contextlib.suppress(OSError):
                self._file.seek(0)
                self._file.truncate()
            self._file.close()  # the flock goes with the last descriptor
            self._file = None
