"""The interface every carrier of a client's tensors offers (one implementation per carrier),
and what travels through it: a push's :class:`Payload`, raw or encoded."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from distsgd.transport.codec import spec_of
from distsgd.transport.errors import RemoteError
from distsgd.transport.proto import distsgd_pb2 as pb

EncodedPieces = Mapping[str, tuple[pb.TensorSpec, Sequence[np.ndarray]]]
"""Pieces already encoded (see "Encodings" in the .proto): each key maps to its spec
(registered dtype and shape, ``encoding``, ``scale``, ``nnz``) and the 1-D arrays whose bytes,
back to back, are its payload."""


@dataclass(frozen=True, kw_only=True)
class Payload:
    """A push's pieces as they travel: each piece's spec and its bytes."""

    specs: tuple[pb.TensorSpec, ...]
    """Each piece's spec, in push order."""
    arrays: tuple[np.ndarray, ...]
    """Each piece's data: a raw piece's array, or an encoded piece's bytes (uint8, 1-D)."""
    encoded: bool
    """Whether the pieces are encoded (else raw arrays of the registered dtype and shape)."""

    @classmethod
    def raw(cls, tensors: Mapping[str, np.ndarray]) -> Payload:
        """Raw arrays (gradients, updates) by key."""
        return cls(
            specs=tuple(spec_of(key, np.asarray(a)) for key, a in tensors.items()),
            arrays=tuple(tensors.values()),
            encoded=False,
        )

    @classmethod
    def of_encoded(cls, pieces: EncodedPieces) -> Payload:
        """Pieces already encoded."""
        return cls(
            specs=tuple(spec for spec, _ in pieces.values()),
            arrays=tuple(_as_bytes(parts) for _, parts in pieces.values()),
            encoded=True,
        )

    def only(self, keys: Collection[str]) -> Payload:
        """The pieces among ``keys``, as they are (a push re-sent to the shards its pieces
        moved to, without encoding them again)."""
        pairs = [(s, a) for s, a in zip(self.specs, self.arrays, strict=True) if s.key in keys]
        return Payload(
            specs=tuple(s for s, _ in pairs),
            arrays=tuple(a for _, a in pairs),
            encoded=self.encoded,
        )

    def items(self) -> list[tuple[str, np.ndarray]]:
        """(key, data) of each piece, in push order."""
        return [(spec.key, array) for spec, array in zip(self.specs, self.arrays, strict=True)]


def _as_bytes(parts: Sequence[np.ndarray]) -> np.ndarray:
    """The parts' bytes back to back, as one uint8 array (no copy for a single contiguous part)."""
    views = [np.ascontiguousarray(part).reshape(-1).view(np.uint8) for part in parts]
    return views[0] if len(views) == 1 else np.concatenate(views)


class CarrierFailed(Exception):
    """An attached carrier failed and is to be abandoned: the client counts the failure
    (unless ``counted`` is False), then raises ``error``, or, without one, sends the request
    again by another carrier (it never landed, or a pull may simply be repeated)."""

    def __init__(
        self, why: object, *, error: RemoteError | None = None, counted: bool = True
    ) -> None:
        super().__init__(str(why))
        self.why = why
        self.error = error
        self.counted = counted


class Carrier(ABC):
    """One way a client's tensors travel to and from its shard."""

    segment_id: int = 0
    """The id requests through this carrier name (0: none, the stream)."""

    @abstractmethod
    def pull(
        self, request: pb.PullRequest, wait: float
    ) -> tuple[pb.PullHeader, dict[str, np.ndarray]]:
        """Send ``request`` (its wait on the server at most ``wait`` seconds): the answer's
        header and the values. An attached carrier raises :class:`CarrierFailed`."""

    @abstractmethod
    def carries(self, payload: Payload) -> bool:
        """Whether this carrier can take ``payload`` (every piece has its place)."""

    @abstractmethod
    def push(self, header: pb.PushHeader, payload: Payload) -> pb.PushResponse:
        """Send a push: ``header`` (of this carrier's segment id) and ``payload``'s bytes.
        An attached carrier raises :class:`CarrierFailed`."""

    def push_area(self) -> dict[str, np.ndarray] | None:
        """Where a payload may be written in place, one array per piece (None: nowhere)."""
        return None

    def release_pulled(self) -> None:  # noqa: B027 (most carriers keep their buffers)
        """Give the memory of the last pull's values back (the next pull writes them again);
        only after they were copied where they are kept."""

    def close(self) -> None:  # noqa: B027 (most carriers hold nothing to close)
        """Release what the carrier holds (a mapping, a connection)."""
