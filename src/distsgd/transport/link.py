"""How one client's calls reach its shard: the address, the gRPC stub, the request header
every call carries (protocol version, run, worker, incarnation), the run secret as call
metadata, and the deadline of one call. Shared by the client and its carriers."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np

from distsgd.transport.codec import WireError, is_encoded, nbytes_of
from distsgd.transport.proto import distsgd_pb2 as pb
from distsgd.transport.proto import distsgd_pb2_grpc as pb_grpc


class PullDecoding(Protocol):
    """How a client decodes the pieces of an encoded pull ("Encoded pulls" in the
    .proto). The transport moves bytes; the parameter-server side knows the encodings
    (:class:`distsgd.ps.pull_encoding.PullDecoder`)."""

    @property
    def requested(self) -> str:
        """The ``PullRequest.encoding`` to ask, by name (``TENSOR_ENCODING_BF16``)."""
        ...

    def nbytes(self, spec: pb.TensorSpec) -> int:
        """Bytes the piece ``spec`` announces takes on the wire (WireError: not acceptable)."""
        ...

    def decode(self, spec: pb.TensorSpec, raw: np.ndarray) -> np.ndarray:
        """The values of an encoded piece, ``raw`` its bytes (WireError: malformed)."""
        ...


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
    pull_decoding: PullDecoding | None = None
    """Pulls ask their float pieces encoded, and decode them so (None: RAW pulls)."""

    def pull_nbytes(self, spec: pb.TensorSpec) -> int:
        """Bytes a pulled piece takes on the wire; WireError for an encoded piece this client
        did not ask for."""
        if self.pull_decoding is not None:
            return self.pull_decoding.nbytes(spec)
        if is_encoded(spec):
            raise WireError(f"{spec.key}: an encoded piece answered a RAW pull")
        return nbytes_of(spec)

    def decode_pulled(self, spec: pb.TensorSpec, raw: np.ndarray) -> np.ndarray:
        """A pulled piece's values: ``raw`` (its bytes, uint8) decoded where it is encoded."""
        if self.pull_decoding is None or not is_encoded(spec):
            return raw
        return self.pull_decoding.decode(spec, raw)

    @property
    def host(self) -> str:
        """The host part of :attr:`address` (brackets of an IPv6 address removed)."""
        return self.address.rsplit(":", 1)[0].strip("[]")
