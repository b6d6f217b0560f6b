"""Keeping a worker a member of every shard (:class:`Heartbeat`), over a
:class:`~distsgd.ps.client.ParameterClient`'s shard clients."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Protocol

from distsgd.transport.client import ShardClient
from distsgd.transport.errors import Refusal, RemoteError
from distsgd.transport.proto import distsgd_pb2 as pb

log = logging.getLogger(__name__)


class Members(Protocol):
    """What a heartbeat keeps a member: a worker's client of every shard (as
    :class:`~distsgd.ps.client.ParameterClient`), and each shard's members as last heard."""

    worker: int
    shards: list[ShardClient]
    members: list[list[int]]


MembershipCallback = Callable[[int, int, list[int]], None]
"""Called with (shard index, epoch, members) whenever a shard's membership epoch changes."""

MIN_HEARTBEAT_SECONDS = 0.05
"""Shortest interval between two heartbeats to one shard."""


class Heartbeat:
    """Keeps a worker a member of every shard: a daemon thread sends each shard a Heartbeat
    every third of its eviction timeout (two may be lost before the shard evicts it), joins
    again where a shard answers NOT_MEMBER (it was evicted, or the shard restarted), and calls
    ``on_change`` whenever the epoch a shard reports changes. Errors are logged, never raised:
    a shard that is down is retried at the next beat. :meth:`stop` before ``leave``."""

    def __init__(
        self,
        client: Members,
        joined: Sequence[pb.MembershipResponse],
        on_change: MembershipCallback,
    ) -> None:
        self.client = client
        self.on_change = on_change
        self.epochs = [r.epoch for r in joined]
        self.intervals = [_interval(r.evict_after_seconds) for r in joined]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ps-heartbeat", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """End the thread (waits for a beat in flight, at most one call's timeout)."""
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        due = [time.monotonic() + t for t in self.intervals]
        while True:
            now = time.monotonic()
            if self._stop.wait(max(0.0, min(due) - now)):
                return
            for i, shard in enumerate(self.client.shards):
                if due[i] > time.monotonic():
                    continue
                self._beat(i, shard)
                due[i] = time.monotonic() + self.intervals[i]

    def _beat(self, i: int, shard: ShardClient) -> None:
        timeout = min(max(self.intervals[i], 1.0), 5.0)
        try:
            try:
                reply = shard.heartbeat(timeout=timeout)
            except RemoteError as exc:
                if exc.refusal is not Refusal.NOT_MEMBER:
                    raise
                log.warning("ps%d no longer counts worker %d; joining again", i, self.client.worker)
                reply = shard.join(retry=False)
        except RemoteError as exc:
            log.warning("heartbeat to ps%d failed: %s", i, exc)
            return
        self.intervals[i] = _interval(reply.evict_after_seconds)
        self.client.members[i] = list(reply.members)
        if reply.epoch != self.epochs[i]:
            self.epochs[i] = reply.epoch
            self.on_change(i, reply.epoch, list(reply.members))


def _interval(evict_after: float) -> float:
    """Seconds between heartbeats for a shard that evicts after ``evict_after`` seconds."""
    return max(MIN_HEARTBEAT_SECONDS, evict_after / 3) if evict_after > 0 else 20.0
