"""Protocol version and the errors a client sees.

The server reports failures as gRPC status codes (documented in ``proto/distsgd.proto``); the
client turns them into :class:`RemoteError` carrying the code and the server's one-line message.
"""

from __future__ import annotations

import grpc

from distsgd.transport.proto import distsgd_pb2 as pb

PROTOCOL_VERSION: int = pb.PROTOCOL_VERSION
"""The wire-protocol version this build speaks (``ProtocolVersion.PROTOCOL_VERSION``)."""

NOT_REGISTERED = "not registered"
"""Marker in a FAILED_PRECONDITION message meaning: the chief has not registered this shard yet."""


class RemoteError(RuntimeError):
    """A parameter-server call failed; ``code`` is the gRPC status code."""

    def __init__(self, address: str, method: str, code: grpc.StatusCode, message: str) -> None:
        super().__init__(f"{method} on parameter server {address} failed ({code.name}): {message}")
        self.address = address
        self.method = method
        self.code = code
        self.message = message

    @property
    def retryable(self) -> bool:
        """Whether trying again later can succeed (server down, or not registered yet)."""
        if self.code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
            return True
        return self.code == grpc.StatusCode.FAILED_PRECONDITION and NOT_REGISTERED in self.message
