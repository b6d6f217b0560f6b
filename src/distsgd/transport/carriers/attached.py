"""What the carriers a server attaches for a client have in common: PullShared and PushShared,
by gRPC or on the client's data channel (a plain connection bound to the attachment by a
one-time token, requests and answers as frames), and how their failures are told apart.

A failure abandons the carrier (:class:`~.base.CarrierFailed`). A pull is then repeated over
the stream, except one whose deadline passed (the server may still write the segment: it is
never read again, and the error is raised). A push is sent again where it never landed (the
server lost the segment, or the channel closed before the push left); one whose channel broke
before the answer is lost (UNAVAILABLE: it may have been applied)."""

from __future__ import annotations

import contextlib
import logging
import socket
import time
from collections.abc import Sequence
from typing import TypeVar

import grpc
import numpy as np
from google.protobuf.message import Message

from distsgd.transport import bulk
from distsgd.transport.carriers.base import Carrier, CarrierFailed
from distsgd.transport.errors import Refusal, RemoteError, as_remote_error
from distsgd.transport.link import Link
from distsgd.transport.proto import distsgd_pb2 as pb

log = logging.getLogger(__name__)

M = TypeVar("M", bound=Message)

_STATUS_CODES = {code.value[0]: code for code in grpc.StatusCode}
"""gRPC status codes by number (a data channel's error frame carries the number)."""


def parse(message: type[M], body: bytes) -> M:
    """A data channel's answer as ``message``; SocketClosed if it is not one."""
    try:
        return message.FromString(body)
    except Exception:  # protobuf's DecodeError
        raise bulk.SocketClosed(f"a malformed {message.__name__} on the data channel") from None


class AttachedCarrier(Carrier):
    """A carrier the server attached: ``segment_id`` names it in requests, ``pull_views`` are
    where a pull's values land, ``push_views`` each piece's place (shape and dtype) in a push;
    ``sock`` is the data channel its requests travel on (None: by gRPC)."""

    def __init__(
        self,
        link: Link,
        segment_id: int,
        pull_views: dict[str, np.ndarray],
        push_views: dict[str, np.ndarray],
        sock: socket.socket | None,
    ) -> None:
        self.link = link
        self.segment_id = segment_id
        self.pull_views = pull_views
        self.push_views = push_views
        self.sock = sock

    def close(self) -> None:
        if self.sock is not None:
            with contextlib.suppress(OSError):
                self.sock.close()

    def fits(self, key: str, array: np.ndarray) -> bool:
        """Whether raw ``array`` has piece ``key``'s place: its shape and dtype."""
        place = self.push_views.get(key)
        return (
            place is not None
            and place.shape == np.shape(array)
            and place.dtype == np.asarray(array).dtype
        )

    # -- pulls ------------------------------------------------------------------------------------
    def pull(
        self, request: pb.PullRequest, wait: float
    ) -> tuple[pb.PullHeader, dict[str, np.ndarray]]:
        link = self.link
        try:
            if self.sock is None:
                reply = link.stub.PullShared(
                    request, timeout=wait + link.timeout, metadata=link.metadata
                )
            else:
                deadline = time.monotonic() + wait + link.timeout
                reply = parse(pb.PullHeader, self._call(pb.CHANNEL_FRAME_PULL, request, deadline))
                self._check_answer(reply)
                self.receive_values(reply, deadline)
        except bulk.SocketClosed as exc:
            raise CarrierFailed(exc) from None
        except (grpc.RpcError, RemoteError) as exc:
            err = as_remote_error(link.address, "PullShared", exc)
            if err.code == grpc.StatusCode.DEADLINE_EXCEEDED and err.refusal is None:
                raise CarrierFailed(err, error=err, counted=False) from None
            raise CarrierFailed(err, counted=err.refusal is not Refusal.NO_SEGMENT) from None
        self._check_answer(reply)
        return reply, self.pull_views

    def _check_answer(self, reply: pb.PullHeader) -> None:
        """A pull's answer names the segment's pieces, in its order."""
        if not reply.in_segment or [t.key for t in reply.tensors] != list(self.pull_views):
            raise CarrierFailed("the server answered a pull outside the segment")

    def receive_values(self, reply: pb.PullHeader, deadline: float) -> None:
        """Read a pull's values that follow its answer ``reply`` on the data channel (a
        segment's are in the segment already)."""

    # -- pushes -----------------------------------------------------------------------------------
    def send_push(self, header: pb.PushHeader, after: Sequence[np.ndarray] = ()) -> pb.PushResponse:
        """Send a PushShared whose payload is in place (or, ``after``, follows its header on the
        data channel), and read its answer."""
        link = self.link
        try:
            if self.sock is None:
                reply: pb.PushResponse = link.stub.PushShared(
                    header, timeout=link.timeout, metadata=link.metadata
                )
                return reply
            deadline = time.monotonic() + link.timeout
            body = self._call(pb.CHANNEL_FRAME_PUSH, header, deadline, after)
            return parse(pb.PushResponse, body)
        except bulk.ClosedBefore as exc:  # the push never left: send it again
            raise CarrierFailed(exc) from None
        except bulk.SocketClosed as exc:
            lost = RemoteError(
                link.address, "PushShared", grpc.StatusCode.UNAVAILABLE, f"data channel: {exc}"
            )
            raise CarrierFailed(exc, error=lost) from None
        except (grpc.RpcError, RemoteError) as exc:
            err = as_remote_error(link.address, "PushShared", exc)
            if err.refusal is Refusal.NO_SEGMENT:  # the push never landed: send it again
                raise CarrierFailed(err, counted=False) from None
            raise CarrierFailed(err, error=err) from None

    # -- the data channel -------------------------------------------------------------------------
    def _call(
        self,
        kind: int,
        request: Message,
        deadline: float,
        payload: Sequence[np.ndarray] = (),
    ) -> bytes:
        """Send a request frame (and ``payload``'s bytes) on the data channel and read the
        answer frame of the same kind: its bytes. :class:`RemoteError` for an error frame,
        :class:`~distsgd.transport.bulk.SocketClosed` for anything else."""
        assert self.sock is not None
        bulk.check_open(self.sock)
        left = max(0.001, deadline - time.monotonic())
        try:
            bulk.send_frame(self.sock, kind, request.SerializeToString(), left)
            if payload:
                bulk.send_arrays(self.sock, payload, left)
        except OSError as exc:  # the server closed it: its error frame may say why
            log.debug("%s: data channel send failed: %s", self.link.address, exc)
        got, body = bulk.recv_frame(self.sock, deadline=deadline)
        if got == pb.CHANNEL_FRAME_ERROR:
            error = parse(pb.ChannelError, body)
            method = "PullShared" if kind == pb.CHANNEL_FRAME_PULL else "PushShared"
            code = _STATUS_CODES.get(error.code, grpc.StatusCode.UNKNOWN)
            raise RemoteError(
                self.link.address, method, code, error.message, Refusal.named(error.refusal)
            )
        if got != kind:
            raise bulk.SocketClosed(f"a frame of kind {got} answered a request of kind {kind}")
        return body
