"""The replica's end of a log replica (:mod:`distsgd.ps.replica`): one shard's log files kept
in a folder on this host, written as the server's own are; ``distsgd server --job replica``.

One connection is served at a time: a new one (the server restarted, or reconnected after a
failure) ends the one before it. Every request is checked before a byte of it is written
(the limits are in the .proto's "Log replica"); a request that fails a check is answered
``REPLICA_FRAME_ERROR`` and the connection closed. Torch-free: bytes, sockets and files.
"""

from __future__ import annotations

import contextlib
import hmac
import logging
import os
import secrets
import select
import socket
import threading
from collections.abc import Callable
from pathlib import Path

from distsgd.ps.replica import (
    CHALLENGE_BYTES,
    IO_SECONDS,
    MAX_END,
    MAX_GENERATION,
    blocking,
    memoryview_of,
    newest_files,
    parse_message,
    proof,
    receive_file,
    recv_exact,
    recv_frame,
    replica_proof,
    send_frame,
    send_views,
    split_address,
    stream_to,
)
from distsgd.ps.wal_files import log_path, make_private_dir, remove_before
from distsgd.transport.proto import distsgd_pb2 as pb
from distsgd.util import write_atomic
from distsgd.util.signals import stopping

log = logging.getLogger(__name__)

UNAUTHENTICATED, FAILED_PRECONDITION, INVALID_ARGUMENT = 16, 9, 3
MAX_HEAD = 4096
"""The most bytes a record's header may take (a log's is 64)."""


class Refused(ValueError):
    """A request the replica will not serve: its code and one-line message."""

    def __init__(self, message: str, code: int = INVALID_ARGUMENT) -> None:
        super().__init__(message)
        self.code = code


class ReplicaStore:
    """The files of one shard's replicated log, and the log file being written."""

    def __init__(self, folder: Path) -> None:
        make_private_dir(folder)
        self.folder = folder
        self.generation: int | None = None
        """The generation whose log file is open (None: none yet on this connection)."""
        self._fd = -1
        self.records = 0

    def snapshot(self, sock: socket.socket, header: pb.ReplicaFile) -> int:
        """A generation's snapshot from the server: written, older ones removed."""
        if header.kind != pb.REPLICA_FILE_KIND_SNAPSHOT:
            raise Refused("a server sends snapshots; log files travel only in a fetch's answer")
        receive_file(sock, header, self.folder, fetched=False)
        if header.fresh:
            for slot in range(2):
                with contextlib.suppress(FileNotFoundError):
                    os.truncate(log_path(self.folder, slot), 0)
        remove_before(self.folder, header.generation)
        return int(header.length)

    def _open(self, generation: int) -> None:
        if self._fd >= 0:
            os.close(self._fd)
        flags = os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC
        self._fd = os.open(log_path(self.folder, generation), flags, 0o600)
        self.generation = generation

    def write(self, sock: socket.socket, write: pb.ReplicaWrite) -> int:
        """One record: its body at ``offset + head``, then its header at ``offset``."""
        if write.generation >= MAX_GENERATION or write.offset + write.length >= MAX_END:
            raise Refused("a record's generation or end is past the limits")
        if write.head > min(write.length, MAX_HEAD) or write.head == 0:
            raise Refused(f"a record's head of {write.head} bytes does not fit {write.length}")
        if write.generation != self.generation:
            self._open(int(write.generation))
        head = bytearray(write.head)
        recv_exact(sock, memoryview(head))
        stream_to(sock, self._fd, write.offset + write.head, write.length - write.head)
        os.pwrite(self._fd, head, write.offset)
        self.records += 1
        return int(write.length)

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        self.generation = None


class ReplicaServer:
    """Keeps shard ``shard``'s log for the run ``run_id`` in ``folder``, listening on
    ``host:port`` (port 0: any; :attr:`address` is the bound one)."""

    def __init__(
        self, folder: Path, *, host: str, port: int, run_id: str, shard: int, secret: str
    ) -> None:
        self.store = ReplicaStore(Path(folder))
        self.run_id, self.shard, self._secret = run_id, shard, secret
        self._listener = socket.create_server((host, port), reuse_port=False)
        self._listener.settimeout(0.2)
        bound = self._listener.getsockname()
        self.address = f"{host}:{bound[1]}"
        self._stop = threading.Event()
        self._current: socket.socket | None = None
        self._lock = threading.Lock()
        self._serving = threading.Lock()
        self.refused = 0
        self._thread = threading.Thread(target=self._accept, name="replica-accept", daemon=True)

    def start(self) -> ReplicaServer:
        self._thread.start()
        return self

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                sock, peer = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            threading.Thread(
                target=self._serve, args=(sock, peer), name="replica-conn", daemon=True
            ).start()

    def _serve(self, sock: socket.socket, peer: object) -> None:
        with contextlib.closing(sock):
            try:
                blocking(sock, IO_SECONDS)
                self._hello(sock)  # only a peer that showed the secret ends the one served now
                with self._lock:
                    if self._current is not None:
                        with contextlib.suppress(OSError):
                            self._current.shutdown(socket.SHUT_RDWR)
                    self._current = sock
                with self._serving:  # once the one before has let go of the files
                    try:
                        while self._wait_for_request(sock):
                            self._one(sock)
                    finally:
                        self.store.close()
            except Refused as exc:
                self.refused += 1
                log.warning("replica of shard %d: refused %s: %s", self.shard, peer, exc)
                error = pb.ChannelError(code=exc.code, message=str(exc))
                with contextlib.suppress(OSError):
                    send_frame(sock, pb.REPLICA_FRAME_ERROR, error.SerializeToString())
            except (OSError, ValueError) as exc:  # the server went, or a malformed frame
                log.debug(
                    "replica of shard %d: connection from %s ended: %s", self.shard, peer, exc
                )

    def _wait_for_request(self, sock: socket.socket) -> bool:
        """Wait (as long as the server likes) for the next request's first byte; False once
        the replica stops."""
        while not self._stop.is_set():
            readable, _, _ = select.select([sock], [], [], 0.2)
            if readable:
                return True
        return False

    def _hello(self, sock: socket.socket) -> None:
        challenge = secrets.token_bytes(CHALLENGE_BYTES)
        sock.sendall(challenge)
        kind, body = recv_frame(sock)
        if kind != pb.REPLICA_FRAME_HELLO:
            raise Refused(f"a connection must begin with a hello, not a frame of kind {kind}")
        hello = parse_message(pb.ReplicaHello, body)
        if not hmac.compare_digest(hello.proof, proof(self._secret, challenge)):
            raise Refused("wrong run secret (the hello's proof)", UNAUTHENTICATED)
        if hello.protocol_version != pb.PROTOCOL_VERSION:
            raise Refused(
                f"protocol version {hello.protocol_version}; this replica speaks "
                f"{pb.PROTOCOL_VERSION}",
                FAILED_PRECONDITION,
            )
        if hello.run_id != self.run_id or hello.shard != self.shard:
            raise Refused(
                f"this replica keeps shard {self.shard} of run {self.run_id}, not shard "
                f"{hello.shard} of run {hello.run_id}",
                FAILED_PRECONDITION,
            )
        if len(hello.challenge) != CHALLENGE_BYTES:
            raise Refused(f"a hello's challenge must be {CHALLENGE_BYTES} bytes")
        self._ack(sock, 0, replica_proof(self._secret, hello.challenge))

    def _ack(self, sock: socket.socket, nbytes: int, answer: bytes = b"") -> None:
        ack = pb.ReplicaAck(generation=self.store.generation or 0, written=nbytes, proof=answer)
        send_frame(sock, pb.REPLICA_FRAME_ACK, ack.SerializeToString())

    def _one(self, sock: socket.socket) -> None:
        """Serve one request."""
        kind, body = recv_frame(sock)
        try:
            if kind == pb.REPLICA_FRAME_WRITE:
                written = self.store.write(sock, parse_message(pb.ReplicaWrite, body))
            elif kind == pb.REPLICA_FRAME_FILE:
                written = self.store.snapshot(sock, parse_message(pb.ReplicaFile, body))
            elif kind == pb.REPLICA_FRAME_FETCH:
                written = self._send_files(sock)
            else:
                raise Refused(f"a frame of kind {kind} is not a request")
        except Refused:
            raise
        except ValueError as exc:  # a message whose bytes do not parse, or out of limits
            raise Refused(str(exc)) from None
        self._ack(sock, written)

    def _send_files(self, sock: socket.socket) -> int:
        files = newest_files(self.store.folder)
        for header, path in files:
            with open(path, "rb") as f, memoryview_of(f) as view:
                header.length = view.nbytes
                send_frame(sock, pb.REPLICA_FRAME_FILE, header.SerializeToString())
                send_views(sock, [view])
        return len(files)

    def close(self) -> None:
        self._stop.set()
        with contextlib.suppress(OSError):
            self._listener.close()
        with self._lock:
            if self._current is not None:
                with contextlib.suppress(OSError):
                    self._current.shutdown(socket.SHUT_RDWR)
        self._thread.join(timeout=2.0)


def serve_replica(
    folder: Path,
    *,
    address: str,
    shard: int,
    run_id: str,
    secret: str,
    address_file: Path | None = None,
    stop: threading.Event | None = None,
    announce: Callable[[str], None] | None = None,
) -> None:
    """Keep shard ``shard``'s log in ``folder``, listening on ``address`` (port 0: any; the
    bound address goes to ``address_file`` and to ``announce``, the launcher's run control),
    until SIGINT/SIGTERM or ``stop``."""
    stop = stop or threading.Event()
    with stopping(stop):
        host, port = split_address(address)
        server = ReplicaServer(
            folder, host=host, port=port, run_id=run_id, shard=shard, secret=secret
        ).start()
        try:
            log.info("replica of shard %d listening on %s (%s)", shard, server.address, folder)
            if address_file is not None:
                write_atomic(address_file, server.address + "\n")
            if announce is not None:
                announce(server.address)
            stop.wait()
        finally:
            server.close()
