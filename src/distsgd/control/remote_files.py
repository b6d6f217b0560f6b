"""A task's run folder over the network: the client of the launcher's run control.

A task whose launcher hands it a run control address (``TaskEnv.control``, ``distsgd server
--control``) writes and reads the run folder's files through it ("Run control" in the
``.proto``; the server is ``launcher/control.py``) instead of on its own disk, which another
host's launcher cannot see. :class:`RemoteFiles` is the :class:`~distsgd.control.folder.RunFiles`
of such a task; :func:`from_environ` picks it or the local folder.

Appended lines (the metrics) are buffered and sent by a thread of their own at most every
:data:`FLUSH_SECONDS`, so no training step waits for the network; a launcher that does not
answer drops them with one warning per outage, as a full disk does (the metrics must not end a
run). Every other call waits for its answer, with a deadline, and retries while the launcher
is unreachable (UNAVAILABLE) until the deadline; a refusal (a name the table does not allow, a
file over its size) raises :class:`ControlError` at once.
"""

from __future__ import annotations

import functools
import logging
import os
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import BinaryIO

import grpc

from distsgd.control.folder import LocalFiles, RunFiles, task_file
from distsgd.transport.errors import PROTOCOL_VERSION
from distsgd.transport.proto import distsgd_pb2 as pb
from distsgd.transport.proto import distsgd_pb2_grpc as pb_grpc
from distsgd.transport.security import METADATA_KEY, check_secret, load_secret

log = logging.getLogger(__name__)

CHUNK = (4 << 20) - (64 << 10)
"""Bytes of a file in one RunFileChunk (below gRPC's default 4 MiB message limit)."""
FLUSH_SECONDS = 0.25
"""How often buffered appends are sent."""
CALL_SECONDS = 30.0
"""Deadline of one call (retries of an unreachable launcher included); a large file's put gets
one second more per 8 MiB."""


class ControlError(RuntimeError):
    """A call on the launcher's run control failed: ``code`` is its gRPC status code
    (INVALID_ARGUMENT: a name or size the table refuses; UNAUTHENTICATED: a wrong secret;
    UNAVAILABLE or DEADLINE_EXCEEDED: the launcher did not answer in time)."""

    def __init__(self, address: str, what: str, exc: grpc.RpcError) -> None:
        code = exc.code() if hasattr(exc, "code") else grpc.StatusCode.UNKNOWN
        details = exc.details() if hasattr(exc, "details") else str(exc)
        super().__init__(f"{what} at the run control {address} failed ({code.name}): {details}")
        self.code = code


class RemoteFiles:
    """:class:`~distsgd.control.folder.RunFiles` through the run control at ``address``,
    presenting the run ``secret``."""

    def __init__(self, address: str, *, secret: str | None, timeout: float = CALL_SECONDS) -> None:
        self.address = address
        self.timeout = timeout
        self._channel = grpc.insecure_channel(address)
        self._stub = pb_grpc.RunControlStub(self._channel)
        self._metadata = ((METADATA_KEY, check_secret(secret)),) if secret else None
        self._header = pb.RequestHeader(protocol_version=PROTOCOL_VERSION, worker=-1)
        self._pending: dict[str, list[bytes]] = {}
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._closed = threading.Event()
        self._failing = False
        self.dropped = 0
        """Appended bytes dropped because the launcher did not answer."""
        self._sender = threading.Thread(target=self._send_loop, name="run-files", daemon=True)
        self._sender.start()

    def _call(self, what: str, call: Callable[..., object], seconds: float) -> object:
        """``call(timeout=remaining)`` until it answers, retrying UNAVAILABLE until ``seconds``
        passed."""
        deadline = time.monotonic() + seconds
        while True:
            remaining = deadline - time.monotonic()
            try:
                return call(timeout=max(0.1, remaining))
            except grpc.RpcError as exc:
                code = exc.code() if hasattr(exc, "code") else None
                if code != grpc.StatusCode.UNAVAILABLE or remaining <= 0.5:
                    raise ControlError(self.address, what, exc) from None
            time.sleep(min(0.5, max(0.0, deadline - time.monotonic())))

    def append(self, name: str, data: bytes) -> None:
        if not task_file(name).append:
            raise ValueError(f"{name} is replaced, not appended to")
        with self._lock:
            self._pending.setdefault(name, []).append(bytes(data))
        if len(data) > CHUNK:  # a large one goes now, not at the next flush
            self._wake.set()

    def put(self, name: str, data: bytes) -> None:
        self._put(name, iter([data]), len(data))

    def put_stream(self, name: str, write: Callable[[BinaryIO], object]) -> None:
        """Written to a temporary file on this disk first, then sent in chunks."""
        with tempfile.TemporaryFile(prefix="distsgd-put-") as f:
            write(f)
            size = f.tell()
            f.seek(0)
            self._put(name, iter(lambda: f.read(CHUNK), b""), size)

    def _put(self, name: str, blocks: Iterator[bytes], size: int) -> None:
        entry = task_file(name)
        if size > entry.limit:
            raise ValueError(f"{name}: {size} bytes, over the {entry.limit} it may have")
        mode = pb.RUN_FILE_WRITE_APPEND if entry.append else pb.RUN_FILE_WRITE_REPLACE
        seconds = self.timeout + size / (8 << 20)
        if size > CHUNK:  # a stream read once: no retry
            try:
                self._sender_of(name, mode, blocks)(seconds)
            except grpc.RpcError as exc:
                raise ControlError(self.address, f"put {name}", exc) from None
            return
        self._call(f"put {name}", self._sender_of(name, mode, list(blocks)), seconds)

    def get(self, name: str) -> bytes | None:
        if not task_file(name).readable:
            raise ValueError(f"{name} is not a file a task reads back")
        request = pb.RunFileChunk(header=self._header, name=name)

        def call(timeout: float) -> bytes | None:
            parts, found = [], True
            for chunk in self._stub.GetFile(request, timeout=timeout, metadata=self._metadata):
                found = found and chunk.found
                parts.append(chunk.data)
            return b"".join(parts) if found else None

        return self._call(f"get {name}", call, self.timeout)  # type: ignore[return-value]

    def remove(self, name: str) -> None:
        task_file(name)
        request = pb.RunFileChunk(header=self._header, name=name)
        remove = functools.partial(self._stub.RemoveFile, request, metadata=self._metadata)
        self._call(f"remove {name}", remove, self.timeout)

    def flush(self) -> None:
        """Send the buffered appends now (dropped, with a warning, if the launcher does not
        answer)."""
        with self._lock:
            pending, self._pending = self._pending, {}
        for name, parts in pending.items():
            data = b"".join(parts)
            try:
                append = self._sender_of(name, pb.RUN_FILE_WRITE_APPEND, [data])
                self._call(f"append to {name}", append, self.timeout)
            except ControlError as exc:
                self.dropped += len(data)
                if not self._failing:
                    log.warning("run control: %s; lines dropped until it answers", exc)
                self._failing = True
                continue
            if self._failing:
                log.warning("run control answers again (%d bytes dropped)", self.dropped)
            self._failing = False

    def _sender_of(
        self, name: str, mode: pb.RunFileWrite, blocks: Iterable[bytes]
    ) -> Callable[[float], object]:
        """The call that writes ``blocks`` to ``name`` (a list: again on each retry), each
        block in chunks of at most :data:`CHUNK`."""

        def messages() -> Iterator[pb.RunFileChunk]:
            yield pb.RunFileChunk(header=self._header, name=name, write=mode)
            for block in blocks:
                for start in range(0, len(block), CHUNK):
                    yield pb.RunFileChunk(data=block[start : start + CHUNK])
            yield pb.RunFileChunk(last=True)  # the stream is whole (see the .proto)

        return lambda timeout: self._stub.PutFile(
            messages(), timeout=timeout, metadata=self._metadata
        )

    def _send_loop(self) -> None:
        while not self._closed.is_set():
            self._wake.wait(FLUSH_SECONDS)
            self._wake.clear()
            self.flush()

    def close(self) -> None:
        """Send what is buffered, stop the sender, close the channel."""
        if self._closed.is_set():
            return
        self._closed.set()
        self._wake.set()
        self._sender.join(timeout=self.timeout + 1)
        self.flush()
        self._channel.close()


def from_environ(
    run_dir: str | Path = "", control: str = "", environ: Mapping[str, str] | None = None
) -> RunFiles | None:
    """A task's run folder: through the run control at ``control`` when given, with the run
    secret of ``environ`` (default: this process's), else the folder ``run_dir`` on this disk,
    else None (a task that writes no run folder)."""
    if control:
        return RemoteFiles(control, secret=load_secret(os.environ if environ is None else environ))
    if run_dir:
        return LocalFiles(Path(run_dir))
    return None
