"""A write-ahead log's replica on another host: a lost host loses no acknowledged update.

A parameter server's log (:mod:`distsgd.ps.wal`) lives on its host's disk: it brings back a
killed server, not one whose host (and disk) is gone. With a replica, every file the log
writes is also written, over the network, into the same files on another host: each
generation's snapshot and each record, at the same offsets, the header last. A push is
acknowledged only once its record is in both (Li et al., "Scaling Distributed Machine Learning
with the Parameter Server", OSDI 2014, section 4.3: a server's updates reach its replica
before the worker is answered). A server started on an empty folder fetches the replica's
files first and recovers from them as from its own (:func:`fetch`); so a server whose host
was lost comes back, on any host, where it was.

The protocol ("Log replica" in ``transport/proto/distsgd.proto``) is frames on a plain TCP
connection, the server's records following their messages as raw bytes; each side answers the
other's challenge with the run secret (HMAC-SHA256) before anything is written or trusted, and
the replica checks every field before it writes a byte. One replica keeps one shard's log
(:class:`ReplicaServer`, ``distsgd server --job replica``); the server's end is
:class:`ReplicaLink`, which the log calls.

What a replica costs: a record crosses the network and the replica's disk while the server
writes its own (the send goes first, the wait for the answer last), so a push waits about a
round trip more (docs/fault-tolerance.md has the figures). A replica that cannot be reached
takes the log *down*, as a full disk does (:mod:`distsgd.ps.wal_outage`): pushes wait and are
refused ``not-logged`` until the server's ticker re-seeds a replica (a new generation's
snapshot) that answers again.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import logging
import mmap
import os
import secrets
import shutil
import socket
import struct
import tempfile
import threading
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import BinaryIO, TypeVar

import numpy as np
from google.protobuf.message import DecodeError, Message

from distsgd.ps import wal_files
from distsgd.ps.wal_files import SNAPSHOT, generations, log_path, make_private_dir, remove_before
from distsgd.transport import bulk
from distsgd.transport.proto import distsgd_pb2 as pb

log = logging.getLogger(__name__)

CHALLENGE_BYTES = 32
IO_SECONDS = 30.0
"""How long a request, its bytes and its answer may take (a 300 MB snapshot at 100 Mbit/s
takes 25 s)."""
CHUNK_BYTES = 8 << 20
"""How many bytes the replica takes from the socket before it writes them."""
MAX_GENERATION = 1 << 32
MAX_END = 1 << 40
"""A record or file past this offset is refused (1 TiB)."""


UNAVAILABLE = 14
"""The code of a replica that could not be reached (gRPC's UNAVAILABLE)."""


class ReplicaError(ConnectionError):
    """The replica refused a request (its code and message), or could not be reached. An
    :class:`OSError`: the log takes it as a failed write (its outage)."""

    def __init__(self, message: str, code: int = UNAVAILABLE) -> None:
        super().__init__(message)
        self.code = code
        """The gRPC status code's number (UNAVAILABLE = 14 when unreachable)."""


def proof(secret: str, challenge: bytes) -> bytes:
    """What answers a replica's ``challenge``: HMAC-SHA256 under the run secret."""
    return hmac.new(secret.encode(), challenge, hashlib.sha256).digest()


def replica_proof(secret: str, challenge: bytes) -> bytes:
    """What a replica answers the server's ``challenge`` with (a different message, so that
    neither side's proof can be replayed as the other's)."""
    return proof(secret, b"replica" + challenge)


def split_address(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"replica address {address!r}: write HOST:PORT, e.g. 198.18.0.2:7000")
    return host.strip("[]"), int(port)


def blocking(sock: socket.socket, seconds: float) -> socket.socket:
    """Make ``sock`` a blocking socket whose every send and receive the kernel bounds by
    ``seconds`` (SO_SNDTIMEO, SO_RCVTIMEO): a record is then one ``recv`` (MSG_WAITALL) rather
    than a poll and a receive per chunk (about a third of a small record's round trip here)."""
    sock.settimeout(None)
    limit = struct.pack("ll", int(seconds), int(seconds % 1 * 1e6))
    for option in (socket.SO_RCVTIMEO, socket.SO_SNDTIMEO):
        sock.setsockopt(socket.SOL_SOCKET, option, limit)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    for option in (socket.SO_SNDBUF, socket.SO_RCVBUF):
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, option, bulk.SOCKET_BUFFER)
    return sock


def recv_exact(sock: socket.socket, view: memoryview) -> None:
    """Fill ``view`` from a :func:`blocking` socket; ReplicaError if the peer closes first or
    stalls past the socket's limit."""
    got, total = 0, view.nbytes
    while got < total:
        try:
            n = sock.recv_into(view[got:], total - got, socket.MSG_WAITALL)
        except BlockingIOError:
            raise ReplicaError(f"the peer sent {got} of {total} bytes in time") from None
        if n == 0:
            raise ReplicaError(f"the peer closed the connection after {got} of {total} bytes")
        got += n


def send_frame(sock: socket.socket, kind: int, body: bytes) -> None:
    """One frame (a data channel's: ``bulk.FRAME`` head, then the message) on a blocking socket."""
    if len(body) > bulk.MAX_FRAME_BYTES:
        raise ValueError(f"a {len(body)}-byte message exceeds a frame's limit")
    sock.sendall(bulk.FRAME.pack(kind, len(body)) + body)


def recv_frame(sock: socket.socket) -> tuple[int, bytes]:
    """One frame from a blocking socket: (kind, message bytes)."""
    head = bytearray(bulk.FRAME.size)
    recv_exact(sock, memoryview(head))
    kind, length = bulk.FRAME.unpack(head)
    if length > bulk.MAX_FRAME_BYTES:
        raise ReplicaError(f"a frame announces {length} bytes (at most {bulk.MAX_FRAME_BYTES})")
    body = bytearray(length)
    recv_exact(sock, memoryview(body))
    return kind, bytes(body)


def send_views(sock: socket.socket, views: Sequence[memoryview]) -> None:
    """Send every byte of ``views`` (``sendmsg``, resumed after a short send)."""
    wal_files.write_all(lambda pending, _: sock.sendmsg(pending), views)


M = TypeVar("M", bound=Message)


def parse_message(kind: type[M], body: bytes) -> M:
    """``body`` as a message of ``kind``; ValueError (not protobuf's own error) if it is not."""
    try:
        return kind.FromString(body)
    except DecodeError:
        raise ValueError(f"a malformed {kind.__name__} message") from None


def _answer(sock: socket.socket) -> pb.ReplicaAck:
    kind, body = recv_frame(sock)
    if kind == pb.REPLICA_FRAME_ACK:
        return parse_message(pb.ReplicaAck, body)
    if kind == pb.REPLICA_FRAME_ERROR:
        error = parse_message(pb.ChannelError, body)
        raise ReplicaError(f"the replica refused: {error.message}", error.code)
    raise ReplicaError(f"the replica answered a frame of kind {kind}")


class ReplicaLink:
    """The server's end: one shard's log mirrored to the replica at ``address``. Connects on
    first use and after a failure; the first request of a connection must be a snapshot
    (:meth:`put_snapshot`: a replica that came back may hold nothing). Not thread-safe: the
    log calls it under its lock."""

    def __init__(
        self,
        address: str,
        *,
        run_id: str,
        shard: int,
        secret: str,
        timeout: float = IO_SECONDS,
        resolve: Callable[[], str | None] | None = None,
    ) -> None:
        """``resolve``: asked before each connection for the replica's address now (a replica
        started again elsewhere, its node lost, reports a new one); None or "" keeps the
        last."""
        self.address = address
        self.host, self.port = split_address(address)
        self.resolve = resolve
        self.run_id, self.shard, self.secret, self.timeout = run_id, shard, secret, timeout
        self._sock: socket.socket | None = None
        self._seeded = False
        self._sent = False
        self.bytes_sent = 0

    def __repr__(self) -> str:
        return f"ReplicaLink({self.address}, shard {self.shard})"

    def _connect(self) -> socket.socket:
        if self._sock is not None:
            return self._sock
        self._resolve()
        try:
            sock = socket.create_connection((self.host, self.port), timeout=self.timeout)
        except OSError as exc:
            raise ReplicaError(f"replica {self.address} unreachable: {exc}") from None
        try:
            blocking(sock, self.timeout)
            challenge = bytearray(CHALLENGE_BYTES)
            recv_exact(sock, memoryview(challenge))
            ours = secrets.token_bytes(CHALLENGE_BYTES)
            hello = pb.ReplicaHello(
                protocol_version=pb.PROTOCOL_VERSION,
                run_id=self.run_id,
                shard=self.shard,
                proof=proof(self.secret, bytes(challenge)),
                challenge=ours,
            )
            send_frame(sock, pb.REPLICA_FRAME_HELLO, hello.SerializeToString())
            answer = _answer(sock)
            if not hmac.compare_digest(answer.proof, replica_proof(self.secret, ours)):
                raise ReplicaError(
                    f"{self.address} is no replica of this run (it cannot show the run secret)",
                    code=16,
                )
        except BaseException as exc:
            sock.close()
            # an OSError or ValueError: it closed, stalled, or answered nonsense
            if isinstance(exc, (OSError, ValueError)) and not isinstance(exc, ReplicaError):
                raise ReplicaError(f"replica {self.address}: {exc}") from None
            raise
        self._sock, self._seeded = sock, False
        return sock

    def _resolve(self) -> None:
        """Take the replica's address now from :attr:`resolve` (kept when it has none)."""
        if self.resolve is None:
            return
        try:
            address = self.resolve()
        except Exception as exc:  # the launcher not answering: try the last address
            log.debug("replica of shard %d: no address now (%s)", self.shard, exc)
            return
        if address and address != self.address:
            log.warning("replica of shard %d moved: %s -> %s", self.shard, self.address, address)
            self.address = address
            self.host, self.port = split_address(address)

    def _failed(self) -> None:
        if self._sock is not None:
            with contextlib.suppress(OSError):
                self._sock.close()
        self._sock, self._seeded, self._sent = None, False, False

    def _request(self, kind: int, message: bytes, views: Sequence[memoryview]) -> None:
        sock = self._connect()
        try:
            send_frame(sock, kind, message)
            send_views(sock, views)
        except (OSError, ValueError) as exc:
            self._failed()
            raise ReplicaError(f"replica {self.address}: {exc}") from None
        self.bytes_sent += sum(v.nbytes for v in views)
        self._sent = True

    def wait(self) -> pb.ReplicaAck:
        """The answer to the request sent last."""
        assert self._sock is not None and self._sent
        self._sent = False
        try:
            return _answer(self._sock)
        except (OSError, ValueError) as exc:
            self._failed()
            code = exc.code if isinstance(exc, ReplicaError) else UNAVAILABLE
            raise ReplicaError(f"replica {self.address}: {exc}", code) from None

    def put_snapshot(self, path: Path, generation: int, *, fresh: bool = False) -> None:
        """Send a generation's snapshot file (the replica then removes older ones) and wait."""
        with open(path, "rb") as f, memoryview_of(f) as view:
            header = pb.ReplicaFile(
                kind=pb.REPLICA_FILE_KIND_SNAPSHOT,
                generation=generation,
                length=view.nbytes,
                fresh=fresh,
            )
            self._request(pb.REPLICA_FRAME_FILE, header.SerializeToString(), [view])
            self.wait()
        self._seeded = True

    def send_record(
        self, generation: int, offset: int, head: memoryview, body: Sequence[memoryview]
    ) -> None:
        """Send one record (answered by :meth:`wait`); ReplicaError if the connection is new
        and not seeded yet (the log goes down, and its revival sends a snapshot)."""
        if not self._seeded:
            self._connect()  # a refusal says more than "not seeded"
            raise ReplicaError(f"replica {self.address} holds no snapshot of this log yet")
        write = pb.ReplicaWrite(
            generation=generation,
            offset=offset,
            length=head.nbytes + sum(v.nbytes for v in body),
            head=head.nbytes,
        )
        self._request(pb.REPLICA_FRAME_WRITE, write.SerializeToString(), [head, *body])

    def fetch(self, folder: Path) -> int:
        """Fill empty log ``folder`` with the replica's files (its newest snapshot and both log
        files); how many it sent (0: it holds nothing). ReplicaError if it cannot be reached.
        The files land in a temporary folder first and are moved in once the replica's answer
        says all came, the snapshot last: a fetch cut short leaves no snapshot (a recovery from
        a snapshot without its log would lose what the log held), so the next start fetches
        again."""
        make_private_dir(folder)
        staging = Path(tempfile.mkdtemp(dir=folder, prefix=".fetch-"))
        try:
            sock = self._connect()
            send_frame(sock, pb.REPLICA_FRAME_FETCH, b"")
            got: list[Path] = []
            while True:
                kind, body = recv_frame(sock)
                if kind == pb.REPLICA_FRAME_ACK:
                    break
                if kind != pb.REPLICA_FRAME_FILE:
                    raise ReplicaError(f"replica {self.address} answered a fetch with {kind}")
                header = parse_message(pb.ReplicaFile, body)
                got.append(receive_file(sock, header, staging, fetched=True))
            for path in sorted(got, key=lambda p: p.name.startswith("snapshot")):
                os.replace(path, folder / path.name)  # the logs, then the snapshot
            return len(got)
        except (OSError, ValueError) as exc:
            if isinstance(exc, ReplicaError):
                raise
            raise ReplicaError(f"replica {self.address}: fetch failed: {exc}") from None
        finally:
            self._failed()
            shutil.rmtree(staging, ignore_errors=True)

    def close(self) -> None:
        self._failed()


@contextlib.contextmanager
def memoryview_of(f: BinaryIO) -> Iterator[memoryview]:
    """A read-only map of open file ``f`` (empty files give an empty view)."""
    fileno = f.fileno()
    size = os.fstat(fileno).st_size
    if size == 0:
        yield memoryview(b"")
        return
    mapped = mmap.mmap(fileno, size, prot=mmap.PROT_READ)
    view = memoryview(mapped)
    try:
        yield view
    finally:
        view.release()
        mapped.close()


def _file_path(folder: Path, header: pb.ReplicaFile) -> Path:
    if header.kind == pb.REPLICA_FILE_KIND_SNAPSHOT and header.generation < MAX_GENERATION:
        return folder / f"snapshot-{header.generation:08d}.npz"
    if header.kind == pb.REPLICA_FILE_KIND_LOG and header.slot < 2:
        return folder / f"log-{header.slot}.wal"
    raise ValueError("a file must be a snapshot of a generation below 2^32 or log slot 0 or 1")


def receive_file(
    sock: socket.socket, header: pb.ReplicaFile, folder: Path, *, fetched: bool
) -> Path:
    """Write the ``header.length`` bytes that follow into its file (a temporary one renamed)."""
    path = _file_path(folder, header)
    if header.length >= MAX_END:
        raise ValueError(f"a file of {header.length} bytes is past the limit")
    if header.kind == pb.REPLICA_FILE_KIND_LOG and not fetched:
        raise ValueError("a server sends snapshots; log files travel only in a fetch's answer")
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".{path.name}.", suffix=".tmp")
    try:
        stream_to(sock, fd, 0, header.length)
        os.close(fd)
        fd = -1
        os.replace(tmp, path)
    finally:
        if fd >= 0:
            os.close(fd)
        Path(tmp).unlink(missing_ok=True)
    return path


_buffer = threading.local()


def stream_to(sock: socket.socket, fd: int, offset: int, length: int) -> None:
    """Copy ``length`` bytes from ``sock`` into file ``fd`` at ``offset``, a chunk at a time."""
    buf: np.ndarray | None = getattr(_buffer, "array", None)
    if buf is None:
        buf = _buffer.array = np.empty(CHUNK_BYTES, np.uint8)
    assert buf is not None
    done = 0
    while done < length:
        n = min(CHUNK_BYTES, length - done)
        view = buf[:n].data.cast("B")
        recv_exact(sock, view)
        written = 0
        while written < n:
            written += os.pwrite(fd, view[written:], offset + done + written)
        done += n


def newest_files(folder: Path) -> list[tuple[pb.ReplicaFile, Path]]:
    """What a fetch sends: the newest snapshot and the log files beside it."""
    found: list[tuple[pb.ReplicaFile, Path]] = []
    snapshots = generations(folder, SNAPSHOT)
    if not snapshots:
        return found
    newest = folder / f"snapshot-{snapshots[-1]:08d}.npz"
    kind = pb.REPLICA_FILE_KIND_SNAPSHOT
    found.append((pb.ReplicaFile(kind=kind, generation=snapshots[-1]), newest))
    for slot in range(2):
        path = log_path(folder, slot)
        if path.is_file():
            found.append((pb.ReplicaFile(kind=pb.REPLICA_FILE_KIND_LOG, slot=slot), path))
    return found


__all__ = [
    "ReplicaError",
    "ReplicaLink",
    "newest_files",
    "proof",
    "remove_before",
]
