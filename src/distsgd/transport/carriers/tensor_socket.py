"""A tensor socket (see "Tensor socket" in the .proto): requests, answers and tensor bytes all
on the client's data channel, a plain TCP connection beside gRPC (never under TLS). A pull's
values follow its answer into this client's own buffers; a push's bytes follow its header."""

from __future__ import annotations

from typing import Any

import numpy as np

from distsgd.transport import bulk
from distsgd.transport.carriers.attached import AttachedCarrier
from distsgd.transport.carriers.base import Payload
from distsgd.transport.codec import WireError, is_encoded
from distsgd.transport.proto import distsgd_pb2 as pb


class SocketCarrier(AttachedCarrier):
    """A tensor socket: ``pull_views`` are this client's buffers, ``push_views`` the pieces'
    shapes and dtypes; ``sock`` is never None."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._staged: dict[str, np.ndarray] = {}
        """Where each encoded piece's bytes land before they are decoded (kept between pulls)."""

    def carries(self, payload: Payload) -> bool:
        if not payload.encoded:
            return all(self.fits(key, array) for key, array in payload.items())
        return all(key in self.push_views for key, _ in payload.items())

    def push(self, header: pb.PushHeader, payload: Payload) -> pb.PushResponse:
        return self.send_push(header, payload.arrays)

    def receive_values(self, reply: pb.PullHeader, deadline: float) -> None:
        assert self.sock is not None
        for spec, array in zip(reply.tensors, self.pull_views.values(), strict=True):
            if not is_encoded(spec):
                bulk.recv_into(self.sock, array.reshape(-1).view(np.uint8), deadline=deadline)
                continue
            if spec.dtype != array.dtype.name or tuple(spec.shape) != array.shape:
                raise bulk.SocketClosed(f"{spec.key}: the pull's answer is not the piece's shape")
            try:
                staged = self._staging(spec.key, self.link.pull_nbytes(spec))
                bulk.recv_into(self.sock, staged, deadline=deadline)
                np.copyto(array, self.link.decode_pulled(spec, staged).reshape(array.shape))
            except WireError as exc:  # the stream then, whose answer is checked the same way
                raise bulk.SocketClosed(str(exc)) from None

    def _staging(self, key: str, nbytes: int) -> np.ndarray:
        """The staging buffer of piece ``key``, of ``nbytes``."""
        buf = self._staged.get(key)
        if buf is None or buf.size != nbytes:
            buf = self._staged[key] = np.empty(nbytes, np.uint8)
        return buf
