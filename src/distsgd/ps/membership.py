"""Who takes part in a run, as one shard sees it: live members, their last-seen times, an epoch.

Standard library only. The shard owns one :class:`Membership` and calls it under its lock.
The rules of the wire protocol's "Membership" section (``transport/proto/distsgd.proto``):

* at registration the members are the registered workers ``0 .. num_workers-1``, at epoch 0;
* :meth:`join` (explicit) and :meth:`see` (implicit: a pull or push) make a worker a member and
  refresh its last-seen time; :meth:`see` does not bring back a worker that left;
* :meth:`heartbeat` refreshes a member, and reports a worker that is not one;
* :meth:`leave` and :meth:`evict` (silent for more than ``evict_after`` seconds) remove one;
* the epoch goes up by one with every change of the set of members, never otherwise;
* :meth:`claim` (a Join with ``claim``: ``distsgd elastic join``) takes an index as a new one:
  only an index never in use at this shard (not registered, never a member), so two joiners
  never run as the same worker, and a departed worker's index is never handed out again.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

DEFAULT_EVICT_AFTER = 60.0
"""Seconds a member may stay silent (no call at all) before the shard evicts it."""

MAX_EVICT_AFTER = 86400.0
"""Longest ``--evict-after`` a server accepts (a day)."""

WORLD_SIZES = ("fixed", "dynamic")
"""How rules count workers: the registered number, or the live members."""


def check_evict_after(seconds: float) -> float:
    """``seconds`` as an eviction timeout, or a one-line ValueError."""
    if not (math.isfinite(seconds) and 0 < seconds <= MAX_EVICT_AFTER):
        raise ValueError(
            f"--evict-after must be in (0, {MAX_EVICT_AFTER:g}] seconds, got {seconds!r}"
        )
    return seconds


@dataclass
class Member:
    incarnation: int
    last_seen: float


class Membership:
    """The live members of one shard and the epoch of that set. Not thread-safe by itself."""

    def __init__(
        self,
        *,
        num_workers: int,
        max_workers: int = 0,
        evict_after: float = DEFAULT_EVICT_AFTER,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """``max_workers``: worker indexes ``0 .. max_workers-1`` may join (0 = ``num_workers``;
        less than ``num_workers`` is raised to it)."""
        self.num_workers = num_workers
        self.max_workers = max(max_workers, num_workers)
        self.evict_after = check_evict_after(evict_after)
        self.clock = clock
        now = clock()
        self.members: dict[int, Member] = {w: Member(0, now) for w in range(num_workers)}
        self.left: set[int] = set()
        self.used: set[int] = set(range(num_workers))
        """Every index that is or was a member: :meth:`claim` grants none of them."""
        self.epoch = 0

    @property
    def live(self) -> list[int]:
        """The members' worker indexes, ascending."""
        return sorted(self.members)

    def join(self, worker: int, incarnation: int) -> bool:
        """Make ``worker`` a member (again, after a leave or an eviction); True if the set
        changed. The caller has checked ``0 <= worker < max_workers``."""
        member = self.members.get(worker)
        now = self.clock()
        if member is not None:
            member.last_seen = now
            if incarnation:
                member.incarnation = incarnation
            return False
        self.members[worker] = Member(incarnation, now)
        self.used.add(worker)
        self.left.discard(worker)
        self.epoch += 1
        return True

    def claim(self, worker: int, incarnation: int) -> bool:
        """Take ``worker`` as a new member: True if the index was never in use here (or this
        claim is a retry: the member has this nonzero incarnation), else False and nothing
        changes (a joiner takes another index)."""
        if worker in self.used or worker in self.left or worker in self.members:  # the last
            member = self.members.get(worker)  # two as a write-ahead log's replay sets them
            return member is not None and incarnation != 0 and member.incarnation == incarnation
        return self.join(worker, incarnation)

    def see(self, worker: int, incarnation: int) -> bool:
        """A call of ``worker`` (a pull or push): implicit membership; a worker that left stays
        out, tools (-1) are no members. True if the set changed."""
        if worker < 0 or worker in self.left:
            return False
        return self.join(worker, incarnation)

    def heartbeat(self, worker: int, incarnation: int) -> bool:
        """Refresh a member's last-seen time; False if ``worker`` is not a member."""
        if worker not in self.members:
            return False
        self.join(worker, incarnation)  # a member: refreshed, the set unchanged
        return True

    def leave(self, worker: int) -> bool:
        """``worker`` has finished; True if the set changed."""
        if worker < 0:
            return False
        self.left.add(worker)
        if self.members.pop(worker, None) is None:
            return False
        self.epoch += 1
        return True

    def evict(self) -> list[int]:
        """Remove the members silent for more than ``evict_after`` seconds; returns them. The
        epoch goes up once for the whole batch."""
        deadline = self.clock() - self.evict_after
        gone = sorted(w for w, m in self.members.items() if m.last_seen < deadline)
        for worker in gone:
            del self.members[worker]
        if gone:
            self.epoch += 1
        return gone
