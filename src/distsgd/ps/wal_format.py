"""The records of a write-ahead log (:mod:`distsgd.ps.wal`): their header, their kinds, and
the error of a folder that cannot be recovered. :mod:`distsgd.ps.wal` writes them,
:mod:`distsgd.ps.wal_recovery` reads them."""

from __future__ import annotations

import struct
from enum import IntEnum

MAGIC = b"DWAL"
HEAD = struct.Struct("<4sB3xIIqqqqqdq")
"""magic, kind, body length, CRC32 (of the rest of the header and the body's small part),
generation, version, worker, incarnation, base version, lr scale, push sequence (exactly once:
replayed, it rebuilds the shard's applied sequences)."""
CRC_AT = 12
CRC_FROM = 16
"""Offset of the header's fields after the CRC (covered by it)."""

MAX_META_BYTES = 1 << 20
"""Largest non-payload body (a MEMBERS record's JSON) a log may hold."""


class Kind(IntEnum):
    """What a record holds."""

    PUSH = 1
    LEAVE = 2
    TICK = 3
    MEMBERS = 4


class WalError(ValueError):
    """A write-ahead log folder that cannot be recovered; the message names it."""
