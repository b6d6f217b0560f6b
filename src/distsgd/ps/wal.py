"""A write-ahead log per shard: a server killed at any moment comes back where it was.

A shard's folder holds ``snapshot-G.npz`` (:meth:`Shard.to_bytes` at the start of generation
``G``) and ``log-G.wal``, the records appended since. Each change of state a rule depends on is
appended *before* the shard applies it:

* ``PUSH``: a payload that passed validation (NaN/Inf-free, registered keys, dtypes and shapes),
  the :class:`~distsgd.ps.rules.PushMeta` fields and the shard's version, then the pieces as raw
  bytes in the shard's key order. A locked rule appends under the shard's lock, so log order is
  apply order; an unlocked one (Hogwild, commutative) appends under the log's own lock.
* ``LEAVE``: a worker finished (a synchronous step may close).
* ``TICK``: a rule's time-based decision changed the parameters (a synchronous step closed
  after its timeout): replayed as "the timeout has passed", never re-decided from the clock.
* ``MEMBERS``: the members, those that left, those finished, and the epoch, after any change
  (rules counting live members read them); the first record of every log holds them too.

A record is a fixed header (magic, kind, body length, CRC32 of header and body, version,
worker, incarnation, base version, lr scale) and its body, written with one ``os.writev``.
Recovery (:func:`recover`) loads the newest readable snapshot and replays every log from its
generation on through :meth:`Shard.push` and :meth:`Shard.leave` (the same code as the live
server), stopping at the first torn or corrupt record. Nothing is fsynced: the log covers a
killed process (its finished writes stay in the page cache), not a machine that loses power.

When a log outgrows :func:`compact_bound` the server starts the next generation
(:meth:`WriteAheadLog.compact`): the state is copied under the locks and a new log opened at
once, the snapshot written after, and older files removed when it is in place.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import struct
import threading
import zlib
from collections.abc import Iterator, Mapping
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from enum import IntEnum
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from distsgd.ps.membership import DEFAULT_EVICT_AFTER, Member
from distsgd.ps.rules import PushMeta, RuleFactory
from distsgd.util import write_bytes_atomic

if TYPE_CHECKING:
    from distsgd.ps.shard import Shard

log = logging.getLogger(__name__)

MAGIC = b"DWAL"
HEAD = struct.Struct("<4sB3xIIqqqqd")
"""magic, kind, body length, CRC32 (of the rest of the header and the body), version, worker,
incarnation, base version, lr scale."""
_CRC_FROM = 16
"""Offset of the header's fields after the CRC (covered by it)."""

MIN_COMPACT_BYTES = 64 << 20
"""A log starts a new generation past max(this, :data:`COMPACT_FACTOR` x the shard's bytes)."""
COMPACT_FACTOR = 4

MAX_META_BYTES = 1 << 20
"""Largest non-payload body (a MEMBERS record's JSON) a log may hold."""

_SNAPSHOT = re.compile(r"snapshot-(\d{8})\.npz")
_LOG = re.compile(r"log-(\d{8})\.wal")
_IOV_MAX = 512


class Kind(IntEnum):
    """What a record holds."""

    PUSH = 1
    LEAVE = 2
    TICK = 3
    MEMBERS = 4


class WalError(ValueError):
    """A write-ahead log folder that cannot be recovered; the message names it."""


def compact_bound(shard_bytes: int) -> int:
    """Log bytes past which the server writes a new snapshot and starts a new log."""
    return max(MIN_COMPACT_BYTES, COMPACT_FACTOR * shard_bytes)


def make_private_dir(folder: Path) -> None:
    """Create ``folder`` (and parents) readable by its owner only (0700)."""
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(folder, 0o700)


def _generations(folder: Path, pattern: re.Pattern[str]) -> list[int]:
    if not folder.is_dir():
        return []
    found = (pattern.fullmatch(p.name) for p in folder.iterdir())
    return sorted(int(m.group(1)) for m in found if m is not None)


def next_generation(folder: Path) -> int:
    """The generation a new log in ``folder`` takes: past every file there."""
    folder = Path(folder)
    return 1 + max([-1, *_generations(folder, _SNAPSHOT), *_generations(folder, _LOG)])


def has_state(folder: Path) -> bool:
    """Whether ``folder`` holds a snapshot to recover from (readable or not)."""
    return bool(_generations(Path(folder), _SNAPSHOT))


class Gate:
    """Shared/exclusive gate for an unlocked rule: pushes append and apply under ``shared``,
    a compaction copies the state under ``exclusive`` (no push half-applied). Waiting writers
    block new readers, so a compaction never starves."""

    def __init__(self) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._readers = 0
        self._writer = False

    @contextmanager
    def shared(self) -> Iterator[None]:
        with self._cond:
            while self._writer:
                self._cond.wait()
            self._readers += 1
        try:
            yield
        finally:
            with self._cond:
                self._readers -= 1
                if not self._readers:
                    self._cond.notify_all()

    @contextmanager
    def exclusive(self) -> Iterator[None]:
        with self._cond:
            while self._writer:
                self._cond.wait()
            self._writer = True
            while self._readers:
                self._cond.wait()
        try:
            yield
        finally:
            with self._cond:
                self._writer = False
                self._cond.notify_all()


def _members_body(shard: Shard, hook: bool) -> bytes:
    """Under the shard's lock: its membership as a MEMBERS body."""
    m = shard.membership
    return json.dumps(
        {
            "epoch": m.epoch,
            "members": [[w, m.members[w].incarnation] for w in sorted(m.members)],
            "left": sorted(m.left),
            "finished": sorted(shard.finished),
            "hook": hook,
        }
    ).encode()


class WriteAheadLog:
    """The log of one shard; create it with :meth:`start`. Thread-safe."""

    def __init__(self, folder: Path, generation: int, fd: int, keys: list[str], bound: int) -> None:
        self.folder = folder
        self.generation = generation
        self.bound = bound
        self.gate = Gate()
        """Unlocked rules: pushes hold it shared (see :class:`Gate`)."""
        self._fd = fd
        self._size = 0
        self._lock = threading.Lock()
        self._head = bytearray(HEAD.size)
        self._index = {k: i for i, k in enumerate(keys)}
        self._keys = keys
        self._all = np.arange(len(keys), dtype="<u4").tobytes()
        self._compacting = threading.Lock()
        self.broken = False
        """Set when a write failed: the folder was emptied and nothing more is logged."""
        self.records = 0

    # -- creating -------------------------------------------------------------------------------
    @classmethod
    def start(cls, folder: Path, shard: Shard, generation: int = 0) -> WriteAheadLog:
        """Write ``shard``'s snapshot as ``generation`` into ``folder``, open its log, attach the
        log to the shard and remove older generations. Call before the shard serves."""
        folder = Path(folder)
        make_private_dir(folder)
        _, data = shard.to_bytes()
        write_bytes_atomic(folder / f"snapshot-{generation:08d}.npz", data)
        nbytes = sum(v.nbytes for v in shard.values.values())
        wal = cls(folder, generation, _open_log(folder, generation), list(shard.values), 0)
        wal.bound = compact_bound(nbytes)
        with shard.cond:
            wal._write(Kind.MEMBERS, shard.version, [_members_body(shard, False)])
        _remove_before(folder, generation)
        shard.wal = wal
        return wal

    def close(self) -> None:
        with self._lock:
            if self._fd >= 0:
                os.close(self._fd)
                self._fd = -1

    # -- appending ------------------------------------------------------------------------------
    def _write(
        self, kind: Kind, version: int, parts: list[Any], meta: PushMeta | None = None
    ) -> None:
        """Append one record of ``parts`` (buffers) atomically with respect to other appends."""
        if self.broken:
            return
        length = sum(memoryview(p).nbytes for p in parts)
        fields = (
            version,
            -1 if meta is None else meta.worker,
            0 if meta is None else meta.incarnation,
            -1 if meta is None else meta.base_version,
            1.0 if meta is None else meta.lr_scale,
        )
        tail = struct.pack("<qqqqd", *fields)
        crc = zlib.crc32(tail)
        for part in parts:
            crc = zlib.crc32(part, crc)
        with self._lock:
            if self._fd < 0:
                return
            HEAD.pack_into(self._head, 0, MAGIC, kind, length, crc, *fields)
            try:
                _write_all(self._fd, [self._head, *parts], HEAD.size + length)
            except OSError as exc:
                self._fail(exc)
                return
            self._size += HEAD.size + length
            self.records += 1

    def _fail(self, exc: OSError) -> None:
        """Under ``_lock``: a write failed; stop logging and empty the folder, so that a restart
        falls back to the last checkpoint instead of a log that misses updates."""
        log.error(
            "write-ahead log %s: cannot write (%s); logging stops for this server: free space "
            "in its folder, or run with --wal off",
            self.folder,
            exc.strerror or exc,
        )
        self.broken = True
        with suppress(OSError):  # the descriptor may be what failed
            os.close(self._fd)
        self._fd = -1
        _remove_before(self.folder, 1 << 40)

    def append_push(self, shard: Shard, payload: Mapping[str, np.ndarray], meta: PushMeta) -> None:
        """A validated payload, before the rule applies it (under the shard's lock for a locked
        rule, under :attr:`gate` for an unlocked one)."""
        arrays: list[Any] = []
        if list(payload) == self._keys:
            index: bytes = self._all
            keys = self._keys
        else:
            keys = sorted(payload, key=self._index.__getitem__)
            index = np.array([self._index[k] for k in keys], dtype="<u4").tobytes()
        for key in keys:
            have = shard.values[key]
            array = payload[key]
            if array.dtype != have.dtype or not array.flags.c_contiguous:
                array = np.ascontiguousarray(array, dtype=have.dtype)
            arrays.append(array.reshape(-1).view(np.uint8))
        count = struct.pack("<I", len(keys))
        self._write(Kind.PUSH, shard.version, [count, index, *arrays], meta)

    def append_leave(self, shard: Shard, worker: int) -> None:
        """Under the shard's lock, before :meth:`Shard.leave` changes anything."""
        self._write(Kind.LEAVE, shard.version, [struct.pack("<q", worker)])

    def append_tick(self, shard: Shard, before: int) -> None:
        """Under the shard's lock: the rule's tick moved the version on from ``before``."""
        self._write(Kind.TICK, before, [b""])

    def append_members(self, shard: Shard) -> None:
        """Under the shard's lock, after a membership change and before the rule hears of it."""
        self._write(Kind.MEMBERS, shard.version, [_members_body(shard, True)])

    # -- compaction -----------------------------------------------------------------------------
    @property
    def size(self) -> int:
        """Bytes in the current log."""
        return self._size

    def maybe_compact(self, shard: Shard) -> bool:
        """Start a new generation if the log is past :attr:`bound`; True if it did."""
        if self.broken or self._size < self.bound:
            return False
        self.compact(shard)
        return True

    def compact(self, shard: Shard) -> None:
        """Copy the state and switch to a new log (under the locks: a copy and an open), then
        write the snapshot and remove the older generation."""
        if not self._compacting.acquire(blocking=False):
            return  # another thread is at it
        try:
            gate = self.gate.exclusive() if not shard.rule.locked else _nothing()
            with gate, shard.cond:
                version, arrays, header = shard.state_copy()
                members = _members_body(shard, False)
                generation = self.generation + 1
                fd = _open_log(self.folder, generation)
                with self._lock:
                    old, self._fd, self._size = self._fd, fd, 0
                    self.generation = generation
                self._write(Kind.MEMBERS, version, [members])
            if old >= 0:
                os.close(old)
            data = shard.pack(arrays, header)
            try:
                write_bytes_atomic(self.folder / f"snapshot-{generation:08d}.npz", data)
            except OSError as exc:
                with self._lock:
                    if self._fd >= 0:
                        self._fail(exc)
                return
            _remove_before(self.folder, generation)
            log.info(
                "shard %d: write-ahead log at generation %d (version %d, snapshot %d bytes)",
                shard.index,
                generation,
                version,
                len(data),
            )
        finally:
            self._compacting.release()


@contextmanager
def _nothing() -> Iterator[None]:
    yield


def _open_log(folder: Path, generation: int) -> int:
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_APPEND | os.O_CLOEXEC
    return os.open(folder / f"log-{generation:08d}.wal", flags, 0o600)


def _write_all(fd: int, parts: list[Any], total: int) -> None:
    """``os.writev`` until every byte is written (a short write resumes where it stopped)."""
    views = [memoryview(p).cast("B") for p in parts if memoryview(p).nbytes]
    done = 0
    while done < total:
        written = os.writev(fd, views[:_IOV_MAX])
        done += written
        while views and written >= views[0].nbytes:
            written -= views[0].nbytes
            views.pop(0)
        if written:
            views[0] = views[0][written:]


def _remove_before(folder: Path, generation: int) -> None:
    """Remove the snapshots and logs of generations below ``generation``."""
    for pattern, name in ((_SNAPSHOT, "snapshot-{:08d}.npz"), (_LOG, "log-{:08d}.wal")):
        for old in _generations(folder, pattern):
            if old < generation:
                (folder / name.format(old)).unlink(missing_ok=True)


# -------------------------------------------------------------------------------- recovery


@dataclass(frozen=True, kw_only=True)
class Recovery:
    """A shard rebuilt from its folder: the snapshot's generation and version, the records
    replayed, and whether the replay stopped at a torn or corrupt record."""

    shard: Shard
    generation: int
    snapshot_version: int
    records: int
    torn: bool


def recover(
    folder: Path,
    rule_factory: RuleFactory,
    *,
    max_workers: int = 0,
    evict_after: float = DEFAULT_EVICT_AFTER,
) -> Recovery | None:
    """The shard as the dead server had it: the newest readable snapshot, then every record
    logged after it. None if ``folder`` holds no snapshot; :class:`WalError` if none is
    readable."""
    from distsgd.ps.shard import CorruptCheckpoint, Shard

    folder = Path(folder)
    snapshots = _generations(folder, _SNAPSHOT)
    if not snapshots:
        return None
    for generation in reversed(snapshots):
        path = folder / f"snapshot-{generation:08d}.npz"
        try:
            shard = Shard.from_bytes(
                path.read_bytes(),
                rule_factory,
                name=str(path),
                max_workers=max_workers,
                evict_after=evict_after,
            )
            break
        except (CorruptCheckpoint, OSError) as exc:
            log.warning("write-ahead log: skipping %s: %s", path, exc)
    else:
        raise WalError(
            f"{folder}: no readable snapshot; restore from a checkpoint, or remove the folder "
            "to start over"
        )
    start, records, torn, last = shard.version, 0, False, generation
    for gen in _generations(folder, _LOG):
        if gen < generation:
            continue
        replayed, torn = _replay(folder / f"log-{gen:08d}.wal", shard)
        records, last = records + replayed, gen
        if torn:
            break
    shard.restored_version = shard.version
    log.info(
        "shard %d recovered from %s: snapshot %d at version %d, %d records replayed, version %d%s",
        shard.index,
        folder,
        generation,
        start,
        records,
        shard.version,
        " (stopped at a torn record)" if torn else "",
    )
    return Recovery(
        shard=shard, generation=last, snapshot_version=start, records=records, torn=torn
    )


def _replay(path: Path, shard: Shard) -> tuple[int, bool]:
    """Apply the records of one log to ``shard``; (records applied, stopped early)."""
    limit = MAX_META_BYTES + 8 + sum(4 + v.nbytes for v in shard.values.values())
    count = 0
    with open(path, "rb") as f:
        while True:
            head = f.read(HEAD.size)
            if not head:
                return count, False
            if len(head) < HEAD.size:
                break
            magic, kind, length, crc, *fields = HEAD.unpack(head)
            if magic != MAGIC or kind not in Kind._value2member_map_ or length > limit:
                break
            body = f.read(length)
            if len(body) < length or zlib.crc32(body, zlib.crc32(head[_CRC_FROM:])) != crc:
                break
            try:
                _apply(shard, Kind(kind), body, fields)
            except (ValueError, KeyError, IndexError, TypeError) as exc:
                log.warning("write-ahead log %s: record %d unreadable (%s)", path, count, exc)
                break
            count += 1
    log.warning("write-ahead log %s: stopped at a torn or corrupt record after %d", path, count)
    return count, True


def _apply(shard: Shard, kind: Kind, body: bytes, fields: list[Any]) -> None:
    version, worker, incarnation, base_version, lr_scale = fields
    if kind is Kind.PUSH:
        if shard.rule.locked and version != shard.version:
            log.warning(
                "shard %d: a logged push saw version %d, the replay is at %d",
                shard.index,
                version,
                shard.version,
            )
        meta = PushMeta(
            worker=worker, incarnation=incarnation, base_version=base_version, lr_scale=lr_scale
        )
        shard.push(_payload(shard, body), meta)
    elif kind is Kind.LEAVE:
        shard.leave(struct.unpack("<q", body)[0])
    elif kind is Kind.TICK:
        with shard.cond:
            shard.rule.tick(shard, math.inf)
    else:
        _apply_members(shard, json.loads(body))


def _payload(shard: Shard, body: bytes) -> dict[str, np.ndarray]:
    (count,) = struct.unpack_from("<I", body)
    keys = list(shard.values)
    index = np.frombuffer(body, dtype="<u4", count=count, offset=4)
    offset = 4 + 4 * count
    payload: dict[str, np.ndarray] = {}
    for i in index:
        have = shard.values[keys[int(i)]]
        payload[keys[int(i)]] = np.frombuffer(
            body, dtype=have.dtype, count=have.size, offset=offset
        ).reshape(have.shape)
        offset += have.nbytes
    if offset != len(body):
        raise ValueError(f"a push record of {len(body)} bytes holds {offset}")
    return payload


def _apply_members(shard: Shard, state: dict[str, Any]) -> None:
    with shard.cond:
        m = shard.membership
        now = m.clock()
        m.members = {int(w): Member(int(inc), now) for w, inc in state["members"]}
        m.left = {int(w) for w in state["left"]}
        m.epoch = int(state["epoch"])
        shard.finished = {int(w) for w in state["finished"]}
        if state["hook"]:
            shard.rule.on_membership(shard, m.live)


def begin(folder: Path, shard: Shard) -> WriteAheadLog | None:
    """Start logging ``shard`` in ``folder`` at the next generation (a server that registers
    or restores it); None, with the error logged, if the folder cannot be written (the server
    then runs without a log, as with ``--wal off``)."""
    try:
        return WriteAheadLog.start(folder, shard, next_generation(folder))
    except OSError as exc:
        log.error(
            "write-ahead log %s: cannot start (%s); shard %d runs without one: free space "
            "or fix the folder's permissions, or run with --wal off",
            folder,
            exc.strerror or exc,
            shard.index,
        )
        return None


def resume(
    folder: Path,
    restored: Shard | None,
    rule_factory: RuleFactory,
    *,
    shard_index: int,
    max_workers: int = 0,
    evict_after: float = DEFAULT_EVICT_AFTER,
) -> Shard | None:
    """The shard a starting server serves: the one recovered from ``folder`` or ``restored``
    (a checkpoint), whichever is newer (the log on a tie), logging from then on; None when
    there is neither (the run registers it). :class:`WalError` if the folder holds state that
    cannot be read and there is no checkpoint."""
    try:
        recovery = recover(folder, rule_factory, max_workers=max_workers, evict_after=evict_after)
    except WalError as exc:
        if restored is None:
            raise
        log.warning("%s; starting from the checkpoint", exc)
        recovery = None
    shard = restored
    if recovery is not None:
        if recovery.shard.index != shard_index:
            raise WalError(
                f"{folder} holds shard {recovery.shard.index}, not shard {shard_index}; "
                "give each server its own --wal-dir"
            )
        if restored is None or recovery.shard.version >= restored.version:
            shard = recovery.shard
        else:
            log.warning(
                "shard %d: the checkpoint (version %d) is newer than the write-ahead log "
                "(version %d); starting from the checkpoint",
                shard_index,
                restored.version,
                recovery.shard.version,
            )
    if shard is not None:
        begin(folder, shard)
    return shard
