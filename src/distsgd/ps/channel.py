"""The server side of a data channel: PullShared and PushShared off gRPC (see "Data channel" in
``transport/proto/distsgd.proto``).

A worker's data channel is a plain connection bound to its segment (or tensor socket) by a
one-time token. The connection's own thread reads one request frame at a time and hands it to
the service's handler, the same code that serves the gRPC call, with a :class:`ChannelContext`
standing in for gRPC's: an abort there becomes an error frame with the code, message and
refusal gRPC would have carried. Any error closes the channel.

Every read has a deadline: a channel may idle as long as it likes between requests (the wait
for a frame's first byte gives up only when the server closes), but once a frame has begun, its
head and message must arrive within :data:`~distsgd.transport.bulk.FRAME_SECONDS`, or the
channel is closed and its thread freed (a tensor socket's pushed bytes then within the
request's ``seconds``).
"""

from __future__ import annotations

import contextlib
import logging
import math
import socket
import time
from collections.abc import Callable, Sequence
from typing import Any

import grpc
import numpy as np
from google.protobuf.message import Message

from distsgd.ps.wal import NotLogged
from distsgd.transport import bulk
from distsgd.transport.errors import ERROR_KEY, Refusal
from distsgd.transport.proto import distsgd_pb2 as pb

log = logging.getLogger(__name__)


class Aborted(Exception):
    """Raised once a call has been answered with an error status (gRPC's, or a channel's)."""


class ChannelContext:
    """What the service's handlers use of a ``grpc.ServicerContext``, for one request that came
    over a data channel: its deadline, and the status it is aborted with."""

    def __init__(self, seconds: float) -> None:
        self._deadline = time.monotonic() + seconds
        self.code: grpc.StatusCode = grpc.StatusCode.OK
        self.message = ""
        self.refusal = ""

    def time_remaining(self) -> float:
        return max(0.0, self._deadline - time.monotonic())

    def is_active(self) -> bool:
        return True

    def set_trailing_metadata(self, metadata: Sequence[tuple[str, str]]) -> None:
        for key, value in metadata:
            if key == ERROR_KEY:
                self.refusal = value

    def abort(self, code: grpc.StatusCode, message: str) -> None:
        self.code, self.message = code, message
        raise Aborted(code.name)

    def error(self) -> pb.ChannelError:
        code: int = self.code.value[0]
        return pb.ChannelError(code=code, message=self.message, refusal=self.refusal)


Handler = Callable[[int, bytes, ChannelContext], tuple[Message, Sequence[np.ndarray]]]
"""(frame kind, message bytes, context) -> (the answer, tensor bytes to send after it)."""


def serve(
    sock: socket.socket,
    *,
    handle: Handler,
    closing: Callable[[], bool],
    seconds: float,
    on_close: Callable[[], None],
    name: str,
) -> None:
    """Answer the requests on ``sock`` until it closes, an answer fails, or ``closing()``;
    each request has ``seconds`` (its wait included). ``on_close`` runs at the end, always."""
    try:
        while not closing():
            try:
                kind, body = bulk.recv_frame(sock, deadline=math.inf, give_up=closing)
            except bulk.SocketClosed:
                return
            context = ChannelContext(seconds)
            try:
                reply, arrays = handle(kind, body, context)
            except Exception as exc:  # answered as gRPC answers it, then closed
                # NotLogged: nothing of the push applied: the client sends it again
                if isinstance(exc, NotLogged):
                    context.set_trailing_metadata(((ERROR_KEY, Refusal.NOT_LOGGED.value),))
                    context.code, context.message = grpc.StatusCode.UNAVAILABLE, str(exc)
                elif not isinstance(exc, Aborted):  # a bug
                    log.error("%s failed with an unexpected error (a bug)", name, exc_info=exc)
                    context.code = grpc.StatusCode.INTERNAL
                    context.message = (
                        f"{name}: internal error in the parameter server ({type(exc).__name__}); "
                        "see the server's log"
                    )
                _answer_error(sock, context, seconds)
                return
            bulk.send_frame(sock, kind, reply.SerializeToString(), seconds)
            if arrays:
                bulk.send_arrays(sock, arrays, seconds)
    except OSError:
        return
    finally:
        on_close()


def _answer_error(sock: socket.socket, context: ChannelContext, seconds: float) -> None:
    with contextlib.suppress(OSError):
        frame = pb.CHANNEL_FRAME_ERROR
        bulk.send_frame(sock, frame, context.error().SerializeToString(), seconds)


def parse(message: type[Any], body: bytes, context: ChannelContext) -> Any:
    """``body`` as a ``message``; INVALID_ARGUMENT if it is not one."""
    try:
        return message.FromString(body)
    except Exception:  # protobuf's DecodeError, or a field out of range
        context.abort(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"a malformed {message.__name__} frame on a data channel",
        )
        raise AssertionError("abort returns never") from None
