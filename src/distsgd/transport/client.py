"""A client for one parameter-server shard: every call has a deadline, transient failures retry.

Retries cover what a healthy cluster shows at start-up and under load: a server not listening
yet (UNAVAILABLE) and a shard the chief has not registered yet. They back off exponentially and
give up at ``retry_seconds`` with the last error.

Tensors travel by one carrier (:mod:`distsgd.transport.carriers`): the one attached at the
first pull or push (a shared-memory segment or a tensor socket, see
:class:`~distsgd.transport.carriers.attach.Attacher`), or the gRPC streams. :meth:`ShardClient.pull`
and :meth:`ShardClient.push` are the one path of each; a carrier that fails is abandoned, and
the call goes on by the stream.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import grpc
import numpy as np

from distsgd.transport.carriers.attach import Attacher
from distsgd.transport.carriers.base import Carrier, CarrierFailed, Payload
from distsgd.transport.carriers.segment import SegmentCarrier
from distsgd.transport.carriers.stream import StreamCarrier
from distsgd.transport.carriers.tensor_socket import SocketCarrier
from distsgd.transport.codec import CHUNK_BYTES, ChunkAssembler, header_then_chunks, specs_of
from distsgd.transport.delay import LinkDelay
from distsgd.transport.errors import (
    MAX_WAIT_SECONDS,
    PROTOCOL_VERSION,
    PushReject,
    RemoteError,
    remote_error,
)
from distsgd.transport.inflight import CALLS, Call
from distsgd.transport.link import Link, PullDecoding
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

GRPC_OPTIONS = [
    ("grpc.max_send_message_length", 8 * CHUNK_BYTES),
    ("grpc.max_receive_message_length", 8 * CHUNK_BYTES),
]


@dataclass(frozen=True)
class PushResult:
    """What a shard did with a push: ``reject`` says why it was not applied (typed; decide on
    it), ``reason`` in words (for people)."""

    accepted: bool
    version: int
    reason: str = ""
    reject: PushReject = PushReject.NONE
    moved: Mapping[str, int] = field(default_factory=dict)
    """(MOVED) piece key -> the shard that holds it now."""
    duplicate: bool = False
    """(accepted) the shard had applied this push's sequence already (a resend)."""
    sent: bool = True
    """False for a shard a push of some parameters had nothing for (nothing sent, nothing
    changed; ``accepted`` True, ``version`` the one last seen)."""


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
        delay: LinkDelay | None = None,
        pull_decoding: PullDecoding | None = None,
    ) -> None:
        """``shared_memory``: move tensor bytes through a shared-memory segment when the server
        is on this host; ``tensor_socket``: otherwise through a plain TCP connection (never with
        TLS). Each is tried at the first pull or push and falls back to the stream. ``delay``:
        an emulated link's round trip, waited before every call
        (:mod:`~distsgd.transport.delay`). ``pull_decoding``: pulls ask their float pieces
        encoded ("Encoded pulls" in the .proto) where they cross a network, decoded by it."""
        self.address = address
        self.delay = delay
        self.timeout = timeout
        self.retry_seconds = retry_seconds
        self.chunk_bytes = chunk_bytes
        self.server_incarnation = 0
        """The server process last seen (0 = none yet); it changes when the server restarts."""
        self.last_waited = 0.0
        """Seconds the server spent waiting for ``min_version`` in the last pull (its report,
        clamped to the pull's own duration)."""
        self.last_pull_nbytes = 0
        """Bytes of values the last pull moved (encoded pieces at their encoded size)."""
        self._channel = (
            grpc.secure_channel(address, channel_credentials(tls), options=GRPC_OPTIONS)
            if tls is not None
            else grpc.insecure_channel(address, options=GRPC_OPTIONS)
        )
        self.link = Link(
            address=address,
            stub=pb_grpc.ParameterServerStub(self._channel),
            header=pb.RequestHeader(
                protocol_version=PROTOCOL_VERSION,
                run_id=run_id,
                worker=worker,
                incarnation=incarnation,
            ),
            metadata=((METADATA_KEY, check_secret(secret)),) if secret else None,
            timeout=timeout,
            pull_decoding=pull_decoding,
        )
        self._stream = StreamCarrier(self.link, chunk_bytes)
        self._attacher = Attacher(
            self.link, shared_memory=shared_memory, tensor_socket=tensor_socket and tls is None
        )

    @property
    def carrier(self) -> Carrier:
        """The carrier of this client's tensors now: the attached one, or the stream."""
        return self._attacher.current or self._stream

    @property
    def uses_shared_memory(self) -> bool:
        """Whether tensors currently move through a shared-memory segment."""
        return isinstance(self._attacher.current, SegmentCarrier)

    @property
    def uses_tensor_socket(self) -> bool:
        """Whether tensors currently move through a tensor socket."""
        return isinstance(self._attacher.current, SocketCarrier)

    def close(self) -> None:
        self._attacher.drop()
        self._channel.close()

    def __enter__(self) -> ShardClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- plumbing -------------------------------------------------------------------------------
    def _call(
        self,
        method: str,
        fn: Callable[[], T],
        *,
        retry: bool = True,
        delayed: bool = False,
        call: Call | None = None,
    ) -> T:
        """``fn()``, retried while its error is retryable; after the link's delay unless
        ``delayed`` (the caller waited it). In flight (:mod:`~distsgd.transport.inflight`) as
        ``call`` where the caller tracks it already, else as a call of its own."""
        if call is None:
            with CALLS.track(self.address, method) as call:
                return self._call(method, fn, retry=retry, delayed=delayed, call=call)
        if not delayed:
            self._wait_link()
        give_up = time.monotonic() + self.retry_seconds
        delay = 0.05
        while True:
            try:
                return fn()
            except grpc.RpcError as exc:
                err = remote_error(self.address, method, exc)
                if not (retry and err.retryable) or time.monotonic() + delay > give_up:
                    raise err from None
                call.retried(err.code.name)
                log.debug("%s; retrying in %.2fs", err, delay)
                time.sleep(delay)
                delay = min(delay * 2, MAX_RETRY_DELAY)

    def _wait_link(self) -> None:
        if self.delay is not None:
            self.delay.wait()

    def _unary(
        self, method: str, request: Any, *, retry: bool = True, timeout: float | None = None
    ) -> Any:
        """The answer of unary RPC ``method`` to ``request`` (:meth:`_call`'s retries)."""
        rpc = getattr(self.link.stub, method)
        return self._call(
            method,
            lambda: rpc(request, timeout=timeout or self.timeout, metadata=self.link.metadata),
            retry=retry,
        )

    # -- RPCs -----------------------------------------------------------------------------------
    def info(self, *, retry: bool = True) -> pb.InfoResponse:
        """The shard's state (registered, version, pieces, membership counters)."""
        return self._unary("Info", pb.InfoRequest(header=self.link.header), retry=retry)

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
            header=self.link.header,
            scheme=scheme,
            options_json=options_json,
            num_workers=num_workers,
            tensors=specs_of(tensors),
            shard_index=shard_index,
            work=work,
        )
        arrays = list(tensors.values())
        return self._call(
            "Register",
            lambda: self.link.stub.Register(
                header_then_chunks(pb.RegisterRequest, header, arrays, self.chunk_bytes),
                timeout=self.timeout,
                metadata=self.link.metadata,
            ),
        )

    def pull(
        self,
        *,
        min_version: int = 0,
        wait_seconds: float | None = None,
        keys: Sequence[str] = (),
    ) -> tuple[int, dict[str, np.ndarray]]:
        """The shard's pieces once its version is at least ``min_version``: (version, arrays).

        ``keys``: only those pieces (the ones the shard still holds), over the stream (a
        shared-memory segment or tensor socket carries whole shards); empty for every piece.

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
        with CALLS.track(self.address, "Pull") as call:
            self._wait_link()
            attached = None if keys else self._attacher.carrier()
            if attached is not None:
                try:
                    pulled = self._pull_by(attached, min_version, wait)
                except CarrierFailed as failed:  # abandoned; the stream then (or its error)
                    self._attacher.abandon(failed)
                else:
                    self._attacher.succeeded()
                    return pulled
            return self._call(
                "Pull",
                lambda: self._pull_by(self._stream, min_version, wait, keys),
                delayed=True,
                call=call,
            )

    def _pull_by(
        self, carrier: Carrier, min_version: int, wait: float, keys: Sequence[str] = ()
    ) -> tuple[int, dict[str, np.ndarray]]:
        """One pull through ``carrier``: (version, arrays)."""
        began = time.monotonic()
        request = pb.PullRequest(
            header=self.link.header,
            min_version=min_version,
            wait_seconds=wait,
            server_incarnation=self.server_incarnation,
            segment=carrier.segment_id,
            encoding=(
                pb.TENSOR_ENCODING_RAW
                if self.link.pull_decoding is None
                else self.link.pull_decoding.requested
            ),
            keys=list(keys),
        )
        reply, arrays = carrier.pull(request, wait)
        self.last_pull_nbytes = sum(self.link.pull_nbytes(spec) for spec in reply.tensors)
        self.server_incarnation = reply.server_incarnation
        self.last_waited = _waited(reply.waited_seconds, time.monotonic() - began)
        return reply.version, arrays

    def push(
        self,
        *,
        base_version: int,
        tensors: Mapping[str, np.ndarray] | Payload,
        lr_scale: float = 1.0,
        sequence: int = 0,
    ) -> PushResult:
        """Send a gradient or update computed on parameters of ``base_version``: raw arrays by
        key, or a :class:`~distsgd.transport.carriers.base.Payload` (pieces already encoded).

        By the attached carrier where it takes the payload, else over the stream. A push that
        never landed (the server lost the segment) is sent again. One lost on the way (the
        server died, or did not answer in time) is sent again under its ``sequence``, which the
        server deduplicates (exactly once: see "Exactly once" in the .proto), until
        ``retry_seconds`` pass; a push without one (0) is not: the server may have applied it.
        """
        payload = tensors if isinstance(tensors, Payload) else Payload.raw(tensors)
        give_up = time.monotonic() + self.retry_seconds
        delay = 0.05
        with CALLS.track(self.address, "Push") as call:
            while True:
                try:
                    return self._push_once(payload, base_version, lr_scale, sequence, call)
                except RemoteError as err:
                    if not (sequence and err.retryable) or time.monotonic() + delay > give_up:
                        raise
                    call.retried(err.code.name)
                    (log.warning if delay == 0.05 else log.debug)(
                        "%s; sending the push (sequence %d) again until the server answers",
                        err,
                        sequence,
                    )
                    time.sleep(delay)
                    delay = min(delay * 2, MAX_RETRY_DELAY)

    def _push_once(
        self, payload: Payload, base_version: int, lr_scale: float, sequence: int, call: Call
    ) -> PushResult:
        self._wait_link()
        attached = self._attacher.carrier()
        if attached is not None and attached.carries(payload):
            header = self._push_header(attached, payload, base_version, lr_scale, sequence)
            try:
                reply = attached.push(header, payload)
            except CarrierFailed as failed:  # abandoned; sent again (or its error raised)
                self._attacher.abandon(failed)
                return self._push_once(payload, base_version, lr_scale, sequence, call)
            self._attacher.succeeded()
            return _push_result(reply)
        header = self._push_header(self._stream, payload, base_version, lr_scale, sequence)
        reply = self._call(
            "Push", lambda: self._stream.push(header, payload), retry=False, delayed=True, call=call
        )
        return _push_result(reply)

    def _push_header(
        self, carrier: Carrier, payload: Payload, base_version: int, lr_scale: float, sequence: int
    ) -> pb.PushHeader:
        return pb.PushHeader(
            header=self.link.header,
            base_version=base_version,
            tensors=list(payload.specs),
            lr_scale=lr_scale,
            segment=carrier.segment_id,
            sequence=sequence,
        )

    def push_area(self) -> dict[str, np.ndarray] | None:
        """The segment's push area, one array per piece (attaching a segment first if none):
        a :meth:`push` of these very arrays copies nothing. None without shared memory. Write
        them only between calls, never while one runs (the server reads them then)."""
        attached = self._attacher.carrier()
        return None if attached is None else attached.push_area()

    def release_pulled(self) -> None:
        """Give the memory of the attached carrier's last pull back (a shared-memory segment's
        pull area: its pages); a later pull writes it again. Only once the pulled arrays were
        copied where they are kept. Attaches nothing."""
        if self._attacher.current is not None:
            self._attacher.current.release_pulled()

    def checkpoint(self, name: str) -> pb.CheckpointResponse:
        """Ask the shard to write its state under checkpoint ``name``."""
        return self._unary("Checkpoint", pb.CheckpointRequest(header=self.link.header, name=name))

    def join(self, *, retry: bool = True, claim: bool = False) -> pb.MembershipResponse:
        """Announce this worker as a member of the shard (protocol 4): epoch and members.
        ``claim``: take the worker index as a new one (RemoteError, refusal TAKEN, if it is or
        was in use in this run)."""
        request = pb.JoinRequest(header=self.link.header, claim=claim)
        return self._unary("Join", request, retry=retry)

    def heartbeat(self, *, timeout: float | None = None) -> pb.MembershipResponse:
        """Tell the shard this worker is alive: epoch and members. Not retried; RemoteError
        with refusal NOT_MEMBER when the shard no longer counts this worker (join again)."""
        request = pb.HeartbeatRequest(header=self.link.header)
        return self._unary("Heartbeat", request, retry=False, timeout=timeout)

    def lease_work(self, done: Sequence[tuple[int, int]] = (), want: int = 0) -> pb.LeaseResponse:
        """Report the work units ``done`` (epoch, unit) and hold up to ``want`` (protocol 5):
        every unit this worker holds now, the ignored reports, and the queue's status.
        Retried like any call: a repeated report of a unit is ignored, never counted twice."""
        request = pb.LeaseRequest(
            header=self.link.header,
            done=[pb.WorkUnit(epoch=e, unit=u) for e, u in done],
            want=want,
        )
        return self._unary("LeaseWork", request)

    # -- moving pieces (the launcher; see "Moving pieces" in the .proto) -------------------------
    def export_pieces(
        self, keys: Sequence[str], peer: int
    ) -> tuple[pb.ExportHeader, dict[str, np.ndarray]]:
        """Copy and freeze these pieces for a move to shard ``peer``: the header and arrays.
        Not retried (a second export of frozen pieces is refused NOT_FROZEN)."""
        request = pb.MoveRequest(header=self.link.header, keys=list(keys), peer_shard=peer)

        def call() -> tuple[pb.ExportHeader, dict[str, np.ndarray]]:
            link = self.link
            stream = link.stub.ExportPieces(request, timeout=self.timeout, metadata=link.metadata)
            first = next(stream)
            if first.WhichOneof("part") != "header":
                raise RemoteError(
                    self.address, "ExportPieces", grpc.StatusCode.INTERNAL, "no header"
                )
            assembler = ChunkAssembler(first.header.tensors)
            for message in stream:
                assembler.add(message.chunk)
            return first.header, assembler.finish()

        return self._call("ExportPieces", call, retry=False)

    def import_pieces(
        self, from_shard: int, header: pb.ExportHeader, arrays: Mapping[str, np.ndarray]
    ) -> pb.MoveResponse:
        """Hand this shard the pieces another exported (:meth:`export_pieces`)."""
        head = pb.ImportHeader(
            header=self.link.header,
            from_shard=from_shard,
            tensors=list(header.tensors),
            loads=list(header.loads),
            move_id=header.move_id,
            version=header.version,
        )
        values = list(arrays.values())
        return self._call(
            "ImportPieces",
            lambda: self.link.stub.ImportPieces(
                header_then_chunks(pb.ImportRequest, head, values, self.chunk_bytes),
                timeout=self.timeout,
                metadata=self.link.metadata,
            ),
            retry=False,
        )

    def finish_move(
        self,
        keys: Sequence[str],
        peer: int,
        *,
        commit: bool,
        move_id: str,
        version: int = 0,
        receipt: bytes = b"",
    ) -> pb.MoveResponse:
        """Commit (or undo) move ``move_id`` of these pieces; a commit on the source names the
        export's ``version`` and the destination's ``receipt``. See :mod:`distsgd.ps.moves`."""
        request = pb.MoveRequest(
            header=self.link.header,
            keys=list(keys),
            peer_shard=peer,
            commit=commit,
            move_id=move_id,
            version=version,
            receipt=receipt,
        )
        return self._unary("FinishMove", request, retry=False)

    def leave(self) -> int:
        """Tell the shard this worker has finished; returns the shard's version."""
        return self._unary("Leave", pb.LeaveRequest(header=self.link.header)).version


def _push_result(reply: pb.PushResponse) -> PushResult:
    return PushResult(
        accepted=reply.accepted,
        version=reply.version,
        reason=reply.reason,
        reject=_push_reject(reply.reject),
        moved={owner.key: owner.shard for owner in reply.moved},
        duplicate=reply.accepted and reply.duplicate,
    )


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
