"""Shared-memory segments: tensor bytes between processes of one host without a socket.

A parameter server creates one segment per attached worker (see ``Attach`` in
``transport/proto/distsgd.proto``): a file under ``/dev/shm`` made with ``O_EXCL`` and mode
0600 (readable by the server's user only), its space reserved up front with
``posix_fallocate`` (a full ``/dev/shm`` fails here, with ENOSPC, instead of killing a process
with SIGBUS at its first write), and a random nonce in its first 16 bytes. The worker maps it
by name, reads the nonce back to the server, and the server then unlinks the name: from then on
the memory has no name, and the kernel frees it when the last process mapping it exits, however
it exits (SIGKILL included). A segment whose name was never removed (a server killed between
creating it and the worker's confirmation) is removed by the launcher when the run ends, by
exact name: a server given a record file appends each name there before it creates the
segment (:func:`record_name`), and :func:`remove_leftovers` removes only the recorded names
that still exist under the run's prefix, as regular files of this user. Nothing else under
``/dev/shm`` is touched, whatever its name (a launcher running as root included).

Linux only (``/dev/shm``); elsewhere :func:`available` is False and tensors go over gRPC.
"""

from __future__ import annotations

import contextlib
import logging
import math
import mmap
import os
import re
import secrets
import stat
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np

from distsgd.util.atomic import open_private, private_dir

log = logging.getLogger(__name__)

SHM_DIR = Path("/dev/shm")
NONCE_BYTES = 16
HEADER_BYTES = 64
"""Bytes before the first tensor: the nonce, padded to a cache line."""
ALIGN = 64
"""Every tensor starts on a 64-byte boundary."""
NAME_PREFIX = "distsgd-"
NAME = re.compile(r"distsgd-[A-Za-z0-9_.-]{1,200}")
"""The names :func:`open_segment` accepts: a server can name only its own kind of file."""


class SegmentError(OSError):
    """A segment that cannot be created, opened or used; the message says why."""


def available() -> bool:
    """Whether this host has POSIX shared memory under ``/dev/shm``."""
    return SHM_DIR.is_dir() and os.access(SHM_DIR, os.W_OK)


def align(offset: int) -> int:
    """``offset`` rounded up to :data:`ALIGN`."""
    return (offset + ALIGN - 1) // ALIGN * ALIGN


def run_prefix(run_id: str) -> str:
    """The name prefix of a run's segments (letters, digits and '-' of the run id)."""
    safe = re.sub(r"[^A-Za-z0-9-]", "", run_id)[:32] or "norun"
    return f"{NAME_PREFIX}{safe}-"


class Segment:
    """One mapped segment; :meth:`array` gives numpy views of it."""

    def __init__(self, name: str, size: int, fd: int, *, owner: bool, mapped: bool = True) -> None:
        self.name = name
        self.size = size
        self.owner = owner
        self._linked = owner
        self._fd = -1
        self._map: mmap.mmap | None = None
        if not mapped:  # reached through its descriptor alone (read_into, write_at)
            self._fd = fd
            self._buffer = np.empty(0, np.uint8)
            return
        try:
            self._map = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)  # the mapping keeps the memory; no descriptor is left open
        self._buffer = np.frombuffer(self._map, dtype=np.uint8)

    @classmethod
    def create(
        cls, prefix: str, size: int, *, record: Path | None = None, mapped: bool = True
    ) -> Segment:
        """A new segment of ``size`` bytes named ``<prefix><random>``, with a fresh nonce; its
        name is appended to ``record`` first (:func:`record_name`). ``mapped=False`` (a
        server's): the creator keeps a descriptor, not a mapping, and reaches the bytes only
        through :meth:`read_into` and :meth:`write_at`, so the worker's areas never count in its
        own memory (each copy goes through the kernel, as fast as one through a mapping).

        :class:`SegmentError` when shared memory has no room (ENOSPC) or cannot be used, or the
        name cannot be recorded.
        """
        if not prefix.startswith(NAME_PREFIX):
            raise ValueError(f"segment prefix must start with {NAME_PREFIX!r}, got {prefix!r}")
        size = max(size, HEADER_BYTES)
        name = f"{prefix}{secrets.token_hex(8)}"
        if record is not None:
            record_name(record, name)
        path = SHM_DIR / name
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        except OSError as exc:
            raise SegmentError(exc.errno, f"cannot create {path}: {exc.strerror}") from None
        try:
            os.posix_fallocate(fd, 0, size)
        except OSError as exc:
            os.close(fd)
            with contextlib.suppress(OSError):
                path.unlink()
            raise SegmentError(
                exc.errno, f"no room for {size} bytes in {SHM_DIR}: {exc.strerror}"
            ) from None
        segment = cls(name, size, fd, owner=True, mapped=mapped)
        segment.write_at(0, np.frombuffer(secrets.token_bytes(NONCE_BYTES), np.uint8))
        return segment

    @classmethod
    def open(cls, name: str, size: int) -> Segment:
        """Map the segment a server created (same host); :class:`SegmentError` if it cannot."""
        if not NAME.fullmatch(name):
            raise SegmentError(0, f"refusing segment name {name[:80]!r}")
        path = SHM_DIR / name
        try:
            fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
        except OSError as exc:
            raise SegmentError(exc.errno, f"cannot open {path}: {exc.strerror}") from None
        try:
            have = os.fstat(fd).st_size
        except OSError:
            have = -1
        if have != size or size < HEADER_BYTES:
            os.close(fd)
            raise SegmentError(0, f"{path} has {have} bytes, the server announced {size}")
        return cls(name, size, fd, owner=False)

    @property
    def nonce(self) -> bytes:
        """The first :data:`NONCE_BYTES` bytes (written by the server at creation)."""
        if self._map is None:
            return os.pread(self._fd, NONCE_BYTES, 0)
        return bytes(self._buffer[:NONCE_BYTES])

    def array(self, offset: int, dtype: np.dtype, shape: tuple[int, ...]) -> np.ndarray:
        """A writable view of ``shape`` elements of ``dtype`` at byte ``offset``."""
        count = math.prod(shape)
        end = offset + count * dtype.itemsize
        if offset < HEADER_BYTES or offset % ALIGN or end > self.size:
            raise SegmentError(0, f"bytes {offset}..{end} are not inside segment {self.name}")
        return self._buffer[offset:end].view(dtype).reshape(shape)

    def _inside(self, offset: int, nbytes: int, start: int = HEADER_BYTES) -> None:
        if offset < start or nbytes < 0 or offset + nbytes > self.size:
            raise SegmentError(0, f"bytes {offset}..{offset + nbytes} are not inside {self.name}")

    def read_into(self, offset: int, out: np.ndarray) -> None:
        """Copy ``out.nbytes`` bytes at ``offset`` into ``out`` (contiguous)."""
        view = _bytes_of(out)
        self._inside(offset, view.nbytes)
        if self._map is None:
            _whole(os.preadv, self._fd, view, offset)
        else:
            np.copyto(np.frombuffer(view, np.uint8), self._buffer[offset : offset + view.nbytes])

    def write_at(self, offset: int, data: np.ndarray) -> None:
        """Copy ``data`` (contiguous) into the segment at ``offset`` (the header's nonce too)."""
        view = _bytes_of(data)
        self._inside(offset, view.nbytes, start=0)
        if self._map is None:
            _whole(os.pwritev, self._fd, view, offset)
        else:
            np.copyto(self._buffer[offset : offset + view.nbytes], np.frombuffer(view, np.uint8))

    def discard(self, view: np.ndarray) -> None:
        """Give the pages wholly inside ``view`` (an :meth:`array` of this segment) back to the
        system: they read as zeros until written again, and count in no process's memory
        meanwhile. Nothing where the segment is not mapped or the system cannot (no
        ``MADV_REMOVE``)."""
        if self._map is None or not hasattr(mmap, "MADV_REMOVE") or not view.nbytes:
            return
        offset = view.__array_interface__["data"][0] - self._buffer.__array_interface__["data"][0]
        self._inside(offset, view.nbytes)
        start = -(-offset // mmap.PAGESIZE) * mmap.PAGESIZE
        stop = (offset + view.nbytes) // mmap.PAGESIZE * mmap.PAGESIZE
        if stop > start:
            with contextlib.suppress(OSError, ValueError):
                self._map.madvise(mmap.MADV_REMOVE, start, stop - start)

    def unlink(self) -> None:
        """Remove the name (the memory stays until every mapping is gone)."""
        if self._linked:
            self._linked = False
            with contextlib.suppress(FileNotFoundError):
                (SHM_DIR / self.name).unlink()

    def close(self) -> None:
        """Unmap (and, for the creator, remove the name if still there).

        Views handed out earlier must not be used afterwards; numpy arrays still referencing the
        buffer keep the mapping alive until they are collected.
        """
        self.unlink()
        self._buffer = np.empty(0, np.uint8)
        if self._fd >= 0:
            fd, self._fd = self._fd, -1
            os.close(fd)
        if self._map is not None:
            with contextlib.suppress(BufferError):
                self._map.close()


def _bytes_of(array: np.ndarray) -> memoryview:
    """The bytes of a contiguous array, as a flat memoryview (no copy)."""
    if not array.flags.c_contiguous:
        raise ValueError("a segment copies contiguous arrays only")
    return array.reshape(-1).view(np.uint8).data


def _whole(call: Any, fd: int, view: memoryview, offset: int) -> None:
    """``os.preadv`` or ``os.pwritev`` of all of ``view`` (a call may move fewer bytes)."""
    done = 0
    while done < view.nbytes:
        moved = call(fd, [view[done:]], offset + done)
        if moved <= 0:
            raise SegmentError(0, f"{moved} bytes moved at {offset + done} of a shared segment")
        done += moved


def record_name(record: Path, name: str) -> None:
    """Append ``name`` as one line to ``record`` (created 0600, its folder 0700): one
    ``O_APPEND`` write, so servers sharing a file never mix their lines. :class:`SegmentError`
    if it cannot."""
    try:
        private_dir(record.parent)
        fd = open_private(record, os.O_WRONLY | os.O_APPEND | os.O_NOFOLLOW)
        try:
            os.write(fd, f"{name}\n".encode())
        finally:
            os.close(fd)
    except OSError as exc:
        why = f"cannot record a segment in {record}: {exc.strerror}"
        raise SegmentError(exc.errno, why) from None


def remove_leftovers(records: Iterable[Path], prefix: str) -> list[str]:
    """Remove the segment names the ``records`` (:func:`record_name`) list that still exist:
    each a valid segment name (:data:`NAME`) under ``prefix`` (a run's, see :func:`run_prefix`)
    and a regular file of this user; the names removed. Memory still mapped by a live process
    stays theirs until they exit. Nothing not recorded is removed."""
    if not prefix.startswith(NAME_PREFIX) or len(prefix) <= len(NAME_PREFIX) or not available():
        return []
    removed = []
    for record in records:
        try:
            lines = record.read_text(errors="replace").splitlines()
        except OSError:
            continue
        for name in dict.fromkeys(lines):
            if not (NAME.fullmatch(name) and name.startswith(prefix)):
                continue
            path = SHM_DIR / name
            with contextlib.suppress(OSError):
                info = path.lstat()
                if stat.S_ISREG(info.st_mode) and info.st_uid == os.geteuid():
                    path.unlink()
                    removed.append(name)
    if removed:
        log.info("removed %d leftover shared-memory segments of this run", len(removed))
    return removed
