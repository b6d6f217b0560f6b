"""Protocol version, the typed outcomes of a call, and the errors a client sees.

The server reports failures as gRPC status codes (documented in ``proto/distsgd.proto``); the
client turns them into :class:`RemoteError` carrying the code, the server's one-line message and,
where the code alone does not say enough, a typed :class:`Refusal` that the server sent as
trailing metadata under :data:`ERROR_KEY`. Nothing here matches message text.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from typing import Any

import grpc

from distsgd.transport.proto import distsgd_pb2 as pb

PROTOCOL_VERSION: int = pb.PROTOCOL_VERSION
"""The wire-protocol version this build speaks (``ProtocolVersion.PROTOCOL_VERSION``)."""

NOT_REGISTERED = "not registered"
"""Words in the FAILED_PRECONDITION message for a shard the chief has not registered yet (for
people; clients look at :attr:`RemoteError.refusal`)."""

MAX_WAIT_SECONDS = 60.0
"""Longest a Pull waits on the server for its ``min_version``; a longer ``wait_seconds``
(infinity included) is capped to it, and clients cap what they send the same way."""

ERROR_KEY = "x-distsgd-error"
"""Trailing-metadata key under which a server names the :class:`Refusal` of a failed call."""


class Refusal(enum.Enum):
    """Why a server refused a call, where the status code alone does not say (typed, on the
    wire as the value under :data:`ERROR_KEY`)."""

    NOT_REGISTERED = "not-registered"
    """FAILED_PRECONDITION: the chief has not registered this shard yet; retry."""
    BUSY = "busy"
    """RESOURCE_EXHAUSTED: the server holds its maximum of waiting pulls; retry."""
    TOO_LARGE = "too-large"
    """RESOURCE_EXHAUSTED: the message announces more bytes than the server's limit."""
    CLOSING = "closing"
    """UNAVAILABLE: the server is shutting down."""
    NO_SEGMENT = "no-segment"
    """INVALID_ARGUMENT: a shared-memory segment this server does not hold (it restarted, or
    dropped it); attach again, or send over the stream."""
    NO_SHARED_MEMORY = "no-shared-memory"
    """FAILED_PRECONDITION (Attach): shared memory cannot be used on this server's host."""
    NOT_MEMBER = "not-member"
    """FAILED_PRECONDITION (Heartbeat): the worker is not a member (never joined, left, or was
    evicted); it calls Join again."""
    RUN_FULL = "run-full"
    """RESOURCE_EXHAUSTED (Join): the worker index is beyond the server's ``--max-workers``."""
    NOT_MOVABLE = "not-movable"
    """FAILED_PRECONDITION (ExportPieces): the shard's rule keeps state that is not per piece
    (a synchronous step), so its pieces cannot move."""
    NOT_FROZEN = "not-frozen"
    """FAILED_PRECONDITION (ExportPieces, ImportPieces): another move holds these pieces (they
    are frozen for it); start the move again later."""
    NO_WORK = "no-work"
    """FAILED_PRECONDITION (LeaseWork): this shard hands out no work units (only shard 0 of a
    run registered with a work spec does)."""
    TAKEN = "taken"
    """ALREADY_EXISTS (Join with ``claim``): the worker index is, or was, in use in this run;
    a joining worker takes another (one never used)."""
    NO_SUCH_MOVE = "no-such-move"
    """FAILED_PRECONDITION (FinishMove): this shard has no open step of that move (it never
    exported or imported it here, or it was committed or undone already)."""
    MOVE_MISMATCH = "move-mismatch"
    """FAILED_PRECONDITION (ImportPieces, FinishMove): the step does not match its move: other
    pieces, peer, version or receipt than the export's (a stale copy), or pieces this shard
    holds already; nothing changed."""
    NOT_LOGGED = "not-logged"
    """UNAVAILABLE (a push): the server could not write the push to its write-ahead log in time
    (its disk is full), so it applied none of it and said nothing else: send it again."""

    @classmethod
    def named(cls, value: str) -> Refusal | None:
        """The refusal ``value`` names ("" or a newer server's reason: None)."""
        try:
            return cls(value)
        except ValueError:
            return None

    @classmethod
    def from_metadata(cls, metadata: Sequence[Any] | None) -> Refusal | None:
        """The refusal named in trailing ``metadata`` (key, value pairs), or None."""
        for item in metadata or ():
            if item[0] == ERROR_KEY:
                return cls.named(item[1])
        return None


class PushReject(enum.IntEnum):
    """Why a well-formed push was not applied: ``PushRejectReason`` of the .proto, same numbers.

    ``NONE`` (``PUSH_REJECT_REASON_UNSPECIFIED``) means it was accepted.
    """

    NONE = 0
    STALE = 1
    DUPLICATE = 2
    NONFINITE = 3
    LOST = 4
    """Never sent by a server: the client marks a push that did not reach the server."""
    MOVED = 5
    """A piece of the push lives on another shard now (``PushResponse.moved`` says where);
    nothing of it was applied: send its pieces again, each to its shard."""

    @property
    def label(self) -> str:
        """The word that starts the push's ``reason`` text ("stale", "nonfinite", ...)."""
        return self.name.lower()

    @property
    def wire_name(self) -> str:
        """The name of this value in the .proto's ``PushRejectReason``."""
        return f"PUSH_REJECT_REASON_{'UNSPECIFIED' if self is PushReject.NONE else self.name}"


RETRYABLE_REFUSALS = frozenset({Refusal.NOT_REGISTERED, Refusal.BUSY})


class RemoteError(RuntimeError):
    """A parameter-server call failed; ``code`` is the gRPC status code, ``refusal`` the typed
    reason the server gave (None when it gave none)."""

    def __init__(
        self,
        address: str,
        method: str,
        code: grpc.StatusCode,
        message: str,
        refusal: Refusal | None = None,
    ) -> None:
        super().__init__(f"{method} on parameter server {address} failed ({code.name}): {message}")
        self.address = address
        self.method = method
        self.code = code
        self.message = message
        self.refusal = refusal

    @property
    def retryable(self) -> bool:
        """Whether trying again later can succeed (server down or busy, or not registered yet)."""
        if self.code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
            return True
        return self.refusal in RETRYABLE_REFUSALS


def remote_error(address: str, method: str, exc: grpc.RpcError) -> RemoteError:
    """The typed error of a failed gRPC call."""
    trailing = exc.trailing_metadata() if isinstance(exc, grpc.Call) else None
    code = exc.code() if isinstance(exc, grpc.Call) else grpc.StatusCode.UNKNOWN
    details = (exc.details() if isinstance(exc, grpc.Call) else str(exc)) or ""
    return RemoteError(address, method, code, details, Refusal.from_metadata(trailing))


def as_remote_error(address: str, method: str, exc: grpc.RpcError | RemoteError) -> RemoteError:
    """``exc`` as a :class:`RemoteError` (a data channel's error frame is one already)."""
    return exc if isinstance(exc, RemoteError) else remote_error(address, method, exc)
