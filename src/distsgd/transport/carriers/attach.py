"""Which carrier a client attaches, once, and when it gives up on attaching.

With ``shared_memory`` and the server on this host, a client attaches a segment (and, where the
server offers one, a data channel for its requests); a segment it cannot open (another host,
another ``/dev/shm``) turns it to a tensor socket if allowed. With ``tensor_socket`` (never
under TLS) it attaches a tensor socket. Each is tried at the first pull or push; after a
failure the carrier is abandoned and the next call attaches again, until
:data:`SHM_GIVE_UP` failures in a row send everything over the stream from then on. A segment
the server retired (its pieces moved: refused NO_SEGMENT) is attached again without counting:
moves in quick succession on a loaded machine once retired a client's segment 3 times in a
row, and it gave up shared memory for the rest of the run."""

from __future__ import annotations

import contextlib
import ipaddress
import logging
import socket
from collections.abc import Iterable

import grpc
import numpy as np

from distsgd.transport import bulk, shm
from distsgd.transport.carriers.attached import AttachedCarrier
from distsgd.transport.carriers.base import CarrierFailed
from distsgd.transport.carriers.segment import SegmentCarrier
from distsgd.transport.carriers.tensor_socket import SocketCarrier
from distsgd.transport.codec import nbytes_of, wire_dtype
from distsgd.transport.errors import remote_error
from distsgd.transport.link import Link
from distsgd.transport.proto import distsgd_pb2 as pb

log = logging.getLogger(__name__)

SHM_GIVE_UP = 3
"""Failed shared-memory calls after which a client sends everything over the stream."""
MAX_SOCKET_BYTES = 64 << 30
"""Most bytes of pieces a tensor socket's client allocates buffers for."""


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


class Attacher:
    """The attached carrier of one client (None: the stream), attached at the first call."""

    def __init__(self, link: Link, *, shared_memory: bool, tensor_socket: bool) -> None:
        """``tensor_socket`` must be False under TLS (a tensor socket is unencrypted)."""
        self.link = link
        self.current: AttachedCarrier | None = None
        """The carrier attached now (None: none, the stream carries)."""
        self._socket_ok = tensor_socket
        self._use_shm = shared_memory and shm.available() and is_local_address(link.address)
        self._failures = 0 if self._use_shm or self._socket_ok else SHM_GIVE_UP

    def carrier(self) -> AttachedCarrier | None:
        """The attached carrier, attaching one first if none; None when attaching is off,
        unavailable, or just failed (the call then goes over the stream)."""
        if self.current is not None or self._failures >= SHM_GIVE_UP:
            return self.current
        if not self._use_shm:
            return self._attach_socket()
        return self._attach_segment()

    def succeeded(self) -> None:
        """A call through the carrier succeeded: the failures in a row start again at 0."""
        self._failures = 0

    def abandon(self, failed: CarrierFailed) -> None:
        """Drop the carrier after ``failed`` (the server may still be using it); raise its
        error if it has one."""
        self.drop()
        if failed.counted:
            self._failed(failed.why)
        if failed.error is not None:
            raise failed.error from None

    def drop(self) -> None:
        """Abandon the carrier (after a failed call the server may still be using it)."""
        carrier, self.current = self.current, None
        if carrier is not None:
            carrier.close()

    def _failed(self, why: object) -> None:
        self.drop()
        self._failures += 1
        if self._failures >= SHM_GIVE_UP:
            log.info("%s: tensors go over the stream from now on (%s)", self.link.address, why)

    def _attach(self, request: pb.AttachRequest) -> pb.AttachResponse:
        link = self.link
        reply: pb.AttachResponse = link.stub.Attach(
            request, timeout=link.timeout, metadata=link.metadata
        )
        return reply

    def _attach_segment(self) -> AttachedCarrier | None:
        """A confirmed segment (with a data channel where offered), or None."""
        header = self.link.header
        try:
            reply = self._attach(pb.AttachRequest(header=header))
        except grpc.RpcError as exc:
            self._failed(remote_error(self.link.address, "Attach", exc))
            return None
        try:
            segment = shm.Segment.open(reply.name, reply.size)
        except shm.SegmentError as exc:  # another host, or another /dev/shm (containers)
            with contextlib.suppress(grpc.RpcError):
                self._attach(pb.AttachRequest(header=header, confirm=reply.segment, cancel=True))
            self._use_shm = False
            if not self._socket_ok:
                self._failures = SHM_GIVE_UP
            log.info("%s: shared memory not reachable (%s)", self.link.address, exc)
            return self._attach_socket()
        try:
            carrier = self._confirm(reply, segment)
        except (shm.SegmentError, ValueError, grpc.RpcError) as exc:
            segment.close()
            self._failed(exc)
            return None
        self.current = carrier
        if reply.port:  # the requests on a data channel, or by gRPC if it cannot be opened
            try:
                carrier.sock = self._connect(reply)
            except (OSError, ValueError, bulk.SocketClosed) as exc:
                log.debug("%s: no data channel (%s); requests by gRPC", self.link.address, exc)
        log.debug("%s: tensors through shared memory (%d bytes)", self.link.address, reply.size)
        return carrier

    def _confirm(self, reply: pb.AttachResponse, segment: shm.Segment) -> SegmentCarrier:
        """The segment's views by the answer's layout, once the server confirmed the nonce."""
        if not (len(reply.tensors) == len(reply.pull_offsets) == len(reply.push_offsets)):
            raise shm.SegmentError(0, "the layout lists different numbers of offsets")
        pull: dict[str, np.ndarray] = {}
        push: dict[str, np.ndarray] = {}
        for spec, pull_at, push_at in zip(
            reply.tensors, reply.pull_offsets, reply.push_offsets, strict=True
        ):
            dtype, shape = wire_dtype(spec.dtype, spec.key), tuple(spec.shape)
            pull[spec.key] = segment.array(pull_at, dtype, shape)
            push[spec.key] = segment.array(push_at, dtype, shape)
        done = self._attach(
            pb.AttachRequest(header=self.link.header, confirm=reply.segment, nonce=segment.nonce)
        )
        if not done.confirmed:
            raise shm.SegmentError(0, "the server did not confirm the segment")
        return SegmentCarrier(self.link, reply.segment, segment, pull, push)

    def _connect(self, reply: pb.AttachResponse) -> socket.socket:
        """The data channel an Attach answer offers."""
        if not 0 < reply.port < 65536 or len(reply.token) != bulk.TOKEN_BYTES:
            raise ValueError("the server's data channel answer is malformed")
        link = self.link
        return bulk.connect(link.host, reply.port, reply.segment, reply.token, link.timeout)

    def _attach_socket(self) -> AttachedCarrier | None:
        """A tensor socket to the server, or None (not offered, or failed: the stream then)."""
        if not self._socket_ok:
            return None
        try:
            reply = self._attach(pb.AttachRequest(header=self.link.header, socket=True))
        except grpc.RpcError as exc:
            self._failed(remote_error(self.link.address, "Attach", exc))
            return None
        try:
            buffers = _socket_buffers(reply.tensors)
            sock = self._connect(reply)
        except (OSError, ValueError, bulk.SocketClosed) as exc:
            self._failed(exc)
            return None
        self.current = SocketCarrier(self.link, reply.segment, buffers, buffers, sock)
        log.debug("%s: tensors through a tensor socket (port %d)", self.link.address, reply.port)
        return self.current


def _socket_buffers(specs: Iterable[pb.TensorSpec]) -> dict[str, np.ndarray]:
    """This client's buffers for a tensor socket's pieces (pulls land there; a push reads
    the pieces' shapes and dtypes); ValueError for a layout it will not allocate."""
    buffers: dict[str, np.ndarray] = {}
    total = 0
    for spec in specs:
        total += nbytes_of(spec)  # WireError, a ValueError, for a bad dtype or shape
        if total > MAX_SOCKET_BYTES:
            raise ValueError("the server announces more than 64 GiB of pieces")
        buffers[spec.key] = np.empty(tuple(spec.shape), wire_dtype(spec.dtype, spec.key))
    return buffers
