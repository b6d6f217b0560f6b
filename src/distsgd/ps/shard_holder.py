"""The shard one parameter server serves (None until the chief registers it), and the checks
every RPC of :class:`~distsgd.ps.service.ParameterService` makes against it: the request
header, the worker index, a registered shard, a server not shutting down. Each plane of the
service is given this one object instead of calling back into the service."""

from __future__ import annotations

import secrets
import threading
from collections.abc import Iterator
from typing import Any

import grpc

from distsgd.ps.checks import first_header
from distsgd.ps.rules import MAX_WORKERS
from distsgd.ps.service_errors import abort, clip
from distsgd.ps.shard import Shard
from distsgd.transport.errors import NOT_REGISTERED, PROTOCOL_VERSION, Refusal
from distsgd.transport.proto import distsgd_pb2 as pb


class ShardHolder:
    """Shard ``index``'s :class:`~distsgd.ps.shard.Shard` (None until registered), the server's
    incarnation, the lock a Register holds, and whether the server is closing."""

    def __init__(self, index: int, shard: Shard | None = None) -> None:
        self.index = index
        self.shard = shard
        self.incarnation = secrets.randbits(63) | 1
        """Random per server process; a client seeing another one knows the server restarted."""
        self.register_lock = threading.Lock()
        self.stop = threading.Event()
        """Set by the service's ``close`` (the server is stopping)."""

    @property
    def closing(self) -> bool:
        """Whether the service's ``close`` was called (the server is stopping)."""
        return self.stop.is_set()

    def check(self, header: pb.RequestHeader, context: grpc.ServicerContext) -> None:
        """The header's checks, and its worker index against the registered shard's."""
        self.check_header(header, context)
        shard = self.shard
        if shard is not None:
            self.check_worker(header.worker, shard.membership.max_workers, context)

    def stream_head(self, messages: Iterator[Any], context: grpc.ServicerContext) -> Any:
        """The header part that opens a stream of ``messages``, its request header checked."""
        head = first_header(messages, context)
        self.check(head.header, context)
        return head

    def check_header(self, header: pb.RequestHeader, context: grpc.ServicerContext) -> None:
        """The protocol version and the run; not the worker index."""
        if header.protocol_version != PROTOCOL_VERSION:
            abort(
                context,
                grpc.StatusCode.FAILED_PRECONDITION,
                f"protocol version mismatch: client speaks {header.protocol_version}, "
                f"server speaks {PROTOCOL_VERSION}; run the same distsgd version on every task",
            )
        shard = self.shard
        if shard is not None and shard.run_id and header.run_id and header.run_id != shard.run_id:
            abort(
                context,
                grpc.StatusCode.FAILED_PRECONDITION,
                f"a task of run {clip(header.run_id)} reached shard {self.index} of run "
                f"{shard.run_id}; stop the old run's tasks or give this run other ports",
            )

    @staticmethod
    def check_worker(worker: int, num_workers: int, context: grpc.ServicerContext) -> None:
        if not -1 <= worker < num_workers:
            abort(
                context,
                grpc.StatusCode.INVALID_ARGUMENT,
                f"worker {worker} is not in this run of {num_workers} workers; "
                "give each worker its index 0..N-1 (-1 for tools)",
            )

    def check_member(
        self, header: pb.RequestHeader, context: grpc.ServicerContext, *, joining: bool
    ) -> Shard:
        """The checks of a Join or Heartbeat: the header, a registered shard, a worker index
        (not -1) this shard accepts. A Join beyond max_workers is RESOURCE_EXHAUSTED."""
        self.check_header(header, context)
        shard = self.registered(context)
        worker = header.worker
        if not 0 <= worker < MAX_WORKERS:
            abort(
                context,
                grpc.StatusCode.INVALID_ARGUMENT,
                f"worker {worker} cannot be a member; give a worker index 0..{MAX_WORKERS - 1}",
            )
        limit = shard.membership.max_workers
        if joining and worker >= limit:
            abort(
                context,
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"worker {worker} cannot join ps{self.index}: it takes worker indexes "
                f"0..{limit - 1}; start the servers with a larger --max-workers",
                Refusal.RUN_FULL,
            )
        return shard

    def registered(self, context: grpc.ServicerContext) -> Shard:
        """The shard, or FAILED_PRECONDITION ``not-registered`` before the chief registered it."""
        shard = self.shard
        if shard is None:
            abort(
                context,
                grpc.StatusCode.FAILED_PRECONDITION,
                f"shard {self.index} {NOT_REGISTERED} yet; the chief registers it at start",
                Refusal.NOT_REGISTERED,
            )
        return shard

    def unless_closing(self, context: grpc.ServicerContext) -> None:
        """UNAVAILABLE ``closing`` once the server is stopping."""
        if self.closing:
            abort(
                context,
                grpc.StatusCode.UNAVAILABLE,
                f"ps{self.index} is shutting down; retry once it is back",
                Refusal.CLOSING,
            )
