"""A client for one parameter-server shard: every call has a deadline, transient failures retry.

Retries cover what a healthy cluster shows at start-up and under load: a server not listening
yet (UNAVAILABLE) and a shard the chief has not registered yet. They back off exponentially and
give up at ``retry_seconds`` with the last error.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import TypeVar

import grpc
import numpy as np

from distsgd.transport.codec import CHUNK_BYTES, ChunkAssembler, iter_chunks, specs_of
from distsgd.transport.errors import (
    MAX_WAIT_SECONDS,
    PROTOCOL_VERSION,
    PushReject,
    Refusal,
    RemoteError,
)
from distsgd.transport.proto import distsgd_pb2 as pb
from distsgd.transport.proto import distsgd_pb2_grpc as pb_grpc
from distsgd.transport.security import (
    METADATA_KEY,
    TlsConfig,
    channel_credentials,
    check_secret,
)

log = logging.getLogger(__name__)

MAX_RETRY_DELAY = 0.5
"""Longest wait between two tries of a failed call: a restarted server listens again within a
second, so a longer wait would be the larger part of a restart's cost."""
T = TypeVar("T")

GRPC_OPTIONS = [
    ("grpc.max_send_message_length", 8 * CHUNK_BYTES),
    ("grpc.max_receive_message_length", 8 * CHUNK_BYTES),
]


@dataclass(frozen=True)
class PushResult:
    """What a shard did with a push: ``reject`` says why it was not applied (typed; decide on
    it), ``reason`` in words (for people)."""

    accepted: bool
    version: int
    reason: str = ""
    reject: PushReject = PushReject.NONE


class ShardClient:
    """Calls on one parameter-server shard at ``address``.

    ``secret`` (the run secret; None or "" = none) travels as call metadata on every RPC.
    ``tls`` makes the channel mutual TLS: the server's certificate must be signed by ``tls.ca``
    and name the host in ``address``; ``tls.cert`` is presented as the client certificate.
    """

    def __init__(
        self,
        address: str,
        *,
        worker: int = -1,
        incarnation: int = 0,
        run_id: str = "",
        timeout: float = 30.0,
        retry_seconds: float = 60.0,
        chunk_bytes: int = CHUNK_BYTES,
        secret: str | None = None,
        tls: TlsConfig | None = None,
    ) -> None:
        self.address = address
        self.timeout = timeout
        self.retry_seconds = retry_seconds
        self.chunk_bytes = chunk_bytes
        self._header = pb.RequestHeader(
            protocol_version=PROTOCOL_VERSION, run_id=run_id, worker=worker, incarnation=incarnation
        )
        self.server_incarnation = 0
        """The server process last seen (0 = none yet); it changes when the server restarts."""
        self.last_waited = 0.0
        """Seconds the server spent waiting for ``min_version`` in the last pull (its report,
        clamped to the pull's own duration)."""
        self._metadata: tuple[tuple[str, str], ...] | None = (
            ((METADATA_KEY, check_secret(secret)),) if secret else None
        )
        self._channel = (
            grpc.secure_channel(address, channel_credentials(tls), options=GRPC_OPTIONS)
            if tls is not None
            else grpc.insecure_channel(address, options=GRPC_OPTIONS)
        )
        self._stub = pb_grpc.ParameterServerStub(self._channel)

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> ShardClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- plumbing -------------------------------------------------------------------------------
    def _call(self, method: str, fn: Callable[[], T], *, retry: bool = True) -> T:
        give_up = time.monotonic() + self.retry_seconds
        delay = 0.05
        while True:
            try:
                return fn()
            except grpc.RpcError as exc:
                trailing = exc.trailing_metadata() if isinstance(exc, grpc.Call) else None
                err = RemoteError(
                    self.address,
                    method,
                    exc.code(),
                    exc.details() or "",
                    Refusal.from_metadata(trailing),
                )
                if not (retry and err.retryable) or time.monotonic() + delay > give_up:
                    raise err from None
                log.debug("%s; retrying in %.2fs", err, delay)
                time.sleep(delay)
                delay = min(delay * 2, MAX_RETRY_DELAY)

    # -- RPCs -----------------------------------------------------------------------------------
    def info(self, *, retry: bool = True) -> pb.InfoResponse:
        """The shard's state (registered, version, pieces, membership counters)."""
        request = pb.InfoRequest(header=self._header)
        return self._call(
            "Info",
            lambda: self._stub.Info(request, timeout=self.timeout, metadata=self._metadata),
            retry=retry,
        )

    def register(
        self,
        *,
        shard_index: int,
        scheme: str,
        options_json: str,
        num_workers: int,
        tensors: Mapping[str, np.ndarray],
    ) -> pb.RegisterResponse:
        """Hand the shard its pieces, their initial values and its update rule."""
        header = pb.RegisterHeader(
            header=self._header,
            scheme=scheme,
            options_json=options_json,
            num_workers=num_workers,
            tensors=specs_of(tensors),
            shard_index=shard_index,
        )
        arrays = list(tensors.values())

        def messages() -> Iterator[pb.RegisterRequest]:
            yield pb.RegisterRequest(header=header)
            for chunk in iter_chunks(arrays, self.chunk_bytes):
                yield pb.RegisterRequest(chunk=chunk)

        return self._call(
            "Register",
            lambda: self._stub.Register(messages(), timeout=self.timeout, metadata=self._metadata),
        )

    def pull(
        self, *, min_version: int = 0, wait_seconds: float | None = None
    ) -> tuple[int, dict[str, np.ndarray]]:
        """The shard's pieces once its version is at least ``min_version``: (version, arrays).

        A server that restarted (from a checkpoint) answers at once whatever ``min_version``:
        the versions the caller counted belong to the lost process. ``wait_seconds`` (default:
        the RPC timeout) is capped at ``MAX_WAIT_SECONDS``, as the server would cap it.
        """
        wait = self.timeout if wait_seconds is None else wait_seconds
        if math.isnan(wait) or wait < 0:
            raise ValueError(f"wait_seconds must be 0 or more, got {wait}")
        wait = min(wait, MAX_WAIT_SECONDS)

        def do() -> tuple[int, dict[str, np.ndarray]]:
            began = time.monotonic()
            request = pb.PullRequest(
                header=self._header,
                min_version=min_version,
                wait_seconds=wait,
                server_incarnation=self.server_incarnation,
            )
            stream = self._stub.Pull(request, timeout=wait + self.timeout, metadata=self._metadata)
            first = next(stream)
            if first.WhichOneof("part") != "header":
                raise RemoteError(self.address, "Pull", grpc.StatusCode.INTERNAL, "no header first")
            assembler = ChunkAssembler(first.header.tensors)
            for message in stream:
                assembler.add(message.chunk)
            arrays = assembler.finish()
            self.server_incarnation = first.header.server_incarnation
            self.last_waited = _waited(first.header.waited_seconds, time.monotonic() - began)
            return first.header.version, arrays

        return self._call("Pull", do)

    def push(
        self, *, base_version: int, tensors: Mapping[str, np.ndarray], lr_scale: float = 1.0
    ) -> PushResult:
        """Send a gradient or update computed on parameters of ``base_version``.

        Not retried on a lost connection: the server may have applied it already.
        """
        header = pb.PushHeader(
            header=self._header,
            base_version=base_version,
            tensors=specs_of(tensors),
            lr_scale=lr_scale,
        )
        arrays = list(tensors.values())

        def messages() -> Iterator[pb.PushRequest]:
            yield pb.PushRequest(header=header)
            for chunk in iter_chunks(arrays, self.chunk_bytes):
                yield pb.PushRequest(chunk=chunk)

        reply = self._call(
            "Push",
            lambda: self._stub.Push(messages(), timeout=self.timeout, metadata=self._metadata),
            retry=False,
        )
        return PushResult(
            accepted=reply.accepted,
            version=reply.version,
            reason=reply.reason,
            reject=_push_reject(reply.reject),
        )

    def checkpoint(self, name: str) -> pb.CheckpointResponse:
        """Ask the shard to write its state under checkpoint ``name``."""
        request = pb.CheckpointRequest(header=self._header, name=name)
        return self._call(
            "Checkpoint",
            lambda: self._stub.Checkpoint(request, timeout=self.timeout, metadata=self._metadata),
        )

    def leave(self) -> int:
        """Tell the shard this worker has finished; returns the shard's version."""
        request = pb.LeaveRequest(header=self._header)
        return self._call(
            "Leave",
            lambda: self._stub.Leave(request, timeout=self.timeout, metadata=self._metadata),
        ).version


def _waited(reported: float, elapsed: float) -> float:
    """The server's ``waited_seconds``, trusted only within [0, the call's own duration]."""
    if not math.isfinite(reported) or reported <= 0:
        return 0.0
    return min(reported, elapsed)


def _push_reject(value: int) -> PushReject:
    """The typed reject reason of a reply; a number this build does not know counts as STALE
    (not applied, nothing to stop for), never as accepted."""
    try:
        return PushReject(value)
    except ValueError:
        return PushReject.STALE
