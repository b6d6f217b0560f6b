"""A tensor socket (see "Tensor socket" in the .proto): requests, answers and tensor bytes all
on the client's data channel, a plain TCP connection beside gRPC (never under TLS). A pull's
values follow its answer into this client's own buffers; a push's bytes follow its header."""

from __future__ import annotations

import numpy as np

from distsgd.transport import bulk
from distsgd.transport.carriers.attached import AttachedCarrier
from distsgd.transport.carriers.base import Payload
from distsgd.transport.proto import distsgd_pb2 as pb


class SocketCarrier(AttachedCarrier):
    """A tensor socket: ``pull_views`` are this client's buffers, ``push_views`` the pieces'
    shapes and dtypes; ``sock`` is never None."""

    def carries(self, payload: Payload) -> bool:
        if not payload.encoded:
            return all(self.fits(key, array) for key, array in payload.items())
        return all(key in self.push_views for key, _ in payload.items())

    def push(self, header: pb.PushHeader, payload: Payload) -> pb.PushResponse:
        return self.send_push(header, payload.arrays)

    def receive_values(self, deadline: float) -> None:
        assert self.sock is not None
        for array in self.pull_views.values():
            bulk.recv_into(self.sock, array.reshape(-1).view(np.uint8), deadline=deadline)
