"""The shared-memory segments (and tensor sockets, and data channels) a parameter server holds
for its workers.

One segment per attached worker (see ``Attach`` in ``transport/proto/distsgd.proto``): a pull
area the server writes the shard's values into, and a push area the worker writes its payload
into, each piece at a fixed, 64-byte aligned offset. A segment is usable once the worker has
confirmed it with the nonce it read there; the server then removes its name. Each worker holds
at most one segment per shard (attaching again replaces it), tools (worker -1) at most
:data:`MAX_TOOL_SEGMENTS`, and a segment never confirmed is dropped after
:data:`CONFIRM_SECONDS`. A worker's data channel (a connection presenting the entry's token)
belongs to its entry: a tensor socket's bytes travel on it, a segment's requests may.
"""

from __future__ import annotations

import contextlib
import functools
import hmac
import socket
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

import numpy as np

from distsgd.transport import bulk
from distsgd.transport.proto import distsgd_pb2 as pb
from distsgd.transport.shm import HEADER_BYTES, Segment, align

CONFIRM_SECONDS = 10.0
"""How long a created segment waits for the worker's confirmation."""
MAX_TOOL_SEGMENTS = 4
"""Segments that tools (worker -1) may hold at once on one shard."""
SCRATCH_BUDGET = 128 << 20
"""Bytes of push buffers a shard holds at most (one push's, if it is larger)."""


@dataclass(frozen=True)
class Layout:
    """Where each piece lives in a segment: pull offsets, then push offsets, in piece order."""

    specs: tuple[pb.TensorSpec, ...]
    pull: tuple[int, ...]
    push: tuple[int, ...]
    size: int
    push_at: dict[str, int] = field(default_factory=dict, compare=False)
    """Each piece's push offset by key (derived from ``specs`` and ``push``)."""

    def __post_init__(self) -> None:
        self.push_at.update(
            (spec.key, offset) for spec, offset in zip(self.specs, self.push, strict=True)
        )

    @classmethod
    def of(cls, values: dict[str, np.ndarray]) -> Layout:
        offset = HEADER_BYTES
        pull: list[int] = []
        push: list[int] = []
        for area in (pull, push):
            for array in values.values():
                area.append(offset)
                offset = align(offset + array.nbytes)
        specs = tuple(
            pb.TensorSpec(key=k, dtype=a.dtype.name, shape=list(a.shape)) for k, a in values.items()
        )
        return cls(specs, tuple(pull), tuple(push), max(offset, HEADER_BYTES))


@dataclass
class Attached:
    """One worker's segment on this shard, or its tensor socket (``segment`` None)."""

    id: int
    worker: int
    segment: Segment | None
    layout: Layout
    created: float
    confirmed: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock)
    """Held while the server reads or writes the segment (one request at a time)."""
    token: bytes = b""
    """The one-time token its data channel must present (b"": none offered, or presented)."""
    sock: socket.socket | None = None
    """Its data channel, once presented (a tensor socket's is its only way in)."""
    stale: bool = False
    """Its layout is no longer the shard's (pieces moved): its next request is refused
    NO_SEGMENT, which a client answers by attaching again (nothing of that request applied)."""
    _pull_writers: dict[str, Callable[[np.ndarray], None]] | None = None

    def close(self) -> None:
        self._pull_writers = None
        if self.segment is not None:
            self.segment.close()
        if self.sock is not None:  # shut down first: that wakes the thread serving it at once
            with contextlib.suppress(OSError):
                self.sock.shutdown(socket.SHUT_RDWR)
            with contextlib.suppress(OSError):
                self.sock.close()

    def pull_writers(self) -> dict[str, Callable[[np.ndarray], None]]:
        """For each piece, what writes its values into the pull area (made once)."""
        if self._pull_writers is None:
            assert self.segment is not None, "a tensor socket has no pull area"
            write = self.segment.write_at
            self._pull_writers = {
                spec.key: functools.partial(write, offset)
                for spec, offset in zip(self.layout.specs, self.layout.pull, strict=True)
            }
        return self._pull_writers


class ScratchPool:
    """Server-private buffers where pushes land before they are checked and applied (a
    segment's push area copied, a tensor socket's bytes received), shared by a shard's entries:
    at most ``budget`` bytes in all, or one buffer when a push is larger than that, so the
    server's memory stays its shard's plus a bounded amount however many workers attach. A
    push past the budget waits for a buffer (another push's, which ends)."""

    def __init__(self, budget: int = SCRATCH_BUDGET) -> None:
        self.budget = budget
        self._free: list[np.ndarray] = []
        self._bytes = 0
        self._cond = threading.Condition()

    @property
    def nbytes(self) -> int:
        """Bytes of every buffer made (free or in use)."""
        return self._bytes

    @contextlib.contextmanager
    def take(self, nbytes: int) -> Iterator[np.ndarray]:
        """A buffer of exactly ``nbytes`` (a view of one at least that long) while inside."""
        buffer = self._acquire(nbytes)
        try:
            yield buffer[:nbytes]
        finally:
            with self._cond:
                self._free.append(buffer)
                self._cond.notify()

    def _acquire(self, nbytes: int) -> np.ndarray:
        with self._cond:
            while True:
                fits = [i for i, b in enumerate(self._free) if b.size >= nbytes]
                if fits:  # the smallest that fits (by index: arrays do not compare as values)
                    return self._free.pop(min(fits, key=lambda i: self._free[i].size))
                while self._free and self._bytes + nbytes > self.budget:
                    self._bytes -= self._free.pop(0).size  # too small: make room instead
                if self._bytes == 0 or self._bytes + nbytes <= self.budget:
                    self._bytes += nbytes
                    return np.empty(nbytes, np.uint8)
                self._cond.wait(1.0)


class SegmentTable:
    """The segments of one shard, by id."""

    def __init__(self, scratch_budget: int = SCRATCH_BUDGET) -> None:
        self.scratch = ScratchPool(scratch_budget)
        """Where the entries' pushes land (:class:`ScratchPool`)."""
        self._by_id: dict[int, Attached] = {}
        self._lock = threading.Lock()
        self._next = int.from_bytes(np.random.default_rng().bytes(6), "little") | 1

    def __len__(self) -> int:
        return len(self._by_id)

    def add(
        self, worker: int, segment: Segment | None, layout: Layout, token: bytes = b""
    ) -> Attached:
        """Hold ``segment`` for ``worker``; replaces the worker's previous one (a tool's oldest
        beyond :data:`MAX_TOOL_SEGMENTS`)."""
        with self._lock:
            self._next += 1
            entry = Attached(self._next, worker, segment, layout, time.monotonic(), token=token)
            mine = sorted(
                (a for a in self._by_id.values() if a.worker == worker), key=lambda a: a.id
            )
            keep = MAX_TOOL_SEGMENTS - 1 if worker < 0 else 0
            for old in mine[: max(0, len(mine) - keep)]:
                self._drop(old)
            self._by_id[entry.id] = entry
            return entry

    def get(self, segment_id: int, worker: int) -> Attached | None:
        entry = self._by_id.get(segment_id)
        return entry if entry is not None and entry.worker == worker else None

    def confirm(self, entry: Attached, nonce: bytes) -> bool:
        """Mark ``entry`` confirmed if ``nonce`` is the one written in it (then unlink its name);
        a wrong nonce drops it."""
        assert entry.segment is not None, "tensor sockets are confirmed by their token"
        if not hmac.compare_digest(nonce, entry.segment.nonce):
            self.remove(entry)
            return False
        entry.segment.unlink()
        entry.confirmed = True
        return True

    def bind_socket(self, segment_id: int, token: bytes, sock: socket.socket) -> Attached | None:
        """A connection presented ``token`` for ``segment_id``: bind it as the entry's data
        channel (once; a segment's only after its nonce confirmed it) and return the entry."""
        with self._lock:
            entry = self._by_id.get(segment_id)
            if (
                entry is None
                or entry.sock is not None
                or (entry.segment is not None and not entry.confirmed)
                or not bulk.same_token(token, entry.token)
            ):
                return None
            entry.sock, entry.confirmed, entry.token = sock, True, b""
            return entry

    def remove(self, entry: Attached) -> None:
        with self._lock:
            self._drop(entry)

    def _drop(self, entry: Attached) -> None:
        self._by_id.pop(entry.id, None)
        with entry.lock:  # never unmap while a request reads or writes it
            entry.close()

    def purge(self, now: float | None = None) -> None:
        """Drop segments created more than :data:`CONFIRM_SECONDS` ago and never confirmed."""
        now = time.monotonic() if now is None else now
        with self._lock:
            stale = [
                a
                for a in self._by_id.values()
                if not a.confirmed and now - a.created > CONFIRM_SECONDS
            ]
            for entry in stale:
                self._drop(entry)

    def close(self) -> None:
        with self._lock:
            for entry in list(self._by_id.values()):
                self._drop(entry)

    def retire(self) -> None:
        """The shard's pieces changed: mark every entry :attr:`~Attached.stale`. Not closed
        here: a request in flight on a data channel finishes and is answered (closing under it
        would leave its worker unable to tell whether its push was applied)."""
        with self._lock:
            for entry in self._by_id.values():
                entry.stale = True

    def entries(self) -> Iterable[Attached]:
        return list(self._by_id.values())
