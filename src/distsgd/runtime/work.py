"""Batches leased from shard 0's work queue (``--world-size dynamic``; see ``ps/work.py``).

A worker of an elastic run does not train a fixed shard of the data: it leases work units, a
few ahead and in the background (one call per few units, while the last leased one trains),
from shard 0 and trains them one batch each. Unit u of epoch e is the u-th slice of
``batch_size`` samples of a permutation of the training set seeded by (seed, e), the same on
every worker. A trained unit is held until a push this worker began after training it was
accepted by every shard (its update reached the servers), and reported done with the next
lease; :meth:`LeasedBatches.report` reports the rest at the end. A unit whose push was not
accepted (stale under sync, lost to a partition) is trained again by the same worker, which
still holds it. So a worker killed at any time
has reported only units whose updates the servers hold, and the others are trained again by
someone else, never counted twice.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch
from torch.utils.data import Dataset

from distsgd.control.config import TrainConfig
from distsgd.ps.client import ParameterClient
from distsgd.ps.work import MAX_LEASE, Unit
from distsgd.runtime.data import fetch
from distsgd.transport.proto import distsgd_pb2 as pb

log = logging.getLogger(__name__)

LEASE_AHEAD = 3
"""Units a worker leases beyond the one it trains: it calls LeaseWork once every this many
units (reporting those trained meanwhile), not once a step."""


def work_spec(work: Dataset[Any], config: TrainConfig) -> pb.WorkSpec:
    """The work spec the chief registers with shard 0 (one unit = one batch)."""
    samples, batch_size = len(work), config.batch_size  # type: ignore[arg-type]
    if batch_size > samples:
        raise ValueError(
            f"batch_size {batch_size} is larger than the training set's {samples} samples; "
            "lower --batch-size"
        )
    return pb.WorkSpec(
        samples=samples, unit_size=batch_size, epochs=config.epochs, seed=config.seed
    )


def epoch_order(samples: int, seed: int, epoch: int) -> torch.Tensor:
    """The permutation of ``range(samples)`` whose consecutive slices are ``epoch``'s units."""
    generator = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    return torch.randperm(samples, generator=generator)


class LeasedBatches:
    """Batches of the units leased from shard 0; ends when the queue has none left for this
    worker (every unit trained, or the rest held by others) or ``stop`` is set.

    The loop calls :meth:`trained` after each batch's backward with the number of the latest
    push begun (``WorkerContext.pushes_started``), :meth:`settle` with the pushes' outcomes
    (``WorkerContext.push_outcomes``) before each batch, and :meth:`report` at the end."""

    def __init__(
        self,
        dataset: Dataset[Any],
        *,
        ps: ParameterClient,
        batch_size: int,
        seed: int,
        ahead: int = LEASE_AHEAD,
        stop: threading.Event | None = None,
    ) -> None:
        if not 0 <= ahead < MAX_LEASE:
            raise ValueError(f"lease ahead must be in 0..{MAX_LEASE - 1}, got {ahead}")
        self.dataset = dataset
        self.samples = len(dataset)  # type: ignore[arg-type]
        self.ps = ps
        self.batch_size = batch_size
        self.seed = seed
        self.want = ahead + 1
        self.stop = stop
        self.steps_per_epoch = max(1, -(-self.samples // batch_size))
        self.epoch = 0
        """The epoch of the unit served last."""
        self.pending: deque[Unit] = deque()
        """Leased, not yet served."""
        self.current: Unit | None = None
        """Served, its backward not yet done."""
        self.held: list[tuple[Unit, int]] = []
        """Trained: (unit, number of the latest push begun before its update was made)."""
        self.ready: list[Unit] = []
        """Trained and on the servers: reported with the next lease."""
        self.trained_units: list[Unit] = []
        """Every unit this worker trained, in order (for tests and logs)."""
        self.status = pb.WorkStatus()
        """The queue's status, as last heard."""
        self.ignored = 0
        """Reports the queue did not count (the unit had gone back to the queue meanwhile)."""
        self.retrained = 0
        """Units trained again because the push that held their update was not accepted."""
        self._outcomes: dict[int, bool] = {}
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="work-lease")
        self._inflight: Future[pb.LeaseResponse] | None = None
        self._cache: tuple[int, torch.Tensor] | None = None

    @property
    def position(self) -> tuple[int, int]:
        """(epoch, 0): where this worker stands; the queue on shard 0 knows the rest."""
        return self.epoch, 0

    def seek(self, position: tuple[int, int]) -> None:
        """Nothing to do: what is left to train lives in shard 0's queue, not in the worker."""

    @property
    def progress(self) -> tuple[int, int]:
        """(units done, total units) of the whole run, as last heard (for the lr schedule)."""
        return int(self.status.units_done), max(1, int(self.status.total_units))

    @property
    def finished(self) -> bool:
        return bool(self.status.finished)

    def trained(self, pushes_started: int) -> None:
        """The unit served last has had its backward; its update enters the pushes begun after
        push number ``pushes_started``."""
        if self.current is not None:
            self.held.append((self.current, pushes_started))
            self.trained_units.append(self.current)
            self.current = None

    def settle(self, outcomes: deque[tuple[int, bool]]) -> None:
        """Take the ended pushes' (number, accepted) out of ``outcomes``: a held unit whose
        update was in an accepted push becomes reportable; one whose push was not accepted is
        trained again (this worker still holds it)."""
        while outcomes:
            number, ok = outcomes.popleft()
            self._outcomes[number] = ok
        keep: list[tuple[Unit, int]] = []
        for unit, mark in self.held:
            accepted: bool | None = self._outcomes.get(mark + 1)  # first push after its backward
            if accepted is None:
                keep.append((unit, mark))
            elif accepted:
                self.ready.append(unit)
            else:
                self.pending.appendleft(unit)
                self.retrained += 1
        self.held = keep
        floor = min((mark + 1 for _, mark in keep), default=None)
        self._outcomes = {
            n: ok for n, ok in self._outcomes.items() if floor is not None and n >= floor
        }

    def lease(self, want: int) -> pb.LeaseResponse:
        """Report the ready units and lease ``want`` more, now (after the call in flight, if
        any); what this worker holds comes back."""
        self._land()
        self._send(want)
        reply = self._land()
        assert reply is not None
        return reply

    def _send(self, want: int) -> None:
        """Start a LeaseWork in the background: the ready units and ``want`` more."""
        assert self._inflight is None
        done, self.ready = self.ready, []
        self._inflight = self._pool.submit(self.ps.lease_work, done, want)

    def _land(self) -> pb.LeaseResponse | None:
        """Wait for the call in flight (None if none) and take in its answer."""
        if self._inflight is None:
            return None
        future, self._inflight = self._inflight, None
        reply = future.result()
        self.status = reply.status
        self.ignored += len(reply.ignored)
        if reply.ignored:
            log.warning(
                "%d work unit(s) reported done were no longer this worker's; not counted",
                len(reply.ignored),
            )
        known = set(self.pending) | {u for u, _ in self.held} | set(self.ready)
        if self.current is not None:
            known.add(self.current)
        for item in reply.units:
            unit = (item.epoch, item.unit)
            if unit not in known:  # new, or leased in an answer that was lost
                self.pending.append(unit)
        return reply

    def report(self, outcomes: deque[tuple[int, bool]]) -> pb.WorkStatus:
        """(At the end, after the scheme's last push) report every trained unit whose update
        reached the servers; the rest (and any not trained) go back with the Leave."""
        self.settle(outcomes)
        if self.held:
            log.warning(
                "%d trained work unit(s) not reported: no push of them was accepted",
                len(self.held),
            )
        self.lease(0)
        self._pool.shutdown(wait=False)
        return self.status

    def _indices(self, unit: Unit) -> torch.Tensor:
        epoch, index = unit
        if self._cache is None or self._cache[0] != epoch:
            self._cache = (epoch, epoch_order(self.samples, self.seed, epoch))
        order = self._cache[1]
        return order[index * self.batch_size : (index + 1) * self.batch_size]

    def __iter__(self) -> Iterator[Any]:
        while not (self.stop is not None and self.stop.is_set()):
            if self._inflight is not None and (self._inflight.done() or not self.pending):
                self._land()
            if self._inflight is None and len(self.pending) <= 1:
                # one call per `ahead` units, in the background while the last one trains
                self._send(self.want - len(self.pending))
                if not self.pending:
                    self._land()
            if not self.pending:
                return  # every unit trained, or the rest held by others: this worker is done
            unit = self.pending.popleft()
            self.current = unit
            self.epoch = unit[0]
            yield fetch(self.dataset, self._indices(unit))


def wait_members_gone(
    ps: ParameterClient, rank: int, timeout: float, poll: float = 0.05
) -> pb.WorkStatus:
    """(Chief, after its Leave) wait until shard 0 has no member but this worker and the work
    queue is finished, or nothing changed for ``timeout`` seconds; the queue's last status.

    A worker killed meanwhile is waited for until it is evicted or comes back: its units go
    back to the queue and whoever holds work trains them."""
    last: tuple[Any, ...] | None = None
    changed = time.monotonic()
    while True:
        info = ps.shards[0].info()
        others = [m for m in info.members if m != rank]
        state = (tuple(others), info.work.units_done, info.version)
        if not others and info.work.finished:
            return info.work
        now = time.monotonic()
        if state != last:
            last, changed = state, now
        elif now - changed > timeout:
            log.warning(
                "workers %s still members, %d of %d work units trained, nothing moved for "
                "%.0fs; evaluating anyway",
                others,
                info.work.units_done,
                info.work.total_units,
                timeout,
            )
            return info.work
        time.sleep(poll)
