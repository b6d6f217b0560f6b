"""Tensor sockets and data channels: plain TCP connections beside gRPC (see "Tensor socket"
and "Data channel" in ``proto/distsgd.proto``).

gRPC moves about 1 GB/s through one stream in Python (measured on loopback: every message is a
protobuf copy, a gRPC copy and a Python object); a socket moves raw bytes straight between
numpy arrays and the kernel (``sendall`` from and ``recv_into`` into the arrays' memory), with
the GIL released while it does. gRPC keeps every request, its secret and its answer; a tensor
socket is bound to one worker's segment id by a one-time token that the worker received
through gRPC, so only a peer that holds the run secret can use one. On the connection the
requests and answers travel as frames (:func:`send_frame`, :func:`recv_frame`): a Python gRPC
call costs about 0.9 ms on loopback, a frame's round trip 0.1 ms.
"""

from __future__ import annotations

import contextlib
import hmac
import logging
import secrets
import select
import socket
import struct
import threading
import time
from collections.abc import Callable, Sequence

import numpy as np

log = logging.getLogger(__name__)

TOKEN_BYTES = 32
HELLO = struct.Struct("<Q")
"""The segment id a connection starts with, before its token."""
HANDSHAKE_SECONDS = 5.0
"""How long a new connection has to present its id and token."""
SOCKET_BUFFER = 4 << 20
"""Send and receive buffers asked for on every tensor socket."""
FRAME = struct.Struct("<BI")
"""A frame's head: its kind (``ChannelFrame``) and the length of the message that follows."""
MAX_FRAME_BYTES = 64 << 20
"""Longest message a frame may announce."""
FRAME_SECONDS = 10.0
"""How long a frame may take once its first byte has come: the rest of its head and its whole
message (a peer that announces more than it sends is dropped after this, not waited for). The
wait for a frame's first byte is the caller's (a data channel idles between requests)."""


class SocketClosed(ConnectionError):
    """The peer closed a tensor socket, or it stalled past its deadline."""


class ClosedBefore(SocketClosed):
    """The peer had closed the data channel before a request was sent: it never got it."""


def check_open(sock: socket.socket) -> None:
    """:class:`ClosedBefore` if the peer closed ``sock`` (or sent what nobody asked for)
    while it was idle: between requests a server sends nothing, so a readable channel is one
    the peer closed."""
    readable, _, _ = select.select([sock], [], [], 0)
    if readable:
        raise ClosedBefore("the server closed the data channel (it restarted, or dropped it)")


def _tune(sock: socket.socket) -> None:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    for option in (socket.SO_SNDBUF, socket.SO_RCVBUF):
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, option, SOCKET_BUFFER)


def send_arrays(sock: socket.socket, arrays: Sequence[np.ndarray], timeout: float) -> int:
    """Send the arrays' raw bytes back to back (no copy for contiguous arrays) within
    ``timeout`` seconds in all; bytes sent."""
    sock.settimeout(timeout)
    sent = 0
    for array in arrays:
        view = np.ascontiguousarray(array).reshape(-1).view(np.uint8)
        if view.size:
            sock.sendall(view.data)
        sent += view.size
    return sent


def recv_into(
    sock: socket.socket,
    buf: np.ndarray,
    *,
    deadline: float,
    give_up: Callable[[], bool] | None = None,
) -> None:
    """Fill ``buf`` (a contiguous uint8 array) from ``sock``; :class:`SocketClosed` if the peer
    closes first, the ``deadline`` (monotonic) passes, or ``give_up()`` turns true while no
    byte has come yet."""
    view = buf.reshape(-1).data.cast("B")
    got = 0
    total = len(view)
    while got < total:
        left = deadline - time.monotonic()
        if left <= 0:
            raise SocketClosed(f"tensor socket: {got} of {total} bytes before the deadline")
        sock.settimeout(min(left, 0.2))
        try:
            n = sock.recv_into(view[got:], min(total - got, 16 << 20))
        except TimeoutError:
            if got == 0 and give_up is not None and give_up():
                raise SocketClosed("tensor socket: the request failed before any byte") from None
            continue
        except OSError as exc:
            raise SocketClosed(f"tensor socket: {exc}") from None
        if n == 0:
            raise SocketClosed(f"tensor socket closed after {got} of {total} bytes")
        got += n


def send_frame(sock: socket.socket, kind: int, body: bytes, timeout: float) -> None:
    """Send one frame: its head, then ``body`` (a serialized message)."""
    if len(body) > MAX_FRAME_BYTES:
        raise ValueError(f"a {len(body)}-byte message exceeds a frame's {MAX_FRAME_BYTES} bytes")
    sock.settimeout(timeout)
    sock.sendall(FRAME.pack(kind, len(body)) + body)


def recv_frame(
    sock: socket.socket, *, deadline: float, give_up: Callable[[], bool] | None = None
) -> tuple[int, bytes]:
    """One frame: (kind, message bytes). Its first byte may come until ``deadline``, the rest
    within :data:`FRAME_SECONDS` of it (and ``deadline``). :class:`SocketClosed` as
    :func:`recv_into`, and for a frame announcing more than :data:`MAX_FRAME_BYTES`."""
    head = np.empty(FRAME.size, np.uint8)
    recv_into(sock, head[:1], deadline=deadline, give_up=give_up)
    deadline = min(deadline, time.monotonic() + FRAME_SECONDS)
    recv_into(sock, head[1:], deadline=deadline)
    kind, length = FRAME.unpack(head.tobytes())
    if length > MAX_FRAME_BYTES:
        raise SocketClosed(f"a frame announces {length} bytes (at most {MAX_FRAME_BYTES})")
    body = np.empty(length, np.uint8)
    if length:
        recv_into(sock, body, deadline=deadline)
    return kind, body.tobytes()


def connect(host: str, port: int, segment: int, token: bytes, timeout: float) -> socket.socket:
    """Open a tensor socket to ``host:port`` and bind it to ``segment`` with ``token``."""
    sock = socket.create_connection((host, port), timeout=timeout)
    try:
        _tune(sock)
        sock.sendall(HELLO.pack(segment) + token)
        sock.settimeout(timeout)
        if sock.recv(1) != b"\x01":
            raise SocketClosed("the server did not accept the tensor socket")
    except BaseException:
        sock.close()
        raise
    return sock


Serve = Callable[[], None]
"""Serves an accepted connection until it closes (in the connection's own thread)."""


class Listener:
    """Accepts tensor sockets on ``host`` (port 0: any free port) and hands each one, with the
    segment id and token it presented, to ``accept(segment, token, sock)``, which answers how
    to serve it (None: refused, the connection is closed)."""

    def __init__(
        self, host: str, accept: Callable[[int, bytes, socket.socket], Serve | None]
    ) -> None:
        self._accept = accept
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._sock = socket.socket(family, socket.SOCK_STREAM)
        self._sock.bind((host, 0))
        self._sock.listen(16)
        self.port: int = self._sock.getsockname()[1]
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="tensor-sockets", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._closed.is_set():
            try:
                sock, _ = self._sock.accept()
            except OSError:
                return
            threading.Thread(target=self._handshake, args=(sock,), daemon=True).start()

    def _handshake(self, sock: socket.socket) -> None:
        try:
            _tune(sock)
            hello = bytearray(HELLO.size + TOKEN_BYTES)
            recv_into(
                sock,
                np.frombuffer(hello, np.uint8),
                deadline=time.monotonic() + HANDSHAKE_SECONDS,
            )
            (segment,) = HELLO.unpack_from(hello)
            serve = self._accept(segment, bytes(hello[HELLO.size :]), sock)
            if serve is not None:
                sock.sendall(b"\x01")
                serve()
                return
        except (OSError, SocketClosed):
            pass
        sock.close()

    def close(self) -> None:
        self._closed.set()
        with contextlib.suppress(OSError):
            self._sock.close()


def new_token() -> bytes:
    return secrets.token_bytes(TOKEN_BYTES)


def same_token(a: bytes, b: bytes) -> bool:
    return len(a) == TOKEN_BYTES and hmac.compare_digest(a, b)
