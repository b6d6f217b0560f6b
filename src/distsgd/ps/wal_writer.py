"""How a write-ahead log (:mod:`distsgd.ps.wal`) writes its records: :class:`LogFile`, the
current generation's file (its descriptor, where the next record goes, how far it is
allocated, the buffer each record's header is packed in), and :class:`PushIndex`, how a push
record names its pieces (by their place in the generation's snapshot)."""

from __future__ import annotations

import errno
import logging
import os
import struct
import sys
import zlib
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import numpy as np

from distsgd.ps.rules import PushMeta
from distsgd.ps.wal_files import pwrite_all
from distsgd.ps.wal_format import CRC_AT, CRC_FROM, HEAD, MAGIC, Kind

if TYPE_CHECKING:
    from distsgd.ps.replica import ReplicaLink

log = logging.getLogger(__name__)

RESERVE_BYTES = 16 << 20
"""How far past a record a log file is allocated ahead of its writes (:meth:`LogFile.reserve`)."""


def file_size(fd: int) -> int:
    return os.fstat(fd).st_size if fd >= 0 else 0


class LogFile:
    """The current generation's log file, written under the log's lock. ``name``: the log's,
    in messages; ``fd`` -1: none open (a log that starts down)."""

    def __init__(self, fd: int, name: str) -> None:
        self.fd = fd
        self.name = name
        self.offset = 0
        """Bytes in the file's records: where the next one goes."""
        self.reserved = file_size(fd)
        self._head = bytearray(HEAD.size)
        self._head_view = memoryview(self._head)
        self.pwrite = pwrite_all
        """How records are written (``pwrite(fd, views, offset)``); tests inject failures."""

    def switch(self, fd: int) -> int:
        """Write into ``fd`` from its start from now on; the older descriptor (-1: none)."""
        old, self.fd, self.offset = self.fd, fd, 0
        self.reserved = file_size(fd)
        return old

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def append(
        self,
        kind: Kind,
        generation: int,
        version: int,
        checked: list[Any],
        parts: list[memoryview],
        meta: PushMeta | None,
        *,
        bound: int,
        replica: ReplicaLink | None,
    ) -> None:
        """Write one record at the file's end (the log's ``bound``: how far to allocate ahead),
        and to ``replica`` too; OSError if a write failed."""
        length = sum(p.nbytes for p in parts)
        HEAD.pack_into(
            self._head,
            0,
            MAGIC,
            kind,
            length,
            0,
            generation,
            version,
            -1 if meta is None else meta.worker,
            0 if meta is None else meta.incarnation,
            -1 if meta is None else meta.base_version,
            1.0 if meta is None else meta.lr_scale,
            0 if meta is None else meta.sequence,
        )
        crc = zlib.crc32(memoryview(self._head)[CRC_FROM:])
        for part in checked:
            crc = zlib.crc32(part, crc)
        struct.pack_into("<I", self._head, CRC_AT, crc)
        if self.fd < 0:
            raise OSError(errno.EBADF, "the log file is not open")
        if replica is not None:  # sent first, answered last: it writes while this file is
            replica.send_record(generation, self.offset, self._head_view, parts)
        try:
            self.reserve(self.offset + HEAD.size + length, bound)
            self.pwrite(self.fd, parts, self.offset + HEAD.size)
            self.pwrite(self.fd, [self._head_view], self.offset)  # the record exists now
        except OSError:
            if replica is not None:
                replica.close()  # its answer is not read: the connection starts over
            raise
        if replica is not None:
            replica.wait()  # a push is acknowledged only once both hold its record
        self.offset += HEAD.size + length

    def reserve(self, end: int, bound: int) -> None:
        """Allocate the file up to ``end`` (and :data:`RESERVE_BYTES` more, short of
        ``bound``) with ``posix_fallocate`` before a record is written past its end. On the
        project's machine (ext4) a page written past a file's end cost 1.4 to 10 times a page
        rewritten, and an allocated one 1.4 times (2.7 MB: 0.7-3.7 ms, 0.36 ms, 0.51 ms). A
        file system that refuses (full, or unable) is left to the write itself."""
        if end <= self.reserved:
            return
        want = max(end, min(end + RESERVE_BYTES, bound))
        try:
            os.posix_fallocate(self.fd, self.reserved, want - self.reserved)
        except OSError as exc:
            log.debug("write-ahead log %s: no room reserved (%s)", self.name, exc)
            self.reserved = sys.maxsize  # this file: no further tries
            return
        self.reserved = want


class PushIndex:
    """The pieces a push record indexes, in the order of the generation's snapshot."""

    def __init__(self, keys: list[str]) -> None:
        self.index = {k: i for i, k in enumerate(keys)}
        self.keys = keys
        self.all = np.arange(len(keys), dtype="<u4").tobytes()

    def of(self, payload: Mapping[str, np.ndarray]) -> tuple[list[str], bytes]:
        """A payload's pieces in the snapshot's order, and their places as the record has them."""
        if list(payload) == self.keys:
            return self.keys, self.all
        keys = sorted(payload, key=self.index.__getitem__)
        return keys, np.array([self.index[k] for k in keys], dtype="<u4").tobytes()
