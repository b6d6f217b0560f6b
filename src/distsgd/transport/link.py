"""How one client's calls reach its shard: the address, the gRPC stub, the request header
every call carries (protocol version, run, worker, incarnation), the run secret as call
metadata, and the deadline of one call. Shared by the client and its carriers."""

from __future__ import annotations

from dataclasses import dataclass

from distsgd.transport.proto import distsgd_pb2 as pb
from distsgd.transport.proto import distsgd_pb2_grpc as pb_grpc


@dataclass(frozen=True, kw_only=True)
class Link:
    """The parts every call of one client to one shard shares."""

    address: str
    """The shard's ``host:port``."""
    stub: pb_grpc.ParameterServerStub
    """The gRPC stub on the client's channel."""
    header: pb.RequestHeader
    """The header of every request (never changed once built)."""
    metadata: tuple[tuple[str, str], ...] | None
    """Call metadata: the run secret (None: none)."""
    timeout: float
    """Seconds one call may take (a pull's wait comes on top)."""

    @property
    def host(self) -> str:
        """The host part of :attr:`address` (brackets of an IPv6 address removed)."""
        return self.address.rsplit(":", 1)[0].strip("[]")
