"""The files of a write-ahead log folder (:mod:`distsgd.ps.wal`): the folder itself, its
generations' snapshots and log files, and how they are written (in place, no fsync)."""

from __future__ import annotations

import os
import re
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import BinaryIO

SLOTS = 2
"""Log files a folder cycles through (generation G writes ``log-{G % SLOTS}.wal``)."""

SNAPSHOT = re.compile(r"snapshot-(\d{8})\.npz")
_IOV_MAX = 512


def make_private_dir(folder: Path) -> None:
    """Create ``folder``, and each missing parent, readable by its owner only (0700)."""
    missing = [p for p in (folder, *folder.parents) if not p.exists()]
    for path in reversed(missing):
        path.mkdir(mode=0o700, exist_ok=True)
    os.chmod(folder, 0o700)


def generations(folder: Path, pattern: re.Pattern[str]) -> list[int]:
    if not folder.is_dir():
        return []
    found = (pattern.fullmatch(p.name) for p in folder.iterdir())
    return sorted(int(m.group(1)) for m in found if m is not None)


def next_generation(folder: Path) -> int:
    """The generation a new log in ``folder`` takes: past every snapshot there."""
    return 1 + max([-1, *generations(Path(folder), SNAPSHOT)])


def log_path(folder: Path, generation: int) -> Path:
    return folder / f"log-{generation % SLOTS}.wal"


def has_state(folder: Path) -> bool:
    """Whether ``folder`` holds a snapshot to recover from (readable or not)."""
    return bool(generations(Path(folder), SNAPSHOT))


def open_log(folder: Path, generation: int, *, truncate: bool = False, keep: bool = True) -> int:
    """The log file of ``generation`` (created 0600), written in place: no O_APPEND."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC | (os.O_TRUNC if truncate else 0)
    fd = os.open(log_path(folder, generation), flags, 0o600)
    if not keep:
        os.close(fd)
    return fd


def pwrite_all(fd: int, parts: list[memoryview], offset: int) -> None:
    """``os.pwritev`` of byte views at ``offset`` until every byte is written (a short write,
    or more than the system's limit of views, resumes)."""
    if len(parts) <= _IOV_MAX and os.pwritev(fd, parts, offset) == sum(p.nbytes for p in parts):
        return  # the usual case: one call
    write_all(lambda views, done: os.pwritev(fd, views, offset + done), parts)


def write_all(write: Callable[[list[memoryview], int], int], parts: Sequence[memoryview]) -> None:
    """Every byte of ``parts`` through ``write(views, done)`` (a ``pwritev`` or ``sendmsg`` of
    at most the system's limit of views, ``done`` bytes written before it; it returns how many
    it wrote), resumed after a short write."""
    views = [v for v in parts if v.nbytes]
    done = 0
    while views:
        written = write(views[:_IOV_MAX], done)
        done += written
        while views and written >= views[0].nbytes:
            written -= views[0].nbytes
            views.pop(0)
        if written:
            views[0] = views[0][written:]


def write_snapshot(path: Path, data: bytes | Callable[[BinaryIO], object]) -> None:
    """Write ``data`` (bytes, or a function that writes into the file it is given: a
    snapshot is never whole in memory twice) to a private temporary file beside ``path`` and
    rename it over ``path``: atomic, and not fsynced (the log covers a killed process, whose
    writes the page cache keeps; a flush per generation cost more than the log's writes on
    this machine)."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            if callable(data):
                data(f)
            else:
                f.write(data)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def remove_before(folder: Path, generation: int) -> None:
    """Remove the snapshots of generations below ``generation``."""
    for old in generations(folder, SNAPSHOT):
        if old < generation:
            (folder / f"snapshot-{old:08d}.npz").unlink(missing_ok=True)
