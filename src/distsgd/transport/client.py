"""A client for one parameter-server shard: every call has a deadline, transient failures retry.

Retries cover what a healthy cluster shows at start-up and under load: a server not listening
yet (UNAVAILABLE) and a shard the chief has not registered yet. They back off exponentially and
give up at ``retry_seconds`` with the last error.
"""

from __future__ import annotations

import contextlib
import ipaddress
import logging
import math
import socket
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TypeVar

import grpc
import numpy as np
from google.protobuf.message import Message

from distsgd.transport import bulk, shm
from distsgd.transport.codec import (
    CHUNK_BYTES,
    ChunkAssembler,
    dtype_name,
    iter_chunks,
    specs_of,
    wire_dtype,
)
from distsgd.transport.errors import (
    MAX_WAIT_SECONDS,
    PROTOCOL_VERSION,
    PushReject,
    Refusal,
    RemoteError,
)
from distsgd.transport.proto import distsgd_pb2 as pb
from distsgd.transport.proto import distsgd_pb2_grpc as pb_grpc
from distsgd.transport.security import (
    METADATA_KEY,
    TlsConfig,
    channel_credentials,
    check_secret,
)

log = logging.getLogger(__name__)

MAX_RETRY_DELAY = 0.5
"""Longest wait between two tries of a failed call: a restarted server listens again within a
second, so a longer wait would be the larger part of a restart's cost."""
T = TypeVar("T")
M = TypeVar("M", bound=Message)

GRPC_OPTIONS = [
    ("grpc.max_send_message_length", 8 * CHUNK_BYTES),
    ("grpc.max_receive_message_length", 8 * CHUNK_BYTES),
]


SHM_GIVE_UP = 3
"""Failed shared-memory calls after which a client sends everything over the stream."""


def is_local_address(address: str) -> bool:
    """Whether ``host:port`` names this machine: a loopback address, or one a local socket can
    bind to (so it belongs to one of this host's interfaces)."""
    host = address.rsplit(":", 1)[0].strip("[]")
    if host in ("localhost", socket.gethostname()):
        return True
    try:
        infos = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
    except OSError:
        return False
    for family, _, _, _, sockaddr in infos:
        ip = str(sockaddr[0])
        if ipaddress.ip_address(ip).is_loopback:
            return True
        with contextlib.suppress(OSError), socket.socket(family, socket.SOCK_DGRAM) as probe:
            probe.bind((ip, 0))
            return True
    return False


@dataclass
class _SharedChannel:
    """A confirmed segment on the server (where each piece's pull and push bytes live), or a
    tensor socket (``segment`` None; ``pull`` then holds this client's own buffers, ``push``
    the pieces' shapes and dtypes). ``sock``: the data channel its requests travel on (a
    segment's is optional: without one they are gRPC calls)."""

    id: int
    segment: shm.Segment | None
    pull: dict[str, np.ndarray]
    push: dict[str, np.ndarray]
    sock: socket.socket | None = None

    def close(self) -> None:
        if self.segment is not None:
            self.segment.close()
        if self.sock is not None:
            with contextlib.suppress(OSError):
                self.sock.close()


@dataclass(frozen=True)
class PushResult:
    """What a shard did with a push: ``reject`` says why it was not applied (typed; decide on
    it), ``reason`` in words (for people)."""

    accepted: bool
    version: int
    reason: str = ""
    reject: PushReject = PushReject.NONE


class ShardClient:
    """Calls on one parameter-server shard at ``address``.

    ``secret`` (the run secret; None or "" = none) travels as call metadata on every RPC.
    ``tls`` makes the channel mutual TLS: the server's certificate must be signed by ``tls.ca``
    and name the host in ``address``; ``tls.cert`` is presented as the client certificate.
    """

    def __init__(
        self,
        address: str,
        *,
        worker: int = -1,
        incarnation: int = 0,
        run_id: str = "",
        timeout: float = 30.0,
        retry_seconds: float = 60.0,
        chunk_bytes: int = CHUNK_BYTES,
        secret: str | None = None,
        tls: TlsConfig | None = None,
        shared_memory: bool = False,
        tensor_socket: bool = False,
    ) -> None:
        """``shared_memory``: move tensor bytes through a shared-memory segment when the server
        is on this host; ``tensor_socket``: otherwise through a plain TCP connection (never with
        TLS). Each is tried at the first pull or push and falls back to the stream."""
        self.address = address
        self.timeout = timeout
        self.retry_seconds = retry_seconds
        self.chunk_bytes = chunk_bytes
        self._header = pb.RequestHeader(
            protocol_version=PROTOCOL_VERSION, run_id=run_id, worker=worker, incarnation=incarnation
        )
        self.server_incarnation = 0
        """The server process last seen (0 = none yet); it changes when the server restarts."""
        self.last_waited = 0.0
        """Seconds the server spent waiting for ``min_version`` in the last pull (its report,
        clamped to the pull's own duration)."""
        self._metadata: tuple[tuple[str, str], ...] | None = (
            ((METADATA_KEY, check_secret(secret)),) if secret else None
        )
        self._channel = (
            grpc.secure_channel(address, channel_credentials(tls), options=GRPC_OPTIONS)
            if tls is not None
            else grpc.insecure_channel(address, options=GRPC_OPTIONS)
        )
        self._stub = pb_grpc.ParameterServerStub(self._channel)
        self._shared: _SharedChannel | None = None
        self._host = address.rsplit(":", 1)[0].strip("[]")
        self._socket_ok = tensor_socket and tls is None
        self._use_shm = shared_memory and shm.available() and is_local_address(address)
        self._shm_failures = 0 if self._use_shm or self._socket_ok else SHM_GIVE_UP

    @property
    def uses_shared_memory(self) -> bool:
        """Whether tensors currently move through a shared-memory segment."""
        return self._shared is not None and self._shared.segment is not None

    @property
    def uses_tensor_socket(self) -> bool:
        """Whether tensors currently move through a tensor socket."""
        return self._shared is not None and self._shared.segment is None

    def close(self) -> None:
        self._drop_shared()
        self._channel.close()

    # -- shared memory --------------------------------------------------------------------------
    def _drop_shared(self) -> None:
        """Abandon the segment (after a failed call the server may still be using it)."""
        channel, self._shared = self._shared, None
        if channel is not None:
            channel.close()

    def _shm_failed(self, why: object) -> None:
        self._drop_shared()
        self._shm_failures += 1
        if self._shm_failures >= SHM_GIVE_UP:
            log.info("%s: tensors go over the stream from now on (%s)", self.address, why)

    def _shared_channel(self) -> _SharedChannel | None:
        """The confirmed segment, attaching one first if none; None when shared memory is off,
        unavailable, or just failed (the call then goes over the stream)."""
        if self._shared is not None or self._shm_failures >= SHM_GIVE_UP:
            return self._shared
        if not self._use_shm:
            return self._attach_socket()
        header = self._header
        try:
            reply = self._stub.Attach(
                pb.AttachRequest(header=header), timeout=self.timeout, metadata=self._metadata
            )
        except grpc.RpcError as exc:
            self._shm_failed(_remote_error(self.address, "Attach", exc))
            return None
        try:
            segment = shm.Segment.open(reply.name, reply.size)
        except shm.SegmentError as exc:  # another host, or another /dev/shm (containers)
            with contextlib.suppress(grpc.RpcError):
                self._stub.Attach(
                    pb.AttachRequest(header=header, confirm=reply.segment, cancel=True),
                    timeout=self.timeout,
                    metadata=self._metadata,
                )
            self._use_shm = False
            if not self._socket_ok:
                self._shm_failures = SHM_GIVE_UP
            log.info("%s: shared memory not reachable (%s)", self.address, exc)
            return self._attach_socket()
        try:
            if not (len(reply.tensors) == len(reply.pull_offsets) == len(reply.push_offsets)):
                raise shm.SegmentError(0, "the layout lists different numbers of offsets")
            views: tuple[dict[str, np.ndarray], dict[str, np.ndarray]] = ({}, {})
            for spec, pull_at, push_at in zip(
                reply.tensors, reply.pull_offsets, reply.push_offsets, strict=True
            ):
                dtype, shape = wire_dtype(spec.dtype, spec.key), tuple(spec.shape)
                views[0][spec.key] = segment.array(pull_at, dtype, shape)
                views[1][spec.key] = segment.array(push_at, dtype, shape)
            done = self._stub.Attach(
                pb.AttachRequest(header=header, confirm=reply.segment, nonce=segment.nonce),
                timeout=self.timeout,
                metadata=self._metadata,
            )
            if not done.confirmed:
                raise shm.SegmentError(0, "the server did not confirm the segment")
        except (shm.SegmentError, ValueError, grpc.RpcError) as exc:
            segment.close()
            self._shm_failed(exc)
            return None
        self._shared = _SharedChannel(reply.segment, segment, *views)
        if reply.port:  # the requests on a data channel, or by gRPC if it cannot be opened
            try:
                self._shared.sock = self._connect(reply)
            except (OSError, ValueError, bulk.SocketClosed) as exc:
                log.debug("%s: no data channel (%s); requests by gRPC", self.address, exc)
        log.debug("%s: tensors through shared memory (%d bytes)", self.address, reply.size)
        return self._shared

    def _connect(self, reply: pb.AttachResponse) -> socket.socket:
        """The data channel an Attach answer offers."""
        if not 0 < reply.port < 65536 or len(reply.token) != bulk.TOKEN_BYTES:
            raise ValueError("the server's data channel answer is malformed")
        return bulk.connect(self._host, reply.port, reply.segment, reply.token, self.timeout)

    def _attach_socket(self) -> _SharedChannel | None:
        """A tensor socket to the server, or None (not offered, or failed: the stream then)."""
        if not self._socket_ok:
            return None
        try:
            reply = self._stub.Attach(
                pb.AttachRequest(header=self._header, socket=True),
                timeout=self.timeout,
                metadata=self._metadata,
            )
        except grpc.RpcError as exc:
            self._shm_failed(_remote_error(self.address, "Attach", exc))
            return None
        try:
            pull: dict[str, np.ndarray] = {}
            push: dict[str, np.ndarray] = {}
            total = 0
            for spec in reply.tensors:
                dtype = wire_dtype(spec.dtype, spec.key)
                shape = tuple(spec.shape)
                if any(d < 0 for d in shape):
                    raise ValueError(f"{spec.key}: negative dimension")
                total += int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
                if total > 64 << 30:
                    raise ValueError("the server announces more than 64 GiB of pieces")
                pull[spec.key] = np.empty(shape, dtype)
                push[spec.key] = pull[spec.key]
            sock = self._connect(reply)
        except (OSError, ValueError, bulk.SocketClosed) as exc:
            self._shm_failed(exc)
            return None
        self._shared = _SharedChannel(reply.segment, None, pull, push, sock)
        log.debug("%s: tensors through a tensor socket (port %d)", self.address, reply.port)
        return self._shared

    def _pull_shared(
        self, channel: _SharedChannel, min_version: int, wait: float
    ) -> tuple[int, dict[str, np.ndarray]] | None:
        """A pull through the segment: (version, views of the pull area), or None after a
        failure that the stream should retry."""
        began = time.monotonic()
        request = pb.PullRequest(
            header=self._header,
            min_version=min_version,
            wait_seconds=wait,
            server_incarnation=self.server_incarnation,
            segment=channel.id,
        )
        try:
            if channel.sock is None:
                reply = self._stub.PullShared(
                    request, timeout=wait + self.timeout, metadata=self._metadata
                )
            else:
                reply = self._pull_channel(channel, request, wait)
        except bulk.SocketClosed as exc:
            self._shm_failed(exc)
            return None
        except (grpc.RpcError, RemoteError) as exc:
            err = _as_remote_error(self.address, "PullShared", exc)
            if err.code == grpc.StatusCode.DEADLINE_EXCEEDED and err.refusal is None:
                self._drop_shared()  # the server may write it later: never read it again
                raise err from None
            self._shm_failed(err)
            return None
        if not reply.in_segment or [t.key for t in reply.tensors] != list(channel.pull):
            self._shm_failed("the server answered a pull outside the segment")
            return None
        self.server_incarnation = reply.server_incarnation
        self.last_waited = _waited(reply.waited_seconds, time.monotonic() - began)
        self._shm_failures = 0
        return reply.version, channel.pull

    def _channel_call(
        self,
        channel: _SharedChannel,
        kind: int,
        request: Message,
        deadline: float,
        payload: Sequence[np.ndarray] = (),
    ) -> bytes:
        """Send a request frame (and ``payload``'s bytes) on the data channel and read the
        answer frame of the same kind: its bytes. :class:`RemoteError` for an error frame,
        :class:`~distsgd.transport.bulk.SocketClosed` for anything else."""
        assert channel.sock is not None
        bulk.check_open(channel.sock)
        left = max(0.001, deadline - time.monotonic())
        try:
            bulk.send_frame(channel.sock, kind, request.SerializeToString(), left)
            if payload:
                bulk.send_arrays(channel.sock, payload, left)
        except OSError as exc:  # the server closed it: its error frame may say why
            log.debug("%s: data channel send failed: %s", self.address, exc)
        got, body = bulk.recv_frame(channel.sock, deadline=deadline)
        if got == pb.CHANNEL_FRAME_ERROR:
            error = _parse(pb.ChannelError, body)
            method = "PullShared" if kind == pb.CHANNEL_FRAME_PULL else "PushShared"
            code = _STATUS_CODES.get(error.code, grpc.StatusCode.UNKNOWN)
            raise RemoteError(
                self.address, method, code, error.message, Refusal.named(error.refusal)
            )
        if got != kind:
            raise bulk.SocketClosed(f"a frame of kind {got} answered a request of kind {kind}")
        return body

    def _pull_channel(
        self, channel: _SharedChannel, request: pb.PullRequest, wait: float
    ) -> pb.PullHeader:
        """PullShared on the data channel; a tensor socket's bytes follow the answer."""
        assert channel.sock is not None
        deadline = time.monotonic() + wait + self.timeout
        body = self._channel_call(channel, pb.CHANNEL_FRAME_PULL, request, deadline)
        reply = _parse(pb.PullHeader, body)
        if channel.segment is None:
            for array in channel.pull.values():
                bulk.recv_into(channel.sock, array.reshape(-1).view(np.uint8), deadline=deadline)
        return reply

    def __enter__(self) -> ShardClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- plumbing -------------------------------------------------------------------------------
    def _call(self, method: str, fn: Callable[[], T], *, retry: bool = True) -> T:
        give_up = time.monotonic() + self.retry_seconds
        delay = 0.05
        while True:
            try:
                return fn()
            except grpc.RpcError as exc:
                err = _remote_error(self.address, method, exc)
                if not (retry and err.retryable) or time.monotonic() + delay > give_up:
                    raise err from None
                log.debug("%s; retrying in %.2fs", err, delay)
                time.sleep(delay)
                delay = min(delay * 2, MAX_RETRY_DELAY)

    # -- RPCs -----------------------------------------------------------------------------------
    def info(self, *, retry: bool = True) -> pb.InfoResponse:
        """The shard's state (registered, version, pieces, membership counters)."""
        request = pb.InfoRequest(header=self._header)
        return self._call(
            "Info",
            lambda: self._stub.Info(request, timeout=self.timeout, metadata=self._metadata),
            retry=retry,
        )

    def register(
        self,
        *,
        shard_index: int,
        scheme: str,
        options_json: str,
        num_workers: int,
        tensors: Mapping[str, np.ndarray],
        work: pb.WorkSpec | None = None,
    ) -> pb.RegisterResponse:
        """Hand the shard its pieces, their initial values and its update rule (and ``work``,
        the work units it hands out: shard 0 of an elastic run, protocol 5)."""
        header = pb.RegisterHeader(
            header=self._header,
            scheme=scheme,
            options_json=options_json,
            num_workers=num_workers,
            tensors=specs_of(tensors),
            shard_index=shard_index,
            work=work,
        )
        arrays = list(tensors.values())

        def messages() -> Iterator[pb.RegisterRequest]:
            yield pb.RegisterRequest(header=header)
            for chunk in iter_chunks(arrays, self.chunk_bytes):
                yield pb.RegisterRequest(chunk=chunk)

        return self._call(
            "Register",
            lambda: self._stub.Register(messages(), timeout=self.timeout, metadata=self._metadata),
        )

    def pull(
        self, *, min_version: int = 0, wait_seconds: float | None = None
    ) -> tuple[int, dict[str, np.ndarray]]:
        """The shard's pieces once its version is at least ``min_version``: (version, arrays).

        Through shared memory the arrays are views of the segment, valid until this client's
        next call: copy what you keep.

        A server that restarted (from a checkpoint) answers at once whatever ``min_version``:
        the versions the caller counted belong to the lost process. ``wait_seconds`` (default:
        the RPC timeout) is capped at ``MAX_WAIT_SECONDS``, as the server would cap it.
        """
        wait = self.timeout if wait_seconds is None else wait_seconds
        if math.isnan(wait) or wait < 0:
            raise ValueError(f"wait_seconds must be 0 or more, got {wait}")
        wait = min(wait, MAX_WAIT_SECONDS)
        channel = self._shared_channel()
        if channel is not None:
            shared = self._pull_shared(channel, min_version, wait)
            if shared is not None:
                return shared

        def do() -> tuple[int, dict[str, np.ndarray]]:
            began = time.monotonic()
            request = pb.PullRequest(
                header=self._header,
                min_version=min_version,
                wait_seconds=wait,
                server_incarnation=self.server_incarnation,
            )
            stream = self._stub.Pull(request, timeout=wait + self.timeout, metadata=self._metadata)
            first = next(stream)
            if first.WhichOneof("part") != "header":
                raise RemoteError(self.address, "Pull", grpc.StatusCode.INTERNAL, "no header first")
            assembler = ChunkAssembler(first.header.tensors)
            for message in stream:
                assembler.add(message.chunk)
            arrays = assembler.finish()
            self.server_incarnation = first.header.server_incarnation
            self.last_waited = _waited(first.header.waited_seconds, time.monotonic() - began)
            return first.header.version, arrays

        return self._call("Pull", do)

    def push(
        self, *, base_version: int, tensors: Mapping[str, np.ndarray], lr_scale: float = 1.0
    ) -> PushResult:
        """Send a gradient or update computed on parameters of ``base_version``.

        Not retried on a lost connection: the server may have applied it already.
        """
        channel = self._shared_channel()
        if channel is not None and all(
            key in channel.push
            and channel.push[key].shape == np.shape(array)
            and channel.push[key].dtype == np.asarray(array).dtype
            for key, array in tensors.items()
        ):
            if channel.segment is None:
                return self._push_socket(
                    channel,
                    base_version,
                    specs_of(tensors),
                    list(tensors.values()),
                    lr_scale,
                    again=tensors,
                )
            return self._push_shared(channel, base_version, tensors, lr_scale)
        header = pb.PushHeader(
            header=self._header,
            base_version=base_version,
            tensors=specs_of(tensors),
            lr_scale=lr_scale,
        )
        return self._send_stream(header, list(tensors.values()))

    def push_encoded(
        self,
        *,
        base_version: int,
        pieces: Mapping[str, tuple[pb.TensorSpec, Sequence[np.ndarray]]],
        lr_scale: float = 1.0,
    ) -> PushResult:
        """Push pieces already encoded (see "Encodings" in the .proto): each key maps to its
        spec (registered dtype and shape, ``encoding``, ``scale``, ``nnz``) and the 1-D arrays
        whose bytes, back to back, are its payload. Not retried on a lost connection."""
        specs = [spec for spec, _ in pieces.values()]
        payloads = [_as_bytes(parts) for _, parts in pieces.values()]
        channel = self._shared_channel()
        if (
            channel is not None
            and channel.segment is None
            and all(key in channel.push for key in pieces)
        ):
            return self._push_socket(channel, base_version, specs, payloads, lr_scale, again=pieces)
        if channel is not None and all(
            key in channel.push and payload.size <= channel.push[key].nbytes
            for key, payload in zip(pieces, payloads, strict=True)
        ):
            for key, payload in zip(pieces, payloads, strict=True):
                area = channel.push[key].reshape(-1).view(np.uint8)
                area[: payload.size] = payload
            header = pb.PushHeader(
                header=self._header,
                base_version=base_version,
                tensors=specs,
                lr_scale=lr_scale,
                segment=channel.id,
            )
            return self._send_shared(channel, header, base_version, pieces, lr_scale)
        header = pb.PushHeader(
            header=self._header, base_version=base_version, tensors=specs, lr_scale=lr_scale
        )
        return self._send_stream(header, payloads)

    def _send_stream(self, header: pb.PushHeader, arrays: Sequence[np.ndarray]) -> PushResult:
        def messages() -> Iterator[pb.PushRequest]:
            yield pb.PushRequest(header=header)
            for chunk in iter_chunks(arrays, self.chunk_bytes):
                yield pb.PushRequest(chunk=chunk)

        reply = self._call(
            "Push",
            lambda: self._stub.Push(messages(), timeout=self.timeout, metadata=self._metadata),
            retry=False,
        )
        return _push_result(reply)

    def _send_shared(
        self,
        channel: _SharedChannel,
        header: pb.PushHeader,
        base_version: int,
        again: Mapping[str, tuple[pb.TensorSpec, Sequence[np.ndarray]]] | Mapping[str, np.ndarray],
        lr_scale: float,
    ) -> PushResult:
        """Send a PushShared whose payload is in place (on the data channel, or by gRPC); a
        server that lost the segment (it restarted) gets the push again, over a new segment or
        the stream."""
        if channel.sock is not None:
            deadline = time.monotonic() + self.timeout

            def call() -> pb.PushResponse:
                body = self._channel_call(channel, pb.CHANNEL_FRAME_PUSH, header, deadline)
                return _parse(pb.PushResponse, body)

            return self._settle_shared(call, base_version, again, lr_scale)
        return self._settle_shared(
            lambda: self._stub.PushShared(header, timeout=self.timeout, metadata=self._metadata),
            base_version,
            again,
            lr_scale,
        )

    def _settle_shared(
        self,
        call: Callable[[], pb.PushResponse],
        base_version: int,
        again: Mapping[str, tuple[pb.TensorSpec, Sequence[np.ndarray]]] | Mapping[str, np.ndarray],
        lr_scale: float,
    ) -> PushResult:
        """The answer of a PushShared; a failure abandons the channel, and a server that lost
        it (``no-segment``: it restarted, or closed the socket) gets the push again. A channel
        that breaks before the answer loses the push (UNAVAILABLE: it may have been applied)."""
        try:
            reply = call()
        except bulk.ClosedBefore as exc:  # the push never left: send it again
            self._shm_failed(exc)
            return self._push_again(base_version, again, lr_scale)
        except bulk.SocketClosed as exc:
            self._shm_failed(exc)
            raise RemoteError(
                self.address, "PushShared", grpc.StatusCode.UNAVAILABLE, f"data channel: {exc}"
            ) from None
        except (grpc.RpcError, RemoteError) as exc:
            err = _as_remote_error(self.address, "PushShared", exc)
            self._shm_failed(err)
            if err.refusal is Refusal.NO_SEGMENT:  # the push never landed: send it again
                return self._push_again(base_version, again, lr_scale)
            raise err from None
        self._shm_failures = 0
        return _push_result(reply)

    def _push_again(
        self,
        base_version: int,
        again: Mapping[str, tuple[pb.TensorSpec, Sequence[np.ndarray]]] | Mapping[str, np.ndarray],
        lr_scale: float,
    ) -> PushResult:
        """A push that never landed, sent again (over a new segment, socket, or the stream)."""
        if any(isinstance(v, tuple) for v in again.values()):
            return self.push_encoded(
                base_version=base_version,
                pieces=again,  # type: ignore[arg-type]
                lr_scale=lr_scale,
            )
        return self.push(
            base_version=base_version,
            tensors=again,  # type: ignore[arg-type]
            lr_scale=lr_scale,
        )

    def _push_socket(
        self,
        channel: _SharedChannel,
        base_version: int,
        specs: Sequence[pb.TensorSpec],
        arrays: Sequence[np.ndarray],
        lr_scale: float,
        *,
        again: Mapping[str, tuple[pb.TensorSpec, Sequence[np.ndarray]]] | Mapping[str, np.ndarray],
    ) -> PushResult:
        """PushShared over a tensor socket: the header frame, then the bytes, on the socket."""
        header = pb.PushHeader(
            header=self._header,
            base_version=base_version,
            tensors=list(specs),
            lr_scale=lr_scale,
            segment=channel.id,
        )
        deadline = time.monotonic() + self.timeout

        def call() -> pb.PushResponse:
            body = self._channel_call(channel, pb.CHANNEL_FRAME_PUSH, header, deadline, arrays)
            return _parse(pb.PushResponse, body)

        return self._settle_shared(call, base_version, again, lr_scale)

    def push_area(self) -> dict[str, np.ndarray] | None:
        """The segment's push area, one array per piece (attaching a segment first if none):
        a :meth:`push` of these very arrays copies nothing. None without shared memory. Write
        them only between calls, never while one runs (the server reads them then)."""
        channel = self._shared_channel()
        return None if channel is None or channel.segment is None else channel.push

    def _push_shared(
        self,
        channel: _SharedChannel,
        base_version: int,
        tensors: Mapping[str, np.ndarray],
        lr_scale: float,
    ) -> PushResult:
        for key, array in tensors.items():
            area = channel.push[key]
            if not _is_area(array, area):  # a payload written in place needs no copy
                np.copyto(area, array, casting="no")
        header = pb.PushHeader(
            header=self._header,
            base_version=base_version,
            tensors=[
                pb.TensorSpec(key=k, dtype=dtype_name(channel.push[k].dtype), shape=list(a.shape))
                for k, a in tensors.items()
            ],
            lr_scale=lr_scale,
            segment=channel.id,
        )
        return self._send_shared(channel, header, base_version, tensors, lr_scale)

    def checkpoint(self, name: str) -> pb.CheckpointResponse:
        """Ask the shard to write its state under checkpoint ``name``."""
        request = pb.CheckpointRequest(header=self._header, name=name)
        return self._call(
            "Checkpoint",
            lambda: self._stub.Checkpoint(request, timeout=self.timeout, metadata=self._metadata),
        )

    def join(self, *, retry: bool = True) -> pb.MembershipResponse:
        """Announce this worker as a member of the shard (protocol 4): epoch and members."""
        request = pb.JoinRequest(header=self._header)
        return self._call(
            "Join",
            lambda: self._stub.Join(request, timeout=self.timeout, metadata=self._metadata),
            retry=retry,
        )

    def heartbeat(self, *, timeout: float | None = None) -> pb.MembershipResponse:
        """Tell the shard this worker is alive: epoch and members. Not retried; RemoteError
        with refusal NOT_MEMBER when the shard no longer counts this worker (join again)."""
        request = pb.HeartbeatRequest(header=self._header)
        return self._call(
            "Heartbeat",
            lambda: self._stub.Heartbeat(
                request, timeout=timeout or self.timeout, metadata=self._metadata
            ),
            retry=False,
        )

    def lease_work(self, done: Sequence[tuple[int, int]] = (), want: int = 0) -> pb.LeaseResponse:
        """Report the work units ``done`` (epoch, unit) and hold up to ``want`` (protocol 5):
        every unit this worker holds now, the ignored reports, and the queue's status.
        Retried like any call: a repeated report of a unit is ignored, never counted twice."""
        request = pb.LeaseRequest(
            header=self._header,
            done=[pb.WorkUnit(epoch=e, unit=u) for e, u in done],
            want=want,
        )
        return self._call(
            "LeaseWork",
            lambda: self._stub.LeaseWork(request, timeout=self.timeout, metadata=self._metadata),
        )

    def leave(self) -> int:
        """Tell the shard this worker has finished; returns the shard's version."""
        request = pb.LeaveRequest(header=self._header)
        return self._call(
            "Leave",
            lambda: self._stub.Leave(request, timeout=self.timeout, metadata=self._metadata),
        ).version


def _is_area(array: np.ndarray, area: np.ndarray) -> bool:
    """Whether ``array`` is ``area`` itself (the same memory, shape and dtype)."""
    array = np.asarray(array)
    return (
        array.__array_interface__["data"][0] == area.__array_interface__["data"][0]
        and array.shape == area.shape
        and array.dtype == area.dtype
        and array.flags.c_contiguous
    )


def _as_bytes(parts: Sequence[np.ndarray]) -> np.ndarray:
    """The parts' bytes back to back, as one uint8 array (no copy for a single contiguous part)."""
    views = [np.ascontiguousarray(part).reshape(-1).view(np.uint8) for part in parts]
    return views[0] if len(views) == 1 else np.concatenate(views)


def _push_result(reply: pb.PushResponse) -> PushResult:
    return PushResult(
        accepted=reply.accepted,
        version=reply.version,
        reason=reply.reason,
        reject=_push_reject(reply.reject),
    )


_STATUS_CODES = {code.value[0]: code for code in grpc.StatusCode}
"""gRPC status codes by number (a data channel's error frame carries the number)."""


def _parse(message: type[M], body: bytes) -> M:
    """A data channel's answer as ``message``; SocketClosed if it is not one."""
    try:
        return message.FromString(body)
    except Exception:  # protobuf's DecodeError
        raise bulk.SocketClosed(f"a malformed {message.__name__} on the data channel") from None


def _as_remote_error(address: str, method: str, exc: grpc.RpcError | RemoteError) -> RemoteError:
    return exc if isinstance(exc, RemoteError) else _remote_error(address, method, exc)


def _remote_error(address: str, method: str, exc: grpc.RpcError) -> RemoteError:
    """The typed error of a failed gRPC call."""
    trailing = exc.trailing_metadata() if isinstance(exc, grpc.Call) else None
    code = exc.code() if isinstance(exc, grpc.Call) else grpc.StatusCode.UNKNOWN
    details = (exc.details() if isinstance(exc, grpc.Call) else str(exc)) or ""
    return RemoteError(address, method, code, details, Refusal.from_metadata(trailing))


def _waited(reported: float, elapsed: float) -> float:
    """The server's ``waited_seconds``, trusted only within [0, the call's own duration]."""
    if not math.isfinite(reported) or reported <= 0:
        return 0.0
    return min(reported, elapsed)


def _push_reject(value: int) -> PushReject:
    """The typed reject reason of a reply; a number this build does not know counts as STALE
    (not applied, nothing to stop for), never as accepted."""
    try:
        return PushReject(value)
    except ValueError:
        return PushReject.STALE
