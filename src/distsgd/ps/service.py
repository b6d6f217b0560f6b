"""The gRPC service of one parameter-server task (see ``transport/proto/distsgd.proto``).

Every field a peer sends is checked before anything changes: a request that fails a check is
refused as a whole with a documented status code and leaves the shard exactly as it was. A push
is validated whole (header, lr_scale, every key, dtype and shape, then every value finite)
before the rule sees any of it. An exception no check foresaw is answered INTERNAL and logged,
never UNKNOWN.

What is validated is what is applied: the rule only ever reads server-private memory that no
peer can write once the checks begin. A stream's chunks are assembled into buffers of the call
(``ChunkAssembler``); a data-channel frame is read into bytes of its own; a tensor socket's
payload is received into the entry's ``scratch``; a shared-memory push, whose segment the
worker (or any process mapping it) can still write, is first copied, exactly the announced
bytes, into that same ``scratch`` under the entry's lock, and checked and applied from there."""

from __future__ import annotations

import logging
import threading
from pathlib import Path
from typing import Any

from distsgd.ps.data_plane import DataPlane
from distsgd.ps.member_plane import MembershipPlane, WorkPlane
from distsgd.ps.membership import DEFAULT_EVICT_AFTER, check_evict_after
from distsgd.ps.move_plane import MovePlane
from distsgd.ps.registration import RegistrationPlane, starting_shard
from distsgd.ps.rules import RuleFactory, check_max_workers
from distsgd.ps.segments import SegmentTable
from distsgd.ps.shard import Shard
from distsgd.ps.shard_holder import ShardHolder
from distsgd.ps.shared_plane import SharedPlane
from distsgd.transport.codec import CHUNK_BYTES
from distsgd.transport.proto import distsgd_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)


def segment_record(checkpoint_dir: Path | None, shard_index: int) -> Path | None:
    """The file where ps ``shard_index`` records the names of the segments it creates: in its
    checkpoint folder (the run's, under ``distsgd run``), or None without one."""
    return None if checkpoint_dir is None else checkpoint_dir / f"ps{shard_index}.segments"


ROUTES = {
    "registration": ("Info", "Register", "Checkpoint"),
    "data": ("Pull", "Push"),
    "shared": ("Attach", "PullShared", "PushShared"),
    "moves": ("ExportPieces", "ImportPieces", "FinishMove"),
    "members": ("Join", "Heartbeat", "Leave"),
    "work": ("LeaseWork",),
}
"""The plane attribute of :class:`ParameterService` that serves each RPC."""


class ParameterService(pb_grpc.ParameterServerServicer):
    """Serves one shard. The shard exists once the chief has registered it.

    Each RPC is routed to the plane that owns its state, all of them given one
    :class:`~distsgd.ps.shard_holder.ShardHolder` (the shard and the checks of every call):
    registration (Info, Register, Checkpoint), data (Pull, Push), shared memory and tensor
    sockets (Attach, PullShared, PushShared), moves (ExportPieces, ImportPieces, FinishMove),
    membership (Join, Heartbeat, Leave) and work (LeaseWork).

    At most ``max_waiting_pulls`` Pulls wait for a version at once (each holds a server thread);
    one more is answered RESOURCE_EXHAUSTED (``Refusal.BUSY``, retried by clients), so waiting
    pulls never take the threads that pushes, Info and Leave need. :meth:`close` wakes every
    waiting pull, which then answers UNAVAILABLE."""

    def __init__(
        self,
        *,
        shard_index: int,
        rule_factory: RuleFactory,
        chunk_bytes: int = CHUNK_BYTES,
        checkpoint_dir: Path | None = None,
        restore: Path | None = None,
        max_waiting_pulls: int = 48,
        host: str = "",
        tls: bool = False,
        max_workers: int = 0,
        evict_after: float = DEFAULT_EVICT_AFTER,
        wal_dir: Path | None = None,
    ) -> None:
        """``wal_dir``: the shard's write-ahead log (None = none; see :mod:`distsgd.ps.wal`):
        a shard found there is served (or ``restore``'s, if newer). ``host``: the address the
        server listens on, where it offers tensor sockets ("" = none); ``tls``: the server
        encrypts its calls, so it offers no tensor sockets.
        ``max_workers``: worker indexes up to this may join (0 = the registered number);
        ``evict_after``: seconds after which a silent member is evicted (see
        :mod:`distsgd.ps.membership`)."""
        self.shard_index = shard_index
        self.holder = ShardHolder(shard_index)
        self.data = DataPlane(
            self.holder, chunk_bytes=chunk_bytes, max_waiting_pulls=max_waiting_pulls
        )
        self.registration = RegistrationPlane(
            self.holder,
            rule_factory,
            max_workers=check_max_workers(max_workers),
            evict_after=check_evict_after(evict_after),
            wal_dir=wal_dir,
            checkpoint_dir=checkpoint_dir,
        )
        self.holder.shard = starting_shard(
            shard_index=shard_index,
            rule_factory=rule_factory,
            restore=restore,
            wal_dir=wal_dir,
            max_workers=max_workers,
            evict_after=evict_after,
        )
        self._segments = SegmentTable()
        self.shared = SharedPlane(
            self.holder,
            self.data,
            self._segments,
            host=host,
            tls=tls,
            segment_record=segment_record(checkpoint_dir, shard_index),
        )
        self.moves = MovePlane(self.holder, self._segments, chunk_bytes=chunk_bytes)
        self.members = MembershipPlane(self.holder)
        self.work = WorkPlane(self.holder)
        for plane, methods in ROUTES.items():  # each RPC served by its plane's method
            for method in methods:
                setattr(self, method, getattr(getattr(self, plane), method))
        self._ticker = threading.Thread(
            target=self._tick, name=f"ps{shard_index}-tick", daemon=True
        )
        self._ticker.start()

    @property
    def shard(self) -> Shard | None:
        """The shard served (None until the chief registers it)."""
        return self.holder.shard

    @property
    def incarnation(self) -> int:
        """Random per server process; a client seeing another one knows the server restarted."""
        return self.holder.incarnation

    @property
    def waiting_pulls(self) -> int:
        """How many Pulls are waiting for a version now."""
        return self.data.waiting_pulls

    @property
    def max_waiting_pulls(self) -> int:
        """How many Pulls may wait for a version at once."""
        return self.data.max_waiting_pulls

    @max_waiting_pulls.setter
    def max_waiting_pulls(self, value: int) -> None:
        self.data.max_waiting_pulls = value

    @property
    def tls(self) -> bool:
        """Whether the server encrypts its calls (then it offers no tensor sockets)."""
        return self.shared.tls

    @tls.setter
    def tls(self, value: bool) -> None:
        self.shared.tls = value

    def diagnose(self) -> dict[str, Any]:
        """What ``distsgd doctor`` reads of this server: its version, the Pulls waiting for a
        later one (whose workers wait on it) and what its rule waits for (a synchronous step
        open for the workers that have not pushed)."""
        shard = self.holder.shard
        if shard is None:
            return {"shard": self.shard_index, "registered": False}
        return {
            "shard": self.shard_index,
            "registered": True,
            "version": shard.version,
            "members": sorted(shard.membership.members),
            "finished": sorted(shard.finished),
            "waiting_pulls": self.data.waiters(),
            "serving": self.data.serving(),
            "rule": type(shard.rule).__name__,
            "waits_for": shard.rule.waiting_for(shard),
        }

    def close(self) -> None:
        """Stop the background ticker and wake every waiting Pull (they answer UNAVAILABLE)."""
        self.holder.stop.set()
        shard = self.holder.shard
        if shard is not None:
            shard.close()
        self._segments.close()
        self.shared.close()

    def _tick(self) -> None:
        while not self.holder.stop.wait(0.5):
            shard = self.holder.shard
            if shard is not None:
                shard.tick()
                if shard.wal is not None:
                    shard.wal.maybe_compact(shard)
            self._segments.purge()
