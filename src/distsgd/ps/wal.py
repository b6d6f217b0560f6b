"""A write-ahead log per shard: a server killed at any moment comes back where it was.

A shard's folder holds ``snapshot-G.npz`` (:meth:`Shard.to_bytes` at the start of generation
``G``) and two log files, ``log-0.wal`` and ``log-1.wal``: generation ``G`` writes its records
into ``log-{G % 2}.wal`` from its start, over whatever an older generation left there (pages
already in the page cache are rewritten several times faster than a growing file's new ones
on the project's machine; every record names its generation, so an older one ends the log).
Each change of state a rule depends on is appended *before* the shard applies it:

* ``PUSH``: a payload that passed validation (NaN/Inf-free, registered keys, dtypes and shapes),
  the :class:`~distsgd.ps.rules.PushMeta` fields and the shard's version, then the pieces as raw
  bytes in the shard's key order. A locked rule appends under the shard's lock, so log order is
  apply order; an unlocked one (Hogwild, commutative) appends under the log's own lock.
* ``LEAVE``: a worker finished (a synchronous step may close).
* ``TICK``: a rule's time-based decision changed the parameters (a synchronous step closed
  after its timeout): replayed as "the timeout has passed", never re-decided from the clock.
* ``MEMBERS``: the members, those that left, those finished, and the epoch, after any change
  (rules counting live members read them); the first record of every log holds them too.

A record is a fixed header (magic, kind, length, CRC32, generation, version, worker,
incarnation, base version, lr scale, push sequence) and a body. The body is written first and
the header after it (two ``pwrite`` calls, under a lock): a process killed in between leaves no
header, so the record does not exist. The CRC covers the header and the body's small part (a
push's key list; all of the other kinds' bodies), not a push's payload: a killed process cannot
tear a written body, and checksumming it cost more than the server's whole push (zlib's CRC32
runs at 1.4 GB/s here). Nothing is fsynced. So the log covers a killed process (its writes stay
in the page cache), not a machine that loses power or a disk that corrupts data.

Recovery (:func:`recover`, in :mod:`distsgd.ps.wal_recovery`; the records' format in
:mod:`distsgd.ps.wal_format`) loads the newest readable snapshot and replays the records of its
generation (and of the next one, when the server died before that one's snapshot was written)
through :meth:`Shard.push` and :meth:`Shard.leave`, as the live server, up to the first record
that is missing, torn, or of another generation. Past :func:`compact_bound` the server starts
the next generation (:meth:`WriteAheadLog.compact`): the state copied under the locks (a large
shard's written there, :data:`LIVE_SNAPSHOT_BYTES`) and the other log file taken at once, the
snapshot written after, and the older snapshot removed when it is in place. The push that takes
the log past the bound wakes the log's compactor thread, which does this at once (the server's
ticker, every 0.5 s, is the fallback); a log file is allocated ahead of its records
(``posix_fallocate``, :data:`RESERVE_BYTES` at a time up to the bound).

A write that fails (a full disk: ENOSPC) takes the log *down*, never off
(:mod:`distsgd.ps.wal_outage`): the files stay as they were (a consistent prefix of what the
server applied), and a push that meets a down log is not applied: it waits, then is refused
``not-logged`` (the client sends it again). So no push is acknowledged that the log does not
hold. Changes that cannot wait (a member joins or leaves, a synchronous step's timeout) are
applied and counted as ``unlogged``. Every second the server's ticker tries to start a new
generation from a snapshot of the shard as it is (:meth:`WriteAheadLog.revive`); once that is
written the log is up again and the pushes go on. :meth:`WriteAheadLog.state` says all this to
``Info`` (``WalStatus``), and so to the launcher's console.
"""

from __future__ import annotations

import json
import logging
import os
import struct
import threading
import time
from collections.abc import Callable, Mapping
from contextlib import nullcontext, suppress
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO

import numpy as np

from distsgd.ps.membership import DEFAULT_EVICT_AFTER
from distsgd.ps.replica import UNAVAILABLE, ReplicaError
from distsgd.ps.rules import PushMeta, RuleFactory
from distsgd.ps.wal_files import (
    SLOTS,
    has_state,
    make_private_dir,
    next_generation,
)
from distsgd.ps.wal_files import open_log as _open_log
from distsgd.ps.wal_files import remove_before as _remove_before
from distsgd.ps.wal_files import write_snapshot as _write_snapshot
from distsgd.ps.wal_format import HEAD, Kind, WalError
from distsgd.ps.wal_outage import LogDown, NotLogged, Outage, WalState
from distsgd.ps.wal_recovery import Recovery, recover
from distsgd.ps.wal_writer import RESERVE_BYTES, LogFile, PushIndex

if TYPE_CHECKING:
    from distsgd.ps.replica import ReplicaLink

__all__ = [
    "HEAD",
    "RESERVE_BYTES",
    "SLOTS",
    "Kind",
    "LogDown",
    "NotLogged",
    "Recovery",
    "WalError",
    "WalState",
    "WriteAheadLog",
    "has_state",
    "make_private_dir",
    "next_generation",
    "recover",
    "resume",
]

if TYPE_CHECKING:
    from distsgd.ps.shard import Shard

log = logging.getLogger(__name__)


MIN_COMPACT_BYTES = 64 << 20
"""A log starts a new generation past max(this, :data:`COMPACT_FACTOR` x the shard's bytes)."""
COMPACT_FACTOR = 4


LIVE_SNAPSHOT_BYTES = 64 << 20
"""A shard of at least this many bytes writes a new generation's snapshot from its live
values, holding pushes meanwhile (pulls go on), instead of from a copy: no second copy of a
large shard in memory, for a pause about as long as writing it to the page cache."""


def compact_bound(shard_bytes: int) -> int:
    """Log bytes past which the server writes a new snapshot and starts a new log."""
    return max(MIN_COMPACT_BYTES, COMPACT_FACTOR * shard_bytes)


def _packer(arrays: dict[str, np.ndarray], header: dict[str, Any]) -> Callable[[BinaryIO], None]:
    """What writes a shard's :meth:`~distsgd.ps.shard.Shard.state_copy` into a snapshot file
    (the ``.npz`` of :meth:`~distsgd.ps.shard.Shard.pack`, never whole in memory)."""
    from distsgd.ps.shard import Shard  # the shard imports this module

    return lambda f: Shard.pack_into(f, arrays, header)


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

    def __init__(self, folder: Path, generation: int, fd: int, shard: Shard) -> None:
        self.folder = folder
        self.generation = generation
        self.bound = compact_bound(sum(v.nbytes for v in shard.values.values()))
        self.file = LogFile(fd, str(folder))
        """The current generation's log file (changed under ``_lock``)."""
        self._lock = threading.Lock()
        self._keys = PushIndex(list(shard.values))
        self._compacting = threading.Lock()
        self._shard = shard
        self._due = threading.Event()
        self._compactor: threading.Thread | None = None
        self._closed = False
        self.records = 0
        self.outage = Outage(folder)
        """Whether a write failed and the log is down, until :meth:`revive`."""
        self.write_snapshot = _write_snapshot
        """How snapshots are written (``write_snapshot(path, data)``); tests inject failures."""
        self.replica: ReplicaLink | None = _REPLICAS.get(Path(folder).resolve())
        """Where every file this log writes is written too (:mod:`distsgd.ps.replica`)."""

    @property
    def broken(self) -> bool:
        """Whether the log is down (a write failed; see :meth:`revive`)."""
        return self.outage.down

    def state(self) -> WalState:
        with self._lock:
            return self.outage.state(self.generation)

    # -- creating -------------------------------------------------------------------------------
    @classmethod
    def start(cls, folder: Path, shard: Shard, generation: int = 0) -> WriteAheadLog:
        """Write ``shard``'s snapshot as ``generation`` into ``folder``, open its log, attach the
        log to the shard and remove older snapshots. Call before the shard serves. In a folder
        without a snapshot (a new log) the log files start empty."""
        folder = Path(folder)
        make_private_dir(folder)
        fresh = not has_state(folder)
        _, arrays, header = shard.state_copy(copy=False)  # not serving yet
        snapshot = folder / f"snapshot-{generation:08d}.npz"
        _write_snapshot(snapshot, _packer(arrays, header))
        fd = _open_log(folder, generation, truncate=fresh)
        if fresh:
            _open_log(folder, generation + 1, truncate=True, keep=False)
        replica = _REPLICAS.get(folder.resolve())
        if replica is not None:  # an OSError: the log starts down (begin), re-seeded later
            try:
                replica.put_snapshot(snapshot, generation, fresh=fresh)
            except OSError:
                os.close(fd)
                raise
        wal = cls(folder, generation, fd, shard)
        with shard.cond:
            wal._write(Kind.MEMBERS, shard.version, [_members_body(shard, False)])
        _remove_before(folder, generation)
        shard.wal = wal
        return wal

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self.file.close()
            compactor = self._compactor
            if self.replica is not None:
                self.replica.close()
        self._due.set()  # the compactor ends
        if compactor is not None and compactor is not threading.current_thread():
            compactor.join(timeout=5.0)
        self.outage.stop()  # pushes waiting for the log give up (NotLogged)

    # -- appending ------------------------------------------------------------------------------
    def _write(
        self,
        kind: Kind,
        version: int,
        checked: list[Any],
        data: tuple[Any, ...] = (),
        meta: PushMeta | None = None,
    ) -> None:
        """Append one record: ``checked`` (small, under the CRC) then ``data`` (a payload),
        body first and header last, atomically with respect to other appends. A log that is
        down (or goes down now) takes nothing: a push raises :class:`LogDown`, other records
        are counted as ``unlogged``."""
        if self._closed:
            return
        if self.outage.down and kind is Kind.PUSH:
            raise LogDown(self.outage)
        parts = [memoryview(p).cast("B") for p in (*checked, *data)]
        with self._lock:
            if self._closed:
                return
            if not self.outage.down:
                try:
                    self._append(kind, version, checked, parts, meta)
                    return
                except OSError as exc:
                    self.outage.began(exc)
            if kind is not Kind.PUSH:  # applied already: counted, and in the next snapshot
                self.outage.unlogged += 1
                return
        raise LogDown(self.outage)

    def _append(
        self,
        kind: Kind,
        version: int,
        checked: list[Any],
        parts: list[memoryview],
        meta: PushMeta | None,
    ) -> None:
        """Under ``_lock``: write one record at the log's end; OSError if a write failed."""
        self.file.append(
            kind,
            self.generation,
            version,
            checked,
            parts,
            meta,
            bound=self.bound,
            replica=self.replica,
        )
        self.records += 1
        if kind is Kind.PUSH and self.file.offset >= self.bound:
            self._compact_soon()

    def _compact_soon(self) -> None:
        """Under ``_lock``, the log past its bound: wake the compactor (started the first time),
        which starts the next generation off the pushes' path. A log compacted only by the
        server's ticker (every 0.5 s) grew to everything pushed in between: at 2.7 MB pushes
        on one host, 300 MB files, each page of them new and several times slower to write
        than a page the file had before."""
        if self._compactor is None:
            self._compactor = threading.Thread(
                target=self._compact_when_due, name=f"wal-{self.folder.name}", daemon=True
            )
            self._compactor.start()
        self._due.set()

    def _compact_when_due(self) -> None:
        while True:
            self._due.wait()
            self._due.clear()
            if self._closed:
                return
            try:
                self.maybe_compact(self._shard)
            except Exception:  # a bug; the ticker compacts too (every 0.5 s)
                log.exception("write-ahead log %s: compacting failed", self.folder)

    def revive(self, shard: Shard) -> bool:
        """A down log tries to come back: under the locks, the shard's snapshot as a new
        generation, then that generation's log file and its first record. True once up (pushes
        go on); False if a write failed again (the older files still hold the state)."""
        if not self._compacting.acquire(blocking=False):
            return False
        try:
            gate = shard.gate.exclusive() if not shard.rule.locked else nullcontext()
            with gate, shard.cond:
                if not self.outage.down or self._closed:
                    return not self.outage.down
                generation = max(self.generation + 1, next_generation(self.folder))
                version, arrays, header = shard.state_copy(copy=False)  # written under the locks
                members = [_members_body(shard, False)]
                try:
                    path = self.folder / f"snapshot-{generation:08d}.npz"
                    self.write_snapshot(path, _packer(arrays, header))
                    if self.replica is not None:  # re-seeds one that came back
                        with self._lock:
                            self.replica.put_snapshot(path, generation)
                    fd = _open_log(self.folder, generation)
                except OSError as exc:
                    if self.replica is not None:  # a try a second: no snapshot left per try
                        path.unlink(missing_ok=True)
                    with self._lock:
                        self.outage.error = exc.strerror or str(exc)
                    return False
                if not self._switch(shard, fd, generation, version, members):
                    return False
            _remove_before(self.folder, generation)
            log.warning(
                "write-ahead log %s: written again, at generation %d (version %d); pushes go on",
                self.folder,
                generation,
                version,
            )
            return True
        finally:
            self._compacting.release()

    def _switch(
        self, shard: Shard, fd: int, generation: int, version: int, members: list[bytes]
    ) -> bool:
        """(:meth:`revive`, under the shard's locks) write into ``fd`` from now on, its first
        record first; True if that record is written and the log is up."""
        with self._lock:
            old = self.file.switch(fd)
            self.generation = generation
            self._keys = PushIndex(list(shard.values))
            if old >= 0:
                with suppress(OSError):
                    os.close(old)
            parts = [memoryview(p).cast("B") for p in members]
            try:
                self._append(Kind.MEMBERS, version, members, parts, None)
            except OSError as exc:
                self.outage.error = exc.strerror or str(exc)
                return False  # its snapshot holds the state: the next try takes a new one
            self.outage.ended()
            return True

    def append_push(
        self,
        shard: Shard,
        payload: Mapping[str, np.ndarray],
        meta: PushMeta,
        undo: Callable[[], None] | None = None,
    ) -> None:
        """A validated payload, before the rule applies it (under the shard's lock for a locked
        rule, under :attr:`gate` for an unlocked one). ``undo``: called before
        :class:`LogDown` is raised (the push is not applied: what was done for it is undone)."""
        keys, index = self._keys.of(payload)
        arrays: list[Any] = []
        for key in keys:
            array = payload[key]
            if array.dtype != shard.values[key].dtype or not array.flags.c_contiguous:
                array = np.ascontiguousarray(array, dtype=shard.values[key].dtype)
            if array.size:  # an empty piece has no bytes (and no byte view)
                arrays.append(array)
        count = struct.pack("<I", len(keys))
        try:
            self._write(Kind.PUSH, shard.version, [count, index], tuple(arrays), meta)
        except LogDown:
            if undo is not None:
                undo()
            raise

    def append_leave(self, shard: Shard, worker: int) -> None:
        """Under the shard's lock, before :meth:`Shard.leave` changes anything."""
        self._write(Kind.LEAVE, shard.version, [struct.pack("<q", worker)])

    def append_tick(self, shard: Shard, before: int) -> None:
        """Under the shard's lock: the rule's tick moved the version on from ``before``."""
        self._write(Kind.TICK, before, [])

    def append_members(self, shard: Shard) -> None:
        """Under the shard's lock, after a membership change and before the rule hears of it."""
        self._write(Kind.MEMBERS, shard.version, [_members_body(shard, True)])

    # -- compaction -----------------------------------------------------------------------------
    @property
    def size(self) -> int:
        """Bytes in the current generation's log."""
        return self.file.offset

    def maybe_compact(self, shard: Shard) -> bool:
        """Start a new generation if the log is past :attr:`bound`; True if it did. A log that
        is down tries to come back instead (every second)."""
        if self.outage.down:
            if self.outage.due():
                self.revive(shard)
            return False
        if self.file.offset < self.bound:
            return False
        self.compact(shard)
        return True

    def compact(self, shard: Shard, *, wait: bool = False) -> None:
        """Copy the state and switch to the other log file (under the locks: a copy and an
        open), then write the snapshot and remove the older one. ``wait``: if another thread
        is compacting, wait for it and compact again (the shard's pieces changed: a move)."""
        if not self._compacting.acquire(blocking=wait):
            return  # another thread is at it
        try:
            live = sum(v.nbytes for v in shard.values.values()) >= LIVE_SNAPSHOT_BYTES
            gate = shard.gate.exclusive() if not shard.rule.locked else nullcontext()
            with gate, shard.cond:
                version, arrays, header = shard.state_copy(copy=not live)
                members = _members_body(shard, False)
                old = self._switch_to_next(shard, version, members)
                if old is None:
                    return
                path = self.folder / f"snapshot-{old[1]:08d}.npz"
                written = live and self._snapshot(path, arrays, header)
            os.close(old[0])
            if not (written if live else self._snapshot(path, arrays, header)):
                return
            _remove_before(self.folder, old[1])
            size, at = path.stat().st_size, (shard.index, old[1], version)
            log.info("shard %d: log generation %d, version %d, snapshot %d B", *at, size)
        finally:
            self._compacting.release()

    def _switch_to_next(self, shard: Shard, version: int, members: bytes) -> tuple[int, int] | None:
        """Under the locks: open the next generation's log and make it the current one, its
        first record the members; (the older descriptor, the new generation), or None if the
        log is closed or down (nothing switched)."""
        generation = self.generation + 1
        try:
            fd = _open_log(self.folder, generation)
        except OSError as exc:
            with self._lock:
                self.outage.began(exc)
            return None
        with self._lock:
            closed = self._closed or self.outage.down
            if not closed:
                old = self.file.switch(fd)
                self.generation = generation
                self._keys = PushIndex(list(shard.values))  # pieces may have moved
        if closed:
            os.close(fd)
            return None
        self._write(Kind.MEMBERS, version, [members])
        return old, generation

    def _snapshot(self, path: Path, arrays: dict[str, np.ndarray], header: dict[str, Any]) -> bool:
        """Write a new generation's snapshot; False (the log down) if the disk refused it: the
        older snapshot and both logs still hold the state."""
        try:
            self.write_snapshot(path, _packer(arrays, header))
            if self.replica is not None:  # under the log's lock: one request at a time
                with self._lock:
                    self.replica.put_snapshot(path, int(path.stem.split("-")[1]))
        except OSError as exc:
            with self._lock:
                self.outage.began(exc)
            return False
        return True


_REPLICAS: dict[Path, ReplicaLink] = {}
FETCH_SECONDS = 60.0
"""How long a server on an empty folder tries to reach its replica (which may be coming back
itself) before it gives up."""


def _fetch(replica: ReplicaLink, folder: Path, shard_index: int) -> None:
    """Fill ``folder`` from ``replica``, trying again while it cannot be reached."""
    deadline = time.monotonic() + FETCH_SECONDS
    while True:
        try:
            fetched = replica.fetch(folder)
            break
        except ReplicaError as exc:
            if exc.code != UNAVAILABLE or time.monotonic() > deadline:
                raise WalError(
                    f"shard {shard_index}: its log folder {folder} is empty and its replica "
                    f"cannot give its copy ({exc}); restart the replica, or start from a "
                    "checkpoint (--restore)"
                ) from None
            time.sleep(0.5)
    if fetched:
        log.warning("shard %d: its log's %d file(s) fetched from %r", shard_index, fetched, replica)


def replicate(folder: Path, replica: ReplicaLink | None) -> None:
    """Mirror the log in ``folder`` to ``replica`` (None: no longer) from its next start on:
    a server that has one calls this before it serves (``distsgd server --replica``)."""
    key = Path(folder).resolve()
    if replica is None:
        _REPLICAS.pop(key, None)
    else:
        _REPLICAS[key] = replica


def begin(folder: Path, shard: Shard, after: int = -1) -> WriteAheadLog:
    """Start logging ``shard`` in ``folder`` at a new generation, past every snapshot and past
    ``after`` (the last one replayed), for a server that registers or restores it. If the
    folder cannot be written (a full disk), the log starts down: pushes wait until it can
    (:meth:`WriteAheadLog.revive`), and ``Info`` says so."""
    folder = Path(folder)
    generation = after + 1
    try:
        generation = max(next_generation(folder), generation)
        return WriteAheadLog.start(folder, shard, generation)
    except OSError as exc:
        wal = WriteAheadLog(folder, generation - 1, -1, shard)
        with wal._lock:
            wal.outage.began(exc)
        shard.wal = wal
        return wal


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
    cannot be read and there is no checkpoint. A folder without state whose log has a replica
    (:func:`replicate`) is first filled from the replica's files: a server whose host and disk
    were lost comes back where it was."""
    replica = _REPLICAS.get(Path(folder).resolve())
    if replica is not None and not has_state(folder):
        _fetch(replica, Path(folder), shard_index)
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
        begin(folder, shard, -1 if recovery is None else recovery.generation)
    return shard
