"""Work units: shard 0 hands out the training data in units so that a change of the workers
loses no sample and trains none twice in an epoch.

Standard library and numpy only. The rules of the wire protocol's "Work units" section
(``transport/proto/distsgd.proto``):

* the chief registers a :class:`WorkSpec` (samples N, unit size B, epochs E, seed) with shard 0;
  an epoch has ``ceil(N / B)`` units (the last may be shorter), the run
  ``ceil(E * units_per_epoch)`` (a fractional E ends with a partial epoch);
* the server deals only in (epoch, unit) numbers; a worker computes unit u of epoch e as the
  ``u``-th slice of B samples of a permutation of ``range(N)`` seeded by (seed, e);
* :meth:`WorkQueue.lease` takes the units a worker reports done and hands it more: first the
  units that came back (front of the queue), then fresh ones in order, so units of epoch e+1
  are leased once every unit of e is, and stragglers never stall the others;
* :meth:`WorkQueue.release` puts a worker's leased-but-not-done units back at the front of the
  queue: when it leaves, is evicted, or shows a new incarnation (a restart);
* a unit counts as trained each time a worker reports it done while it holds its lease; a
  report of a unit it does not hold (any more) changes nothing and is answered as ``ignored``.

The shard owns one :class:`WorkQueue` (shard 0 only) and calls it under its lock, so every
call is short whatever the run's size: a done unit and a leased unit cost O(1) (per-unit counts
live in one byte array, the per-epoch tallies are kept up to date as units are counted, a
lease's units in an ordered dict), and a :meth:`WorkQueue.tally` (every Info and LeaseWork
answer) copies the per-epoch tallies, never visiting a unit. A run has at most
:data:`MAX_TOTAL_UNITS` units: one byte each.
"""

from __future__ import annotations

import dataclasses
import math
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

MAX_LEASE = 16
"""Most units one LeaseWork may ask for (``want``)."""

MAX_HELD = 1024
"""Most units one worker may hold at once (leased and not reported done)."""

MAX_DONE = 1024
"""Most units one LeaseWork may report done."""

MAX_TOTAL_UNITS = 1 << 26
"""Most units a run may have (epochs x units per epoch): their counts live in memory, one byte
each (64 MiB at most); Register refuses a larger work spec INVALID_ARGUMENT."""
MAX_COUNT = 255
"""Reports of one unit counted at most (a count saturates here: the tally tells 0, 1, 2+)."""

MAX_EPOCHS = 1e6
"""Largest ``epochs`` a work spec may ask for."""

Unit = tuple[int, int]
"""(epoch, unit of that epoch)."""


@dataclass(frozen=True, kw_only=True)
class WorkSpec:
    """What the chief registers: how the data is cut into units, for how many epochs."""

    samples: int
    unit_size: int
    epochs: float
    seed: int = 0

    def __post_init__(self) -> None:
        if self.samples < 1:
            raise ValueError(f"work samples must be at least 1, got {self.samples}")
        if not 1 <= self.unit_size <= self.samples:
            raise ValueError(
                f"work unit_size {self.unit_size} must be in 1..{self.samples} (the samples); "
                "lower --batch-size"
            )
        if not (math.isfinite(self.epochs) and 0 < self.epochs <= MAX_EPOCHS):
            raise ValueError(f"work epochs must be in (0, {MAX_EPOCHS:g}], got {self.epochs!r}")
        if self.total_units > MAX_TOTAL_UNITS:
            raise ValueError(
                f"work of {self.total_units} units exceeds the server's cap of {MAX_TOTAL_UNITS} "
                "units; raise the unit size (--batch-size) or train fewer epochs"
            )

    @property
    def units_per_epoch(self) -> int:
        return -(-self.samples // self.unit_size)

    @property
    def total_units(self) -> int:
        return max(1, math.ceil(self.epochs * self.units_per_epoch - 1e-9))

    @property
    def num_epochs(self) -> int:
        """Epochs the run touches (the last may be partial)."""
        return -(-self.total_units // self.units_per_epoch)

    def units_in(self, epoch: int) -> int:
        """How many units epoch ``epoch`` has (the last epoch of a fractional E fewer)."""
        if epoch < self.num_epochs - 1:
            return self.units_per_epoch
        return self.total_units - (self.num_epochs - 1) * self.units_per_epoch

    def check_unit(self, unit: Unit) -> str | None:
        """Why ``unit`` is not a unit of this run, or None."""
        epoch, index = unit
        if not 0 <= epoch < self.num_epochs:
            return f"epoch {epoch} is outside 0..{self.num_epochs - 1}"
        if not 0 <= index < self.units_in(epoch):
            return f"unit {index} of epoch {epoch} is outside 0..{self.units_in(epoch) - 1}"
        return None


@dataclass
class Lease:
    incarnation: int
    units: dict[Unit, None] = field(default_factory=dict)
    """Leased and not reported done, in the order handed out (a dict: O(1) to find one)."""


@dataclass(frozen=True, kw_only=True)
class LeaseResult:
    """What one :meth:`WorkQueue.lease` did."""

    units: list[Unit]
    """Every unit this worker holds now, not yet reported done (earlier leases included: a
    lost answer loses nothing), in the order handed out."""
    ignored: list[Unit]
    """Units reported done that this worker does not hold (a new incarnation or an eviction
    gave them back to the queue): not counted."""


class WorkQueue:
    """The units of one run, who holds which, and how often each was trained. Not thread-safe by
    itself: the shard calls it under its lock."""

    def __init__(self, spec: WorkSpec) -> None:
        self.spec = spec
        self._counts = np.zeros(spec.total_units, np.uint8)
        """Per unit, epoch-major: how many times it was reported done (at most MAX_COUNT)."""
        epochs = spec.num_epochs
        self._once = np.zeros(epochs, np.int64)
        self._twice = np.zeros(epochs, np.int64)
        self._never = np.array([spec.units_in(e) for e in range(epochs)], np.int64)
        """Per epoch: units counted once, twice or more, never (kept up to date)."""
        self.units_done = 0
        """Distinct units reported done at least once."""
        self.next_fresh = 0
        """Units (in epoch-major order) handed out fresh so far."""
        self.returned: deque[Unit] = deque()
        """Units given back by workers that went away; leased again before fresh ones."""
        self.leases: dict[int, Lease] = {}

    @property
    def counts(self) -> list[list[int]]:
        """Per epoch, per unit: how many times it was reported done (built on each call: a
        unit at a time is O(total units), for checkpoints and tests)."""
        per = self.spec.units_per_epoch
        return [
            self._counts[e * per : e * per + self.spec.units_in(e)].tolist()
            for e in range(self.spec.num_epochs)
        ]

    def count(self, unit: Unit) -> int:
        """How many times ``unit`` was reported done."""
        return int(self._counts[unit[0] * self.spec.units_per_epoch + unit[1]])

    def _counted(self, unit: Unit) -> None:
        """One more report of ``unit`` done: its count and its epoch's tally, in O(1)."""
        epoch, index = unit
        at = epoch * self.spec.units_per_epoch + index
        count = int(self._counts[at])
        if count == 0:
            self.units_done += 1
            self._never[epoch] -= 1
            self._once[epoch] += 1
        elif count == 1:
            self._once[epoch] -= 1
            self._twice[epoch] += 1
        self._counts[at] = min(count + 1, MAX_COUNT)

    @property
    def finished(self) -> bool:
        """Every unit of every epoch was trained."""
        return self.units_done >= self.spec.total_units

    @property
    def epoch(self) -> int:
        """The epoch the next fresh unit belongs to (``num_epochs`` once all are out)."""
        return self.next_fresh // self.spec.units_per_epoch

    @property
    def progress(self) -> float:
        """Units done / total units, in [0, 1]."""
        return self.units_done / self.spec.total_units

    def held(self, worker: int) -> list[Unit]:
        lease = self.leases.get(worker)
        return [] if lease is None else list(lease.units)

    def seen(self, worker: int, incarnation: int) -> list[Unit]:
        """A call of ``worker`` as ``incarnation``: a new incarnation (a restart) gives the old
        one's units back; returns them."""
        lease = self.leases.get(worker)
        if lease is None or lease.incarnation == incarnation or not incarnation:
            return []
        return self.release(worker)

    def release(self, worker: int) -> list[Unit]:
        """Give ``worker``'s leased-but-not-done units back (front of the queue, in order);
        returns them."""
        lease = self.leases.pop(worker, None)
        if lease is None:
            return []
        units = list(lease.units)
        self.returned.extendleft(reversed(units))
        return units

    def _take(self) -> Unit | None:
        while self.returned:
            unit = self.returned.popleft()
            if self.count(unit) == 0:  # not trained by anyone meanwhile
                return unit
        if self.next_fresh >= self.spec.total_units:
            return None
        unit = divmod(self.next_fresh, self.spec.units_per_epoch)
        self.next_fresh += 1
        return unit

    def lease(
        self,
        worker: int,
        incarnation: int,
        *,
        done: Iterable[Unit],
        want: int,
        member: bool = True,
    ) -> LeaseResult:
        """Count ``done`` (units ``worker`` holds), then lease it up to ``want`` more units (a
        ``member`` only: a worker that left gets none; at most :data:`MAX_HELD` held). The
        caller checked every unit with :meth:`WorkSpec.check_unit` and ``want <= MAX_LEASE``."""
        self.seen(worker, incarnation)
        lease = self.leases.get(worker)
        if lease is None:
            lease = self.leases[worker] = Lease(incarnation)
        ignored: list[Unit] = []
        for unit in done:
            if unit not in lease.units:
                ignored.append(unit)
                continue
            del lease.units[unit]
            self._counted(unit)
        limit = min(MAX_HELD, len(lease.units) + want)
        while member and len(lease.units) < limit:
            fresh = self._take()
            if fresh is None:
                break
            lease.units[fresh] = None
        if not lease.units:
            del self.leases[worker]
        return LeaseResult(units=list(lease.units), ignored=ignored)

    def tally(self) -> dict[str, list[int]]:
        """Per epoch: units trained once, twice or more, never (so far): a copy of the tallies
        kept as units are counted, O(epochs) and no unit visited."""
        return {
            "trained_once": self._once.tolist(),
            "trained_twice": self._twice.tolist(),
            "never_trained": self._never.tolist(),
        }

    # -- checkpoints ----------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Everything, as JSON-able values (the shard's checkpoint header carries it)."""
        return {
            "spec": dataclasses.asdict(self.spec),
            "counts": self.counts,
            "next_fresh": self.next_fresh,
            "returned": [list(u) for u in self.returned],
            "leases": {
                str(w): [lease.incarnation, [list(u) for u in lease.units]]
                for w, lease in self.leases.items()
            },
        }

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> WorkQueue:
        """The queue :meth:`state_dict` saved; ValueError (or KeyError, TypeError) if damaged."""
        queue = cls(WorkSpec(**state["spec"]))
        counts = [[int(c) for c in epoch] for epoch in state["counts"]]
        spec = queue.spec
        if [len(c) for c in counts] != [spec.units_in(e) for e in range(spec.num_epochs)]:
            raise ValueError("work counts do not match the work spec")
        flat = np.fromiter((c for epoch in counts for c in epoch), np.int64, spec.total_units)
        if (flat < 0).any():
            raise ValueError("a negative work count")
        queue._counts = np.minimum(flat, MAX_COUNT).astype(np.uint8)
        for e, epoch in enumerate(counts):
            row = np.asarray(epoch, np.int64)
            queue._once[e] = np.count_nonzero(row == 1)
            queue._twice[e] = np.count_nonzero(row >= 2)
            queue._never[e] = np.count_nonzero(row == 0)
        queue.units_done = int(np.count_nonzero(flat))
        queue.next_fresh = int(state["next_fresh"])
        queue.returned = deque((int(e), int(u)) for e, u in state["returned"])
        queue.leases = {
            int(w): Lease(int(inc), {(int(e), int(u)): None for e, u in units})
            for w, (inc, units) in state["leases"].items()
        }
        return queue
