"""The data calls of the parameter-server service over gRPC streams: Pull (and its wait for a
version, at most ``max_waiting_pulls`` at once) and Push. The shared-memory and tensor-socket
calls (:mod:`distsgd.ps.shared_plane`) reuse its checks, its wait and its apply."""

from __future__ import annotations

import contextlib
import itertools
import threading
import time
from collections.abc import Iterator
from typing import Any

import grpc
import numpy as np

from distsgd.ps import checks
from distsgd.ps.checks import push_nbytes
from distsgd.ps.move_plane import moved_owners
from distsgd.ps.pull_encoding import encode_pull
from distsgd.ps.rules import PushMeta
from distsgd.ps.service_errors import abort, guarded
from distsgd.ps.shard import Shard
from distsgd.ps.shard_holder import ShardHolder
from distsgd.transport.codec import header_then_chunks
from distsgd.transport.errors import PushReject, Refusal
from distsgd.transport.proto import distsgd_pb2 as pb


class DataPlane:
    """Pull and Push of ``holder``'s shard; a pull's answer streamed in ``chunk_bytes`` chunks.

    At most ``max_waiting_pulls`` Pulls wait for a version at once (each holds a server thread);
    one more is answered RESOURCE_EXHAUSTED (``Refusal.BUSY``, retried by clients), so waiting
    pulls never take the threads that pushes, Info and Leave need."""

    def __init__(self, holder: ShardHolder, *, chunk_bytes: int, max_waiting_pulls: int) -> None:
        if max_waiting_pulls < 1:
            raise ValueError(f"max_waiting_pulls must be at least 1, got {max_waiting_pulls}")
        self.holder = holder
        self.chunk_bytes = chunk_bytes
        self.max_waiting_pulls = max_waiting_pulls
        self._waiting: dict[int, tuple[int, int, float]] = {}
        """Each waiting Pull's (worker, version it waits for, ``time.monotonic()`` it began)."""
        self._waiting_lock = threading.Lock()
        self._serving: dict[int, tuple[str, int, float]] = {}
        """Each Pull and Push being answered: (method, worker, ``time.monotonic()`` begun)."""
        self._keys = itertools.count()
        self.delay = 0.0
        """Seconds each pull and push waits before its answer (an injected slow server)."""

    def set_delay(self, seconds: float) -> None:
        """Answer every pull and push ``seconds`` later (``--inject-fault delay:ps:N=...``)."""
        if not seconds >= 0:
            raise ValueError(f"an injected delay must be 0 or more seconds, got {seconds}")
        self.delay = seconds

    @property
    def waiting_pulls(self) -> int:
        """How many Pulls are waiting for a version now."""
        return len(self._waiting)

    def waiters(self) -> list[dict[str, Any]]:
        """The Pulls waiting now, longest first (what ``distsgd doctor`` reads)."""
        now = time.monotonic()
        waiting = sorted(list(self._waiting.values()), key=lambda w: w[2])
        return [{"worker": w, "for_version": v, "age_s": round(now - t, 3)} for w, v, t in waiting]

    def serving(self) -> list[dict[str, Any]]:
        """The Pulls and Pushes this server is answering now, by worker (what ``distsgd
        doctor`` reads: a call a worker has in flight that its server does not list never
        reached it)."""
        now = time.monotonic()
        calls = sorted(list(self._serving.values()), key=lambda c: c[2])
        return [{"method": m, "worker": w, "age_s": round(now - t, 3)} for m, w, t in calls]

    @contextlib.contextmanager
    def _served(self, method: str, worker: int) -> Iterator[None]:
        key = next(self._keys)
        self._serving[key] = (method, worker, time.monotonic())
        try:
            yield
        finally:
            del self._serving[key]

    def _start_waiting(self, worker: int, version: int) -> int | None:
        """Take one of the ``max_waiting_pulls`` places (its key); None when all are taken."""
        with self._waiting_lock:
            if len(self._waiting) >= self.max_waiting_pulls:
                return None
            key = next(self._keys)
            self._waiting[key] = (worker, version, time.monotonic())
            return key

    def check_pull(
        self, request: pb.PullRequest, context: grpc.ServicerContext
    ) -> tuple[Shard, float]:
        """The checks of a pull, which change nothing: (shard, seconds it may wait)."""
        self.holder.check(request.header, context)
        shard = self.holder.registered(context)
        wait = checks.wait_seconds(request.wait_seconds, context)
        remaining = context.time_remaining()
        if remaining is not None:
            wait = min(wait, remaining)
        self.holder.unless_closing(context)
        return shard, wait

    def await_version(
        self, shard: Shard, wait: float, request: pb.PullRequest, context: grpc.ServicerContext
    ) -> float:
        """A checked pull (:meth:`check_pull`) makes its worker a member, then waits for
        ``min_version``: the seconds waited. A pull refused BUSY changes nothing."""
        holder = self.holder
        restarted = request.server_incarnation not in (0, holder.incarnation)
        if restarted or shard.version >= request.min_version:
            shard.see(request.header.worker, request.header.incarnation)
            return 0.0
        key = self._start_waiting(request.header.worker, request.min_version)
        if key is None:
            abort(
                context,
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"ps{holder.index} already holds {self.max_waiting_pulls} waiting pulls; "
                "retry later, or start the server with more threads",
                Refusal.BUSY,
            )
        began = time.monotonic()
        try:
            shard.see(request.header.worker, request.header.incarnation)
            reached = shard.wait_for(request.min_version, wait)
        finally:
            with self._waiting_lock:
                del self._waiting[key]
            waited = time.monotonic() - began
        holder.unless_closing(context)
        if not reached:
            abort(
                context,
                grpc.StatusCode.DEADLINE_EXCEEDED,
                f"shard {holder.index} still at version {shard.version} after {wait:.1f}s "
                f"waiting for version {request.min_version}",
            )
        stall(shard, self.delay)
        return waited

    @guarded
    def Pull(
        self, request: pb.PullRequest, context: grpc.ServicerContext
    ) -> Iterator[pb.PullResponse]:
        with self._served("Pull", request.header.worker):
            started = time.perf_counter()
            shard, wait = self.check_pull(request, context)
            encoding = checks.pull_encoding(request.encoding, context)
            keys = checks.pull_keys(request.keys, context)
            waited = self.await_version(shard, wait, request, context)
            # A locked rule's values are copied under its lock (one version); an unlocked rule's
            # are streamed as they are, each chunk copied (or encoded) as it goes, as its readers
            # expect.
            version, values = shard.snapshot(keys) if shard.rule.locked else shard.live(keys)
            specs, arrays = encode_pull(values, encoding)
            busy = time.perf_counter() - started - waited
            shard.load.pulled({s.key: a.nbytes for s, a in zip(specs, arrays, strict=True)}, busy)
            header = pb.PullHeader(
                version=version,
                tensors=specs,
                server_incarnation=self.holder.incarnation,
                waited_seconds=waited,
            )
            yield from header_then_chunks(pb.PullResponse, header, arrays, self.chunk_bytes)

    @guarded
    def Push(
        self, request_iterator: Iterator[pb.PushRequest], context: grpc.ServicerContext
    ) -> pb.PushResponse:
        head = self.holder.stream_head(request_iterator, context)
        with self._served("Push", head.header.worker):
            shard = self.holder.registered(context)
            lr_scale = checks.lr_scale(head.lr_scale, context)
            checks.push_sequence(head.sequence, context)
            checks.check_push_specs(shard, head.tensors, context)
            payload = checks.assemble(head.tensors, request_iterator, context, push_nbytes)
            payload = checks.decode(head.tensors, payload, context)
            return apply_push(shard, head, lr_scale, payload, delay=self.delay)


def stall(shard: Shard, seconds: float, *, push: bool = False) -> None:
    """An injected slow server's wait (none at 0); a ``push``'s counts as ``shard``'s busy time
    (a pull's is counted in its pull's)."""
    if seconds > 0:
        time.sleep(seconds)
        if push:
            shard.load.stalled(seconds)


def apply_push(
    shard: Shard,
    head: pb.PushHeader,
    lr_scale: float,
    payload: dict[str, np.ndarray],
    *,
    delay: float = 0.0,
) -> pb.PushResponse:
    """Apply a checked push's ``payload`` to ``shard``, ``delay`` seconds late (an injected
    slow server): its answer (a MOVED one says where its pieces went)."""
    stall(shard, delay, push=True)
    meta = PushMeta(
        lr_scale=lr_scale,
        worker=head.header.worker,
        incarnation=head.header.incarnation,
        base_version=head.base_version,
        sequence=head.sequence,
    )
    outcome, version = shard.push(payload, meta)
    reply = pb.PushResponse(
        accepted=outcome.accepted,
        version=version,
        reason=outcome.reason,
        reject=outcome.reject.wire_name,
        duplicate=outcome.duplicate,
    )
    if outcome.reject is PushReject.MOVED:
        reply.moved.extend(moved_owners(shard, list(payload)))
    return reply
