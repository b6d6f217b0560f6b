"""One set of emulated hosts with a management link per machine: the management address
(198.18.0.253) and the hosts' subnet can be on one link only. The process that makes them
holds an exclusive ``flock`` on a file named for the subnet as long as they are up; a second
one refuses in one line naming the first (its PID and what it wrote). The kernel drops the lock
when its holder ends, SIGKILL included.

The file lives in a folder of the current user's own, ``distsgd-UID`` (0700): for root in
``/run``, which only root may write; else in ``/run/lock`` (or the temporary folder), which
every local user may write (sticky), so nothing is opened there but that folder, and only once
it is checked to be a real folder of ours that no one else may write. Inside it the file is
opened without following a link and without truncating, and checked to be a plain file of ours
with one name, before its holder text is replaced: a link or folder planted by another user is
refused in one line naming it and the fix, never written through, its text never quoted.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import stat
import tempfile
import time
from pathlib import Path

__all__ = ["HostsLock", "lock_folder", "lock_path"]


def _base() -> Path:
    for folder in ("/run", "/run/lock") if os.geteuid() == 0 else ("/run/lock",):
        if os.path.isdir(folder) and os.access(folder, os.W_OK):
            return Path(folder)
    return Path(tempfile.gettempdir())


def lock_folder(base: Path | None = None) -> Path:
    """The current user's own folder of hosts' locks in ``base`` (default: for root ``/run``,
    which no other user may write; else ``/run/lock``, else the temporary folder)."""
    return (base or _base()) / f"distsgd-{os.geteuid()}"


def lock_path(subnet: str, base: Path | None = None) -> Path:
    """The lock file of the hosts on ``subnet`` (``198.18.0.0/24``)."""
    return lock_folder(base) / f"hosts-{subnet.replace('/', '-')}.lock"


def _refuse(path: Path, why: str) -> ValueError:
    return ValueError(
        f"the emulated hosts' lock {path} is not safe to use: {why}; another user may have "
        f"made it: check it and remove it (as root: rm -r {path})"
    )


def _own_folder(folder: Path) -> None:
    """Make ``folder`` (0700) or check that it is ours: a real folder, no one else may write."""
    with contextlib.suppress(FileExistsError):
        os.mkdir(folder, 0o700)
    info = os.lstat(folder)
    if not stat.S_ISDIR(info.st_mode):
        raise _refuse(folder, "it is not a folder (a link?)")
    if info.st_uid != os.geteuid():
        raise _refuse(folder, f"it belongs to uid {info.st_uid}, not to this user")
    if info.st_mode & 0o022:
        raise _refuse(folder, f"others may write it (mode {stat.S_IMODE(info.st_mode):o})")


def _open_own(path: Path) -> int:
    """A descriptor of the lock file ``path``, made 0600 if absent; never through a link, never
    truncated on open; ValueError if it is not a plain file of ours with one name."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except OSError as e:
        raise _refuse(path, f"{e.strerror or e}") from None
    info = os.fstat(fd)
    why = None
    if not stat.S_ISREG(info.st_mode):
        why = "it is not a plain file"
    elif info.st_uid != os.geteuid():
        why = f"it belongs to uid {info.st_uid}, not to this user"
    elif info.st_nlink != 1:
        why = f"it has {info.st_nlink} names (a hard link to another file?)"
    if why is not None:
        os.close(fd)
        raise _refuse(path, why)
    return fd


class HostsLock:
    """The lock of the hosts on ``subnet``: :meth:`acquire` or ValueError; :meth:`release`.
    ``base``: the folder that holds the users' lock folders (tests; default ``/run/lock``)."""

    def __init__(self, subnet: str, *, what: str, base: Path | None = None) -> None:
        self.path = lock_path(subnet, base)
        """The lock file."""
        self.what = what
        """What holds it, as a second one is told (``emulated hosts ds1a2b3c``)."""
        self._fd: int | None = None

    def acquire(self) -> None:
        """Take the lock, or ValueError in one line naming its holder (or what is unsafe)."""
        _own_folder(self.path.parent)
        fd = _open_own(self.path)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            text = os.pread(fd, 200, 0).decode("utf-8", "replace")
            os.close(fd)
            holder = " ".join(text.split()) or "another process"
            raise ValueError(
                f"the emulated hosts' network is in use by {holder} (lock {self.path}); wait "
                "for that run or `distsgd hosts up` to end: one at a time on a machine"
            ) from None
        stamp = time.strftime("%Y-%m-%d %H:%M:%S")
        os.ftruncate(fd, 0)  # our own plain file (checked above), held
        os.pwrite(fd, f"pid {os.getpid()} ({self.what}, since {stamp})\n".encode(), 0)
        self._fd = fd

    def release(self) -> None:
        """Let go of the lock (no effect where not held)."""
        if self._fd is not None:
            with contextlib.suppress(OSError):
                os.ftruncate(self._fd, 0)
            os.close(self._fd)  # the flock goes with the last descriptor
            self._fd = None
